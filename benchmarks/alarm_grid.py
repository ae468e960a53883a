"""Which mixture of bets the drift alarm uses: candidates compared on synthetic shifts only, never on a test stream.

Each candidate is a list of components (levels, stake, weight) of :class:`service.core.drift.TailBets`; the alarm is
the weighted mean of the components' CUSUM e-detectors (``service/core/drift.py``), and every candidate has the same
false-alarm bound. Every stake is cut so that no input pays more than ``MAX_PAYOFF`` (10^0.8): from a quiet state a
burst of 5 foreign inputs reaches at most 10^4 < A, so no candidate fires on one (the table shows each one's
figure). They are compared where no model and no test data enter:

* **shifts**: the calibration split is ``n`` uniform scores; after the change, a share ``pi`` of the inputs has
  p-values from ``Beta(a, 1)`` (mass near 0: outlying scores) and the rest stay uniform, over a grid of ``pi`` and
  ``a``. Lorden's bound for each, ``log A / KL``, uses the KL of the p-values binned as the stream benchmark bins
  them (``benchmarks/stream_figures.py``' ``P_BINS``), so the ratio is the one the stream benchmark reports. The
  shifts kept are those whose bound is at most 50 inputs (the issue's scope).
* **the null**: 100 streams of 10,000 uniform scores, a fresh split each: the alarms, against the bound
  ``delta + 10^4 / A`` (11 %).

* **clearing**: 300 inputs above every calibration score, then uniform inputs: the median inputs until the alarm is
  off (the server stays suspended that long after a shift ends).

The rule: the candidate with the smallest median of (mean delay / Lorden's bound) over the shifts, among those whose
null alarms are within the bound and whose clearing takes at most ``CLEAR_SLACK`` (1.5) times the previous bet's;
ties go to fewer components. ``service.core.drift.COMPONENTS`` is the chosen one
(``tests/benchmarks/test_alarm_grid.py`` holds the two together).

    python -m benchmarks.alarm_grid                  # about 4 min on 2 cores
    python -m benchmarks.alarm_grid --runs 20 --null-runs 5 --out /tmp/x.json   # the shortest (the scripts' test)

Writes ``benchmarks/results/alarm_grid.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.cli_args import parse_positive, parser
from benchmarks.stream_figures import P_BINS

DELTA = 0.01
CALIBRATION = 2000  # the default image build's split
STEPS = 1500  # inputs after the change (a run that never alarms counts as this: a lower bound of its delay)
SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
SHAPES = (0.05, 0.15, 0.3, 0.5, 0.7)
SCOPE = 50.0  # shifts whose bound is at most this many inputs
SERVED = ((0.05, 0.1, 0.2), 0.25)  # the previous alarm's one bet


def _grid(levels: tuple[float, ...], stakes: tuple[float, ...], served_weight: float) -> list[tuple[Any, ...]]:
    """The previous bet at ``served_weight`` and one single-level bet per (level, stake), sharing the rest."""
    k = len(levels) * len(stakes)
    return [(*SERVED, served_weight)] + [((c,), st, (1 - served_weight) / k) for c in levels for st in stakes]


CANDIDATES: dict[str, list[tuple[Any, ...]]] = {
    "previous (one bet)": [SERVED],
    "three stakes": [(SERVED[0], st) for st in (0.25, 0.5, 0.9)],
    "4 levels x 3 stakes": [((c,), st) for c in (0.01, 0.05, 0.2, 0.5) for st in (0.2, 0.5, 0.9)],
    "previous 1/2 + 3 levels x 2 stakes": _grid((0.01, 0.05, 0.2), (0.5, 0.9), 0.5),
    "previous 3/10 + 3 levels x 3 stakes": _grid((0.01, 0.05, 0.2), (0.25, 0.5, 0.9), 0.3),
    "previous 3/10 + 4 levels x 3 stakes": _grid((0.005, 0.02, 0.05, 0.2), (0.25, 0.5, 0.9), 0.3),
    "previous 3/10 + 6 levels x 3 stakes": _grid((0.002, 0.005, 0.01, 0.02, 0.05, 0.2), (0.25, 0.5, 0.9), 0.3),
    "previous 1/2 + 5 levels x 2 stakes": _grid((0.005, 0.01, 0.02, 0.05, 0.2), (0.5, 0.9), 0.5),
    "previous 3/10 + 3 levels x 3 stakes, from 0.02": _grid((0.02, 0.05, 0.2), (0.25, 0.5, 0.9), 0.3),
    "previous 1/2 + 4 levels x 2 stakes, from 0.02": _grid((0.02, 0.05, 0.1, 0.2), (0.5, 0.9), 0.5),
}
CLEAR_SLACK = 1.5  # a candidate must clear within this many times the previous bet's inputs after a long shift


def binned_kl(share: float, shape: float) -> float:
    """KL of the shifted p-values' law ``(1 - pi) U + pi Beta(a, 1)`` from uniform, binned in :data:`P_BINS`."""
    q = np.diff((1 - share) * P_BINS + share * P_BINS**shape)
    u = np.diff(P_BINS)
    return float(np.sum(q * np.log(q / u)))


