"""What a batch tells beyond its rows (``summary.json`` beside the parts, and printed):

* **Label-free accuracy** of the batch: the mean top-label probability of its answers, with the normal interval of a
  Poisson-binomial mean (:func:`service.core.online.estimate_figure`, the estimator of ``/monitor``). It is the
  expected accuracy if the probabilities are calibrated on this batch's inputs, and only then. With a calibration
  split, also ``adjusted_accuracy``, the difference of confidences (Guillory et al., 2021): the calibration split's
  accuracy moved by how far the batch's mean confidence is from the split's. It removes the model's miscalibration
  as the split measured it, and holds when that miscalibration is the same on the batch's inputs (no shift that
  changes it).
* **One shift test of the whole batch** against the calibration split: the one-sided Mann-Whitney U test of "the
  batch's OOD scores are larger than the calibration split's" (outlier-oriented, :func:`service.core.scores.
  outlier_sign`). Stated exactly: if the batch's inputs and the calibration split's are independent draws of one
  distribution, the test rejects with probability at most ``alpha`` (the normal approximation of U's null law, with
  the tie correction; close once both samples have 20 or more inputs). ``auc`` is U / (n m): how often a batch input
  scores above a calibration input (0.5: no shift). On a large batch a small shift is significant: read the AUC
  beside the p-value. When the test rejects, every answer is marked ``suspended`` and, under
  ``HYDRA_DRIFT_POLICY=abstain``, accepts nothing, as the server does under its drift alarm (``mark``: marked only;
  ``off``: the test is reported and nothing is changed).
* ``--select K --by ...``: the K inputs to label first (:data:`SELECT_BY`).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Iterable
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from service.core.online import estimate_figure
from service.core.scores import outlier_sign

__all__ = ["SELECT_BY", "batch_shift_test", "difference_of_confidences", "label_free", "select", "suspend"]

# what --by ranks on, larger = label first: the members' disagreement, the smallest margin between the two top labels,
# the predictive entropy, the most foreign input (the smallest OOD p-value; without guarantees, the OOD score
# oriented so that larger = more foreign)
SELECT_BY = ("mutual_information", "margin", "entropy", "ood")


def label_free(rows: Iterable[dict[str, Any]], level: float = 0.95, calibration: Any = None) -> dict[str, Any]:
    """The label-free accuracy of the answered rows, with its interval; and the flagged and accepted shares. With
    ``calibration`` (``(accuracy, n, confidences)`` of the calibration split), also ``adjusted_accuracy``: the
    difference of confidences (module docstring)."""
    n = flagged = accepted = 0
    conf_sum = conf_var = 0.0
    for r in rows:
        if r.get("error") is not None:
            continue
        p = float(r["confidence"])
        n, conf_sum, conf_var = n + 1, conf_sum + p, conf_var + p * (1 - p)
        flagged += bool(r["ood_flag"])
        accepted += bool(r.get("accept"))
    f = estimate_figure(conf_sum, conf_var, n, level)
    out = {
        "answered": n,
        "estimated_accuracy": {"value": f.value, "low": f.low, "high": f.high, "level": level},
        "ood_flagged": flagged / n if n else None,
        "accepted": accepted / n if n else None,
    }
    if calibration is not None and n:
        acc, cal_n, cal_conf = calibration
        out["adjusted_accuracy"] = difference_of_confidences(conf_sum / n, conf_var / n**2, acc, cal_n, cal_conf, level)
    return out


def difference_of_confidences(
    mean_conf: float, var_mean: float, cal_accuracy: float, cal_n: int, cal_conf: np.ndarray, level: float = 0.95
) -> dict[str, Any]:
    """The batch's accuracy as the calibration split's, moved by how much the mean confidence moved:
    ``acc_cal + (mean conf - mean conf_cal)``, clipped to ``[0, 1]``; its interval adds the calibration accuracy's
    binomial variance to the batch mean's (normal, at ``level``)."""
    value = cal_accuracy + (mean_conf - float(np.mean(cal_conf)))
    half = NormalDist().inv_cdf(0.5 + level / 2) * math.sqrt(var_mean + cal_accuracy * (1 - cal_accuracy) / cal_n)
    clip = lambda x: min(1.0, max(0.0, x))  # noqa: E731
    return {"value": clip(value), "low": clip(value - half), "high": clip(value + half), "level": level}


