"""Calibration on ID validation data: the ensemble's temperature, then the OOD threshold the server applies.

Both numbers go into the manifest's ``uncertainty`` field. The threshold's
pass/flag rule is exactly ``service.core.uncertainty.ood_flag``: with ``msp`` an
input is flagged when its score is *below* the threshold; with every other score
(entropy, mutual information and the outlier scores of ``service.core.ood``) when it is *above*.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from service.core.scores import outlier_sign
from service.core.uncertainty import OOD_METRICS

__all__ = ["T_MIN", "T_MAX", "ensemble_nll", "fit_temperature", "calibrate_threshold"]

T_MIN, T_MAX = 0.05, 20.0  # search range of the temperature
_GRID = 81  # log-spaced grid points over [T_MIN, T_MAX] before the golden-section refinement
_GOLDEN_ITERS = 40  # the bracket shrinks to 0.618^40 ≈ 4e-9 of a grid step


def ensemble_nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """NLL (nats, mean over inputs) of the ensemble prediction ``mean_m softmax(logits[:, m] / T)``.

    Args:
        logits: ``(N, M, C)`` member logits.
        labels: ``(N,)`` class indices.
    """
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)  # (N, M, C)
    log_mean = torch.logsumexp(lp, dim=1) - math.log(logits.shape[1])  # (N, C) log of the member mean
    return float(-log_mean.gather(1, labels.long().view(-1, 1)).mean())


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Temperature ``T`` in ``[0.05, 20]`` minimising the NLL of ``mean_m softmax(logits_m / T)`` on validation data.

    One ``T`` is shared by all members and applied before their softmax (as the
    server does). The search is a log-spaced grid over the whole range followed
    by a golden-section search on ``log T`` around the best grid point, so it
    needs no gradient and cannot leave the range.

    Args:
        logits: ``(N, M, C)`` member logits of the ID validation set (a single model: ``M = 1``).
        labels: ``(N,)`` class indices.
    """
    if logits.dim() != 3:
        raise ValueError(f"member logits must be (N, M, C), got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"{logits.shape[0]} inputs but labels of shape {tuple(labels.shape)}")
    if logits.shape[0] == 0:
        raise ValueError("cannot fit a temperature on an empty validation set")
    if not torch.isfinite(logits).all():
        raise ValueError("validation logits contain NaN or inf")
    logits, labels = logits.detach().double().cpu(), labels.detach().long().cpu()

    def f(log_t: float) -> float:
        return ensemble_nll(logits, labels, math.exp(log_t))

    grid = np.linspace(math.log(T_MIN), math.log(T_MAX), _GRID)
    values = [f(g) for g in grid]
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, _GRID - 1)]
    # golden-section search on [lo, hi]; the NLL is unimodal in log T around the grid minimum
    r = (math.sqrt(5) - 1) / 2
    a, b = lo + (1 - r) * (hi - lo), lo + r * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(_GOLDEN_ITERS):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - r) * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = f(b)
    best = min((values[i], grid[i]), (fa, a), (fb, b))[1]
    return float(min(max(math.exp(best), T_MIN), T_MAX))


def calibrate_threshold(id_scores: np.ndarray, metric: str, tpr: float = 0.95) -> float:
    """OOD threshold such that a fraction ``tpr`` of the ID validation inputs pass (are not flagged).

    The rule is ``service.core.uncertainty.ood_flag``'s: ``msp`` flags ``score < threshold``;
    every other score (entropy, mutual information, and the outlier scores of ``service.core.ood``)
    flags ``score > threshold``. With ``k =
    ceil(tpr · N)`` the threshold lies halfway between the ``k``-th and ``(k+1)``-th
    most in-distribution scores, so exactly ``k`` ID inputs pass when those differ
    (a margin on both sides against round-off between build and serving backends).
    Ties: when they are equal the threshold is that value and every input tied
    with it passes, so the pass fraction is the smallest achievable one >= ``tpr``.

    Args:
        id_scores: ``(N,)`` scores of the ID validation inputs under ``metric``.
        metric: a name of ``service.core.uncertainty.OOD_METRICS``.
        tpr: fraction of ID inputs that must pass, in ``(0, 1]``.
    """
    if metric not in OOD_METRICS:
        raise ValueError(f"unknown OOD score {metric!r}; expected one of {sorted(OOD_METRICS)}")
    if not 0 < tpr <= 1:
        raise ValueError(f"tpr must be in (0, 1], got {tpr}")
    s = np.asarray(id_scores).reshape(-1)
    if s.size == 0:
        raise ValueError("cannot calibrate an OOD threshold on no ID scores")
    if not np.isfinite(s).all():
        raise ValueError("ID scores contain NaN or inf")
    to_id = -outlier_sign(metric)
    # oriented so that larger = more in-distribution, sorted most-ID first
    ordered = np.sort(to_id * s)[::-1]
    n = len(ordered)
    k = min(n, max(1, math.ceil(tpr * n - 1e-9)))  # inputs that must pass; 1e-9 absorbs 0.95 * N round-off
    kth = ordered[k - 1]
    cand = kth if k == n else (kth + ordered[k]) / 2  # halfway to the first input that may be flagged
    thr = float(to_id * cand)
    # guard: in the scores' own precision, the midpoint must not round onto the next score
    passes = _passes(s, metric, thr)
    if passes.sum() < k or (k < n and ordered[k] < kth and passes.sum() > k):
        thr = float(to_id * kth)
    return thr


def _passes(scores: np.ndarray, metric: str, threshold: float) -> np.ndarray:
    t = np.asarray(threshold, dtype=scores.dtype) if np.issubdtype(scores.dtype, np.floating) else threshold
    sign = outlier_sign(metric)
    return sign * scores <= sign * t
