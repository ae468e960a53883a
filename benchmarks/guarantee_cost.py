"""What the guarantees add to a batch-1 answer: the same runtime with and without them, paired, in one process.

Loads one artifact built with guarantees (a calibration split) into the server's runtime (the backend, threads
and precision the server would choose), then answers the same one-input request over and over through the
full path (the batcher, the fused pass, the uncertainty and OOD scores, the answer's model), alternating:

* ``with``: as served: the OOD p-value, the flag at the request's level, the prediction set, the risk
  decision, the drift test's update and the guarantees' metrics (``Runtime._guarantees``);
* ``without``: the same runtime with its guarantees detached (``Runtime.guarantees = None``).

Each repetition times a block of ``--block`` answers of each, in alternating order, and the ratio
``with / without`` is taken per repetition (paired: both see the same machine state). Reports min / min and
the median of the paired ratios, and the time of ``_guarantees`` alone per answer. Target: <= 1.01.

    python benchmarks/guarantee_cost.py --artifact artifacts/default/text
    python benchmarks/guarantee_cost.py --artifact artifacts/default/image --repeats 15

Writes ``benchmarks/results/guarantee_cost/<name>.json``. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from benchmarks import harness  # noqa: E402 (after the path)


async def measure(rt: Any, prepared: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from service.runtimes.base import Query

    g, drift = rt.guarantees, rt.drift
    query = Query(top_k=1)

    async def block(on: bool) -> float:
        rt.guarantees, rt.drift = (g, drift) if on else (None, None)
        t = time.perf_counter()
        for _ in range(args.block):
            await rt.answer(prepared, query, t0=time.perf_counter())
        return (time.perf_counter() - t) * 1000 / args.block

    for on in (True, False, True, False):  # warm-up: caches, allocator, the branch predictor of both paths
        await block(on)
    with_ms, without_ms = [], []
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for on in order:
            (with_ms if on else without_ms).append(await block(on))
    rt.guarantees, rt.drift = g, drift
    # the guarantees' own step, alone: on one answer's results
    out = await rt.outcome(prepared, query)
    t = time.perf_counter()
    for _ in range(args.block * 10):
        rt._guarantees(out.results, query)
    alone_ms = (time.perf_counter() - t) * 1000 / (args.block * 10)
    paired = [w / o for w, o in zip(with_ms, without_ms, strict=True)]
    return {
        "with_ms": {"min": round(min(with_ms), 4), "median": round(statistics.median(with_ms), 4)},
        "without_ms": {"min": round(min(without_ms), 4), "median": round(statistics.median(without_ms), 4)},
        "ratio_min_over_min": round(min(with_ms) / min(without_ms), 4),
        "ratio_median_paired": round(statistics.median(paired), 4),
        "guarantees_step_ms": round(alone_ms, 4),
        "guarantees_step_share": round(alone_ms / statistics.median(without_ms), 5),
        "repetitions": {"with_ms": [round(v, 4) for v in with_ms], "without_ms": [round(v, 4) for v in without_ms]},
    }


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from service.metrics import Metrics
    from service.runtimes import load_runtime
    from service.settings import Settings

    rt = load_runtime(args.artifact, Settings(artifacts=[str(args.artifact)]), Metrics())
    if rt.guarantees is None:
        raise SystemExit(f"{args.artifact}: built without guarantees (no calibration split): nothing to measure")
    rt.start()
    try:
        body = harness.payload(rt.manifest)
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
    args = p.parse_args(argv)
    if args.repeats < 1 or args.block < 1:
        p.error("--repeats and --block must be positive")
    result, rt = asyncio.run(run(args))
    name = rt.name
    doc = {
        "command": "python benchmarks/guarantee_cost.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "name": name, "backend": rt.describe().get("backend"), "precision": rt.describe().get("precision"),
        "batch": 1, **result, "machine": harness.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    out = harness.write_result(doc, args.out or harness.ROOT / "benchmarks/results/guarantee_cost" / f"{name}.json",
                               f"{name}.json")  # fmt: skip
    print(
        f"{name} batch 1 on {harness.cpu_name()}: with {doc['with_ms']} ms, without {doc['without_ms']} ms; "
        f"with/without min/min {doc['ratio_min_over_min']}, median of paired ratios {doc['ratio_median_paired']}; "
        f"_guarantees alone {doc['guarantees_step_ms']} ms ({100 * doc['guarantees_step_share']:.2f} %)"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
