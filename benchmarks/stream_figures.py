"""The stream benchmark's figures beyond accuracy and accepts (``benchmarks/stream.py``): Lorden's bound of a stream,
the recall's coverage and precision, and the labels the online rule takes after the alarm."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["P_BINS", "labels_to_half", "lorden_bound", "recall_figures"]

# the p-value bins of every Lorden estimate (this module, benchmarks/shift_views.py, benchmarks/alarm_grid.py)
P_BINS = np.array([0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0])


def lorden_bound(p_values: list[float], arl: float) -> float | None:
    """``log A / KL``: Lorden's least mean delay of any detector whose mean run length to a false alarm is ``A``, for
    a change from uniform p-values to these (KL in :data:`P_BINS`, as ``shift_views`` and
    ``alarm_grid`` estimate it). None: no divergence seen."""
    q = np.histogram(np.asarray(p_values, dtype=np.float64), P_BINS)[0] / max(len(p_values), 1)
    u = np.diff(P_BINS)
    kl = float(np.sum(q[q > 0] * np.log(q[q > 0] / u[q > 0])))
    return round(math.log(arl) / kl, 1) if kl > 1e-9 else None


def recall_figures(run: dict[str, Any], prefix: int) -> dict[str, Any]:
    """How the recall of the stream's first alarm episode covers the wrong accepts given before the alarm, after the
    shift began (input ``prefix + 1``), and how many of its answers were given after the shift began."""
    r = run["records"]
    at = {x["id"]: i + 1 for i, x in enumerate(r)}  # request id -> input number in the stream
    listed = {a["id"] for rec in run["recalled"][:1] for a in rec["answers"]}
    wrong = [x["id"] for x in r[prefix:] if x["accept"] and not x["correct"] and not x["suspended"]]
    after = [i for i in listed if at.get(i, 0) > prefix]
    return {
        "recalled": len(listed),
        "recall_changed_at": run["recalled"][0]["changed_at"] if run["recalled"] else None,
        "wrong_accepts_before_alarm": len(wrong),
        "wrong_accepts_recalled": sum(1 for i in wrong if i in listed),
        "recall_coverage": sum(1 for i in wrong if i in listed) / len(wrong) if wrong else None,
        "recall_precision": len(after) / len(listed) if listed else None,
    }


def labels_to_half(records: list[dict[str, Any]], risk: float, start: int, window: int = 50) -> dict[str, Any]:
    """How many labels the online rule took, from the alarm (record ``start``), until it accepted at least half of
    what a hindsight threshold would: the largest share of the inputs after the alarm that one confidence threshold,
    chosen on those very inputs and their labels, accepts at an error of at most ``risk`` (``hindsight_share``),
    against the online rule's accept rate over the last ``window`` answers, at an error among them of at most
    ``risk`` + 1 point. None: never within the stream."""
    rest = records[start:]
    conf = np.array([x["confidence"] for x in rest])
    wrong = np.array([not x["correct"] for x in rest], dtype=float)
    order = np.argsort(-conf)
    errs = np.cumsum(wrong[order]) / np.arange(1, len(rest) + 1)
    ok = np.flatnonzero(errs <= risk)
    share = float((ok.max() + 1) / len(rest)) if ok.size else 0.0
    acc = np.array([bool(x["accept"]) for x in rest])
    for i in range(window, len(rest) + 1):
        a, w = acc[i - window : i], wrong[i - window : i]
        if share > 0 and a.mean() >= 0.5 * share and (w[a].mean() if a.any() else 0.0) <= risk + 0.01:
            return {"hindsight_share": share, "labels_to_half": i}
    return {"hindsight_share": share, "labels_to_half": None}
