"""What the guarantees add to a batch-1 answer: the same runtime with and without them, paired, in one process.

Loads one artifact built with guarantees (a calibration split) into the server's runtime (the backend, threads
and precision the server would choose), then answers the same one-input request over and over through the
full path (the batcher, the fused pass, the uncertainty and OOD scores, the answer's model), alternating:

* ``with``: as served: the OOD p-value, the flag at the request's level, the prediction set, the risk
  decision, the drift test's update and the guarantees' metrics (``Runtime._guarantees``);
* ``without``: the same runtime with its guarantees detached (``Runtime.guarantees = None``).

Each repetition times ``--block`` answers of each, alternating call by call, and the ratio ``with / without``
of their means is taken per repetition (paired: both see the same machine state). Reports min / min and
the median of the paired ratios, the time of ``_guarantees`` inside the answers (right after the model, where it
runs) and alone. Target: <= 1.01.

    python -m benchmarks.guarantee_cost --artifact artifacts/default/text
    python -m benchmarks.guarantee_cost --artifact artifacts/default/image --repeats 15

Writes ``benchmarks/results/guarantee_cost/<name>.json``. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault(
    "OMP_WAIT_POLICY", "PASSIVE"
)  # the server's OpenMP setting (service.entrypoints.app), before torch

from benchmarks import harness
from benchmarks.cli_args import parse_positive


async def measure(rt: Any, prepared: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The paired timings of ``prepared`` answered with and without the guarantees, and the guarantees' own step
    inside the answers and alone."""
    from service.runtime.interface import Query

    query = Query(top_k=1)
    with_ms, without_ms = await _paired(rt, prepared, query, args)
    answer_ms, in_path_ms = await _step_in_path(rt, prepared, query, args.block * 10)
    alone_ms = await _step_alone(rt, prepared, query, args.block * 10)
    paired = [w / o for w, o in zip(with_ms, without_ms, strict=True)]
    return {
        "with_ms": {"min": round(min(with_ms), 4), "median": round(statistics.median(with_ms), 4)},
        "without_ms": {"min": round(min(without_ms), 4), "median": round(statistics.median(without_ms), 4)},
        "ratio_min_over_min": round(min(with_ms) / min(without_ms), 4),
        "ratio_median_paired": round(statistics.median(paired), 4),
        "guarantees_step_in_path_ms": round(in_path_ms, 4),
        "guarantees_step_in_path_share": round(in_path_ms / answer_ms, 5),
        "guarantees_step_ms": round(alone_ms, 4),
        "guarantees_step_share": round(alone_ms / statistics.median(without_ms), 5),
        "repetitions": {"with_ms": [round(v, 4) for v in with_ms], "without_ms": [round(v, 4) for v in without_ms]},
    }


async def _paired(rt: Any, prepared: list[Any], query: Any, args: argparse.Namespace) -> tuple[list, list]:
    """Mean ms per answer with and without the guarantees, one pair per repetition (after 4 warm-up blocks)."""
    from service.api.answers import predict_answer

    g, drift = rt.guarantees, rt.drift

    async def one(on: bool) -> float:
        rt.guarantees, rt.drift = (g, drift) if on else (None, None)
        t = time.perf_counter()
        predict_answer(rt, await rt.outcome(prepared, query), query, t, "")
        return time.perf_counter() - t

    async def block(first: bool) -> tuple[float, float]:
        """``args.block`` answers of each, alternating call by call; mean ms of (with, without)."""
        tw = to = 0.0
        for i in range(2 * args.block):
            on = (i % 2 == 0) == first
            dt = await one(on)
            if on:
                tw += dt
            else:
                to += dt
        return tw * 1000 / args.block, to * 1000 / args.block

    for r in range(4):  # warm-up: caches, allocator, the branch predictor of both paths
        await block(r % 2 == 0)
    with_ms, without_ms = [], []
    for r in range(args.repeats):
        w, o = await block(r % 2 == 0)
        with_ms.append(w)
        without_ms.append(o)
    rt.guarantees, rt.drift = g, drift
    return with_ms, without_ms


async def _step_in_path(rt: Any, prepared: list[Any], query: Any, n: int) -> tuple[float, float]:
    """Mean ms of a whole answer and of the guarantees' step inside it, over ``n`` answers.

    The guarantees' step where it runs, right after the model (cold caches): timed inside the answers.
    """
    from service.api.answers import predict_answer

    spent, step = [0.0, 0], rt._guarantees

    def timed(results: Any, q: Any) -> None:
        t = time.perf_counter()
        step(results, q)
        spent[0] += time.perf_counter() - t
        spent[1] += 1

    rt._guarantees = timed
    t = time.perf_counter()
    for _ in range(n):
        predict_answer(rt, await rt.outcome(prepared, query), query, time.perf_counter(), "")
    answer_ms = (time.perf_counter() - t) * 1000 / n
    del rt._guarantees
    return answer_ms, spent[0] * 1000 / spent[1]


async def _step_alone(rt: Any, prepared: list[Any], query: Any, n: int) -> float:
    """Mean ms of the guarantees' own step, alone, ``n`` times on one answer's results."""
    out = await rt.outcome(prepared, query)
    t = time.perf_counter()
    for _ in range(n):
        rt._guarantees(out.results, query)
    return (time.perf_counter() - t) * 1000 / n


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from service.metrics import Metrics
    from service.runtime import load_runtime
    from service.settings import Settings

    rt = load_runtime(args.artifact, Settings(artifacts=[str(args.artifact)]), Metrics())
    if rt.guarantees is None:
        raise SystemExit(f"{args.artifact}: built without guarantees (no calibration split): nothing to measure")
    rt.start()
    try:
        body = harness.payload(rt.manifest.to_dict())
        field = "text" if "text" in body else "image"
        prepared = rt.prepare([body[field]], field, base64_encoded=field == "image")
        return await measure(rt, prepared, args), rt
    finally:
        await rt.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True, help="an artifact built with guarantees")
    p.add_argument("--repeats", type=int, default=11, help="paired repetitions")
    p.add_argument("--block", type=int, default=50, help="answers per timed block")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default results/guarantee_cost/<name>.json)")
    args = parse_positive(p, argv, "repeats", "block")
    result, rt = asyncio.run(run(args))
    name = rt.name
    doc = {
        "command": "python -m benchmarks.guarantee_cost " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "name": name,
        "backend": rt.describe().get("backend"),
        "precision": rt.describe().get("precision"),
        "batch": 1,
        **result,
        "machine": harness.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = harness.write_result(
        doc, args.out or harness.ROOT / "benchmarks/results/guarantee_cost" / f"{name}.json", f"{name}.json"
    )
    print(
        f"{name} batch 1 on {harness.cpu_name()}: with {doc['with_ms']} ms, without {doc['without_ms']} ms; "
        f"with/without min/min {doc['ratio_min_over_min']}, median of paired ratios {doc['ratio_median_paired']}; "
        f"_guarantees in the answer path {doc['guarantees_step_in_path_ms']} ms "
        f"({100 * doc['guarantees_step_in_path_share']:.2f} %), alone {doc['guarantees_step_ms']} ms"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