def shifts(log_a: float) -> list[tuple[float, float, float]]:
    """``(pi, a, bound)`` of the shifts in scope."""
    out = []
    for share in SHARES:
        for shape in SHAPES:
            bound = log_a / binned_kl(share, shape)
            if bound <= SCOPE:
                out.append((share, shape, bound))
    return out


def evaluate(components: list[tuple[Any, ...]], runs: int, null_runs: int, seed: int = 0) -> dict[str, Any]:
    """One candidate's mean delay per shift, its ratios to the bound, and its null alarms."""
    from service.core.drift import CAP_DECADES, HORIZON, TailBets, alarm_paths

    rng = np.random.default_rng(seed)
    log_a = math.log(HORIZON / DELTA)
    cap = log_a + CAP_DECADES * math.log(10)
    bets = TailBets.fit(rng.random(CALIBRATION), DELTA, components)
    rows = []
    for share, shape, bound in shifts(log_a):
        foreign = rng.random((runs, STEPS)) < share
        p = np.where(foreign, rng.random((runs, STEPS)) ** (1 / shape), rng.random((runs, STEPS)))
        _, on = alarm_paths(bets.log_e(1 - p), log_a, cap, bets.log_weights)
        delay = np.where(on.any(axis=1), on.argmax(axis=1) + 1, STEPS)
        rows.append({"share": share, "shape": shape, "bound": round(bound, 1), "delay": round(float(delay.mean()), 1)})
    # clearing: 300 inputs above every calibration score (every component at its cap), then uniform inputs
    back = np.concatenate([np.full((runs, 300), 2.0), rng.random((runs, STEPS))], axis=1)
    _, on = alarm_paths(bets.log_e(back), log_a, cap, bets.log_weights)
    after = on[:, 300:]
    cleared = np.where(~after.all(axis=1), (~after).argmax(axis=1) + 1, STEPS)
    alarms = 0
    m = [math.floor(c * (CALIBRATION + 1)) - 1 for c in bets.levels]
    for _ in range(null_runs):  # a fresh split per stream: the null exactly
        split = -np.sort(-rng.random(CALIBRATION))
        fresh = type(bets)(bets.levels, split[m], bets.upper, bets.stakes, bets.members, bets.weights)
        _, on = alarm_paths(fresh.log_e(rng.random((1, 10_000))), log_a, cap, bets.log_weights)
        alarms += int(on.any())
    ratios = [r["delay"] / r["bound"] for r in rows]
    return {
        "components": len(bets.stakes),
        "burst_log10": round(float(burst_log10(bets)), 2),
        "median_ratio": round(statistics.median(ratios), 3),
        "worst_ratio": round(max(ratios), 3),
        "clear_median": float(np.median(cleared)),
        "null_alarms": alarms,
        "null_runs": null_runs,
        "null_bound": round(null_runs * (DELTA + 10_000 / (HORIZON / DELTA)), 1),
        "shifts": rows,
    }


