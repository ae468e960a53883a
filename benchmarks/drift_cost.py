"""What the shared drift alarm costs per answer: one server-wide alarm (``SharedDriftMonitor``, its state in a file
under ``flock``) against one worker's own (``DriftMonitor``, in memory), paired, in one process.

Both monitors are fitted on the same calibration scores (drawn from a standard normal: the cost does not depend on
the scores' law) and fed the same chunks of ID scores, alternating block by block: a chunk of 1 score (a lone
request, the default policy's feed) and of 32 (a full batch). Each repetition times ``--block`` updates of each
monitor; the figures are the min and the median over repetitions of the time per update, and the shared alarm's
extra time per answer (the difference of the medians, divided by the chunk's size). Nothing else should run on the
machine meanwhile.

    python -m benchmarks.drift_cost
    python -m benchmarks.drift_cost --repeats 3 --block 50     # the shortest run (the scripts' test)

Writes ``benchmarks/results/drift_cost.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.cli_args import parse_positive, parser

CHUNKS = (1, 32)


def _time_block(monitor: Any, chunks: list[list[float]]) -> float:
    """Seconds per update over ``chunks``."""
    t0 = time.perf_counter()
    for c in chunks:
        monitor.update(c)
    return (time.perf_counter() - t0) / len(chunks)


def measure(size: int, repeats: int, block: int, folder: Path) -> dict[str, Any]:
    """The paired timings of ``block`` updates of ``size`` scores each, local against shared."""
    from service.core.drift import DriftMonitor
    from service.core.drift_shared import SharedDriftMonitor

    rng = np.random.default_rng(0)
    calibration = rng.standard_normal(2000)
    local = DriftMonitor(calibration, delta=0.01)
    shared = SharedDriftMonitor(folder / f"drift-{size}.state", calibration, delta=0.01)
    times: dict[str, list[float]] = {"local": [], "shared": []}
    for _ in range(repeats):
        chunks = rng.standard_normal((block, size)).tolist()
        for name, monitor in (("local", local), ("shared", shared)):
            times[name].append(_time_block(monitor, chunks))
    if local.count != shared.count or local.log10_statistic != shared.log10_statistic:
        raise RuntimeError("the shared and the local monitor disagree on the same scores")
    us = {k: [1e6 * v for v in vs] for k, vs in times.items()}
    extra = statistics.median(us["shared"]) - statistics.median(us["local"])
    return {
        "chunk": size,
        **{
            f"{k}_us_per_update": {"min": round(min(v), 2), "median": round(statistics.median(v), 2)}
            for k, v in us.items()
        },
        "shared_extra_us_per_answer": round(extra / size, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "benchmarks/results/drift_cost.json")
    p.add_argument("--repeats", type=int, default=15, help="repetitions (each: a block of each monitor)")
    p.add_argument("--block", type=int, default=2000, help="updates per block")
    args = parse_positive(p, argv, "repeats", "block")
    with tempfile.TemporaryDirectory(prefix="hydra-drift-cost-") as tmp:
        rows = [measure(size, args.repeats, args.block, Path(tmp)) for size in CHUNKS]
    for r in rows:
        print(
            f"chunk {r['chunk']:3d}: local {r['local_us_per_update']['median']:8.2f} us, shared "
            f"{r['shared_us_per_update']['median']:8.2f} us per update (median); shared adds "
            f"{r['shared_extra_us_per_answer']:.2f} us per answer"
        )
    result = {
        "command": "python -m benchmarks.drift_cost " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "rows": rows,
    }
    print(f"wrote {harness.save_run(result, args.out, 'drift_cost.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
