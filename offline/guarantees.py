"""The guarantees stage of a build: what the server needs to answer with stated guarantees, fitted on the
calibration split alone (:attr:`offline.data.Data.calibration`), which nothing else of the build touched.

* **Prediction sets**: the served ensemble's probabilities (at its temperature) on the calibration split, their
  true-label nonconformity scores sorted, marginal and per class (:class:`service.conformal.SetCalibrator`,
  ``guarantees.method``): any ``alpha`` is served per request.
* **OOD p-values**: the served OOD score of every calibration input, sorted (outlier-oriented: MSP negated);
  ``p = (1 + #{s_i >= s}) / (n + 1)`` per request, the flag ``p <= ood_alpha``.
* **Answers with a risk bound**: per target risk ``eps`` (``guarantees.risks``), the confidence threshold of the
  rule "accept iff the OOD score passes the build's OOD threshold and the ensemble's confidence (MSP) is at least
  ``lam``", certified by Learn-then-Test with fixed-sequence testing and a binomial p-value on the calibration split
  (:func:`service.conformal.selective_thresholds`). Both parts of the rule are fixed before the split is looked
  at: the OOD threshold is the one fitted on validation data (``uncertainty.ood_threshold``), and the candidate
  ``lam`` are quantiles of the validation inputs' confidence, so the guarantee needs no assumption on the model:
  with probability at least ``1 - delta`` over the draw of the calibration split, the error rate among the
  accepted in-distribution inputs is at most ``eps`` (each target on its own).
* **The drift alarm's reference**: the calibration scores are the alarm's initial bag; its bins' edges are
  quantiles of the validation inputs' scores (fixed without the calibration scores: :mod:`service.drift`).

Everything goes into ``guarantees.safetensors`` and the manifest's ``guarantees`` block
(:class:`service.artifact.GuaranteesSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from service.conformal import SetCalibrator, binomial_p_value, min_accepted, min_alpha, selective_thresholds
from service.guarantees import GUARANTEES_FILE, outlier_oriented

__all__ = ["GUARANTEES_FILE", "CalibrationOutputs", "Fitted", "fit_guarantees", "grid_of", "drift_edges"]

GRID = 201  # candidate confidence thresholds: quantiles of the validation confidences at i / (GRID - 1)
# a target's candidates start where the validation inputs' accept rate promises this many times the fewest accepted
# calibration inputs at which the target can be certified at all (service.conformal.min_accepted): a first candidate
# accepting fewer would end the fixed sequence at once
GRID_MARGIN = 1.25
# ... and the first candidate is one the validation inputs certify with room to spare (p-value at most delta / 5 on
# at least this many inputs): a start certified by a lucky handful of validation inputs fails on calibration
START_MIN_INPUTS = 30
START_LEVEL = 0.2


@dataclass
class CalibrationOutputs:
    """The served model on one split: ensemble probabilities ``(N, C)`` at the served temperature, labels ``(N,)``,
    the served OOD score ``(N,)`` (as served: MSP higher = ID, the others higher = OOD)."""

    probs: np.ndarray
    labels: np.ndarray
    ood_score: np.ndarray


@dataclass
class Fitted:
    """The fitted guarantees: tensors for ``guarantees.safetensors`` and the manifest block."""

    tensors: dict[str, torch.Tensor]
    spec: dict[str, Any]
    sets: SetCalibrator
    rules: list[Any] = field(default_factory=list)


def grid_of(confidences: np.ndarray, size: int = GRID) -> np.ndarray:
    """Candidate thresholds ``(G,)``: the distinct quantiles of ``confidences`` at ``i / (size - 1)``."""
    if confidences.size == 0:
        return np.asarray([1.0])
    return np.unique(np.quantile(confidences, np.linspace(0.0, 1.0, size)))


def target_grid(
    grid: np.ndarray, val_conf: np.ndarray, val_correct: np.ndarray, n_val: int, n_cal: int, eps: float,
    delta: float,
) -> np.ndarray:  # fmt: skip
    """The candidates of one target ``eps``, tested from the highest down (fixed sequence, which stops at the first
    candidate it cannot certify): ``grid`` from the highest threshold at which the validation inputs alone would
    certify the target with room to spare (binomial p-value at most ``START_LEVEL * delta`` on at least
    ``START_MIN_INPUTS`` of those passing the OOD cut: ``val_conf`` and ``val_correct``, of ``n_val`` inputs in
    all) and, scaled to the ``n_cal`` calibration inputs, promise at least
    ``GRID_MARGIN`` times the fewest accepted inputs that can be certified at all; without one, from the first
    that promises those. Validation only: the candidates are fixed before the calibration split is looked at,
    which the guarantee needs."""
    need = GRID_MARGIN * min_accepted(eps, delta)
    acc = val_conf[None, :] >= grid[:, None]  # (G, N_val)
    n_acc = acc.sum(1)
    errors = (acc & ~val_correct[None, :]).sum(1)
    enough = n_acc * n_cal / max(n_val, 1) >= need
    p_val = binomial_p_value(errors, np.maximum(n_acc, 1), eps)
    certified = enough & (n_acc >= START_MIN_INPUTS) & (p_val <= START_LEVEL * delta)
    start = grid[certified].max() if certified.any() else (grid[enough].max() if enough.any() else grid.min())
    return grid[grid <= start]


def drift_edges(val_scores: np.ndarray, bins: int) -> np.ndarray:
    """The drift alarm's bin edges ``(bins - 1,)``: quantiles of outlier-oriented validation scores at ``i / bins``."""
    return np.quantile(np.asarray(val_scores, dtype=np.float64), np.arange(1, bins) / bins)