def batch_shift_test(scores: ArrayLike, cal_oriented: ArrayLike, metric: str, alpha: float) -> dict[str, Any]:
    """The one-sided Mann-Whitney U test of the batch's OOD ``scores`` (raw, as served) against the calibration
    split's outlier-oriented scores (module docstring): ``{"test", "n", "m", "auc", "z", "p_value", "alpha",
    "rejected"}``."""
    x = outlier_sign(metric) * np.asarray(scores, dtype=np.float64)
    x = x[np.isfinite(x)]
    y = np.sort(np.asarray(cal_oriented, dtype=np.float64))
    n, m = len(x), len(y)
    out: dict[str, Any] = {"test": "mann-whitney-u, one-sided (batch more OOD)", "n": n, "m": m, "alpha": alpha}
    if n == 0 or m == 0:
        return out | {"auc": None, "z": None, "p_value": None, "rejected": False}
    below = np.searchsorted(y, x, side="left")
    ties = np.searchsorted(y, x, side="right") - below
    u = float(below.sum() + 0.5 * ties.sum())
    _, counts = np.unique(np.concatenate([x, y]), return_counts=True)
    total = n + m
    tie_term = float((counts.astype(np.float64) ** 3 - counts).sum()) / (total * (total - 1)) if total > 1 else 0.0
    var = n * m / 12.0 * ((total + 1) - tie_term)
    z = (u - n * m / 2.0 - 0.5) / math.sqrt(var) if var > 0 else 0.0
    p = 0.5 * math.erfc(z / math.sqrt(2.0))
    return out | {"auc": u / (n * m), "z": z, "p_value": p, "rejected": bool(p <= alpha)}


def _key(row: dict[str, Any], by: str, sign: float) -> float:
    if by == "margin":
        return -float(row["margin"]) if row.get("margin") is not None else -math.inf
    if by == "ood":
        p = row.get("ood_p_value")
        return -float(p) if p is not None else sign * float(row["ood_score"])
    return float(row[by])


def select(
    rows: Iterable[tuple[int, dict[str, Any]]], k: int, by: str, metric: str = "msp"
) -> list[tuple[int, dict[str, Any]]]:
    """The ``k`` answered rows ranked first by ``by`` (ties: the earlier input), as ``(position, row)``, best first;
    ``metric``: the served OOD score, oriented so that ``ood`` without p-values ranks the most foreign first."""
    if by not in SELECT_BY:
        raise ValueError(f"--by must be one of {', '.join(SELECT_BY)}, got {by!r}")
    sign = outlier_sign(metric)
    best = heapq.nlargest(k, ((_key(r, by, sign), -i, i, r) for i, r in rows if r.get("error") is None))
    return [(i, r) for _, _, i, r in best]


def suspend(row: dict[str, Any], policy: str, test: dict[str, Any]) -> dict[str, Any]:
    """``row`` as the server answers under its drift alarm, the batch's rejected shift ``test`` standing for the alarm:
    marked ``suspended`` and not certified; under ``abstain`` nothing accepted, saying why; under ``mark`` the
    decision kept and the reason saying that the certificate does not hold (its whole ``answer`` changed alike)."""
    if row.get("error") is not None or policy == "off":
        return row
    answer = json.loads(row["answer"])
    sel = answer.get("selective")
    out = {**row, "suspended": True}
    if sel is not None:
        why = (
            f"the batch's shift test rejected it (p = {test['p_value']:.3g} <= {test['alpha']:g}, "
            f"AUC {test['auc']:.3f})"
        )
        sel["suspended"], sel["certified"] = True, False
        if policy == "abstain":
            sel["accept"] = False
            sel["reason"] = (
                f"{why}: the batch is not like the calibration split, so the certified rule does not hold for it "
                "and accepts nothing"
            )
        else:
            mark = f"{why}: the certificate does not hold for this batch (the decision is shown as without the test)"
            sel["reason"] = f"{mark}; {sel['reason']}" if sel.get("reason") else mark
        out["accept"], out["reason"] = sel["accept"], sel["reason"]
    out["answer"] = json.dumps(answer, separators=(",", ":"))
    return out