def burst_log10(bets: Any) -> float:
    """``log10`` of the statistic after :data:`~service.core.drift.BURST` inputs above every calibration score, from a
    fresh start (below ``log10 A`` = 5: a burst does not fire the alarm)."""
    from service.core.drift import BURST, log_mix

    return float(log_mix(BURST * bets.max_log_e, bets.log_weights)) / math.log(10)


def choose(results: dict[str, dict[str, Any]]) -> str:
    """The rule (module docstring)."""
    limit = CLEAR_SLACK * results[next(iter(results))]["clear_median"]  # the first candidate: the previous bet
    valid = [k for k, r in results.items() if r["null_alarms"] <= r["null_bound"] and r["clear_median"] <= limit]
    return min(valid, key=lambda k: (results[k]["median_ratio"], results[k]["components"]))


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# The drift alarm's mixture of bets, chosen on synthetic shifts",
        "",
        f"`{doc['command']}`",
        "",
        f"Machine: {doc['machine']['cpu']}. Calibration split of {CALIBRATION} uniform scores, delta {DELTA}; "
        f"{doc['runs']} streams per shift; the shifts whose binned Lorden bound is at most {SCOPE:g} inputs. Chosen: "
        f"**{doc['chosen']}** (smallest median delay / bound among candidates within the null bound that clear within "
        f"{CLEAR_SLACK} times the previous bet's inputs).",
        "",
        "| candidate | components | median delay / bound | worst | null alarms (bound) | log10 C after a burst of 5 "
        "| inputs to clear |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, r in doc["candidates"].items():
        lines.append(
            f"| {k} | {r['components']} | {r['median_ratio']:.2f} | {r['worst_ratio']:.2f} | "
            f"{r['null_alarms']} of {r['null_runs']} ({r['null_bound']}) | {r['burst_log10']:.2f} | "
            f"{r['clear_median']:.0f} |"
        )
    lines += ["", "Mean delay per shift (pi: foreign share, a: Beta(a, 1) shape; bound: log A / binned KL):", ""]
    names = list(doc["candidates"])
    lines.append("| pi | a | bound | " + " | ".join(names) + " |")
    lines.append("|---:|---:|---:|" + "---:|" * len(names))
    first = doc["candidates"][names[0]]["shifts"]
    for i, s in enumerate(first):
        cells = [f"{doc['candidates'][k]['shifts'][i]['delay']:.1f}" for k in names]
        lines.append(f"| {s['share']} | {s['shape']} | {s['bound']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "benchmarks/results/alarm_grid.json")
    p.add_argument("--runs", type=int, default=150, help="streams per shift")
    p.add_argument("--null-runs", type=int, default=100, help="streams of 10,000 null inputs")
    return parse_positive(p, argv, "runs", "null_runs")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    for name, comps in CANDIDATES.items():
        results[name] = evaluate(comps, args.runs, args.null_runs)
        r = results[name]
        print(
            f"{name:38s} J {r['components']:2d}  median {r['median_ratio']:.2f}  worst {r['worst_ratio']:.2f}  "
            f"null {r['null_alarms']}/{r['null_runs']}  clear {r['clear_median']:.0f}",
            flush=True,
        )
    doc = {
        "command": "python -m benchmarks.alarm_grid " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "runs": args.runs,
        "chosen": choose(results),
        "candidates": results,
    }
    path = harness.save_run(doc, args.out, "alarm_grid.json")
    path.with_suffix(".md").write_text(markdown(json_round_trip(path)))
    print(f"chosen: {doc['chosen']}\nwrote {path}")
    return 0


def json_round_trip(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