def fit_guarantees(
    g: Any, cal: CalibrationOutputs, val: CalibrationOutputs, metric: str, ood_threshold: float,
    split_record: dict[str, Any], label_free: bool = False,
) -> Fitted:  # fmt: skip
    """The guarantees of ``g`` (the config's ``guarantees`` section) fitted on the calibration split ``cal``; the
    validation split ``val`` fixes the candidate thresholds and the drift bins (never the calibration split).

    ``metric``, ``ood_threshold``: the served OOD score and its validation threshold (the rule's OOD cut).
    ``label_free``: the OOD score does not depend on the labels (zero-shot): its p-values hold for any labels,
    the sets and the risk rules only for the build's labels.
    """
    sets = SetCalibrator.fit(cal.probs, cal.labels, g.method, g.k_reg, g.lam)
    ood = np.sort(outlier_oriented(cal.ood_score, metric))
    conf = cal.probs.max(axis=1)
    correct = cal.probs.argmax(axis=1) == cal.labels
    eligible = outlier_oriented(cal.ood_score, metric) <= outlier_oriented(np.asarray([ood_threshold]), metric)[0]
    val_eligible = outlier_oriented(val.ood_score, metric) <= outlier_oriented(np.asarray([ood_threshold]),
                                                                                 metric)[0]  # fmt: skip
    val_conf = val.probs.max(axis=1)[val_eligible]
    val_correct = (val.probs.argmax(axis=1) == val.labels)[val_eligible]
    grid = grid_of(val_conf)
    n = int(cal.labels.shape[0])
    rules, sizes = [], []
    for eps in g.risks:  # each target its own candidates (its first must accept enough inputs to be certifiable)
        own = target_grid(grid, val_conf, val_correct, len(val.labels), n, eps, g.delta)
        rules += selective_thresholds(conf, correct, [eps], g.delta, eligible=eligible, p_value=g.p_value, grid=own)
        sizes.append(int(own.size))
    edges = drift_edges(outlier_oriented(val.ood_score, metric), g.drift_bins)
    tensors = {**sets.to_tensors("conformal."), "ood.scores": torch.from_numpy(np.ascontiguousarray(ood)),
               "drift.edges": torch.from_numpy(np.ascontiguousarray(edges, dtype=np.float64))}  # fmt: skip
    per_class = sets.min_alpha(mondrian=True)
    spec = {
        "file": GUARANTEES_FILE,
        "calibration": split_record,
        "conformal": {"method": g.method, "k_reg": g.k_reg, "lam": g.lam, "alpha": g.alpha, "mondrian": g.mondrian,
                      "min_alpha": float(min_alpha(n)), "min_alpha_per_class": [float(a) for a in per_class],
                      "labels": "the build's" if label_free else "the model's"},
        "ood": {"score": metric, "alpha": g.ood_alpha, "n": n, "min_alpha": float(min_alpha(n)),
                "label_free": label_free},
        "selective": {
            "delta": g.delta, "p_value": g.p_value, "confidence": "msp", "default_risk": g.risk,
            "ood_cut": {"score": metric, "threshold": ood_threshold},
            "grid": {"from": "quantiles of the validation confidences of the inputs passing the OOD cut; each target's "
                             "from where validation alone would certify it", "sizes": sizes},
            "targets": [rule_record(r) for r in rules],
        },
        "drift": {"delta": g.drift_delta, "bins": g.drift_bins, "seed": 0,
                  "edges": "quantiles of the validation inputs' OOD scores"},
    }  # fmt: skip
    return Fitted(tensors, spec, sets, rules)


def rule_record(r: Any) -> dict[str, Any]:
    """One certified (or not) target of the manifest's ``selective.targets``."""
    return {"risk": r.eps, "certified": r.threshold is not None, "threshold": r.threshold,
            "calibration_accept_rate": r.accept_rate, "calibration_risk": None if r.n_accepted == 0 else r.risk,
            "n_accepted": r.n_accepted, "p_value": r.p_value}  # fmt: skip
