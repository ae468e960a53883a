"""Conformal guarantees on top of the ensemble's probabilities: prediction sets, OOD p-values, selective risk.

Pure statistics on float64 numpy arrays (torch only to store a calibrator in a safetensors file). The builder fits
the statistics on a calibration split the model never trained on; the server applies them per request. Every
guarantee below holds over the draw of that split and assumes the calibration points and the served inputs are
exchangeable (e.g. i.i.d. from one distribution): a drifted stream voids them, which :mod:`service.core.drift` watches.

**Prediction sets** (split conformal, Vovk et al. 2005; Angelopoulos & Bates 2021). A nonconformity score
``s(x, y)`` says how badly label ``y`` fits input ``x``; on ``n`` calibration points the true-label scores are
sorted and ``qhat`` is the ``k``-th smallest, ``k = ceil((n + 1)(1 - alpha))``. The set of a new input is every label
with ``s(x, y) <= qhat``. Guarantee: for a test point exchangeable with the calibration points,
``P(y in C(x)) >= 1 - alpha``, over the draw of the calibration split and the test point; when the scores have no
ties, also ``P(y in C(x)) <= 1 - alpha + 1 / (n + 1)``. When ``k > n`` (``alpha < 1 / (n + 1)``, see
:func:`min_alpha`) no finite ``qhat`` is valid: it is ``+inf`` and the set is every label. The Mondrian
(class-conditional) variant calibrates each class on its own points: label ``j`` is in the set iff
``s(x, j) <= qhat_j``, with ``qhat_j`` from the ``n_j`` calibration points of class ``j``, and then
``P(y in C(x) | y = j) >= 1 - alpha`` for every class ``j`` (exchangeability within each class).

Scores, from the probabilities ``p`` (``(N, C)``, temperature-scaled):

* ``lac`` (Sadinle et al. 2019, TorchCP's THR): ``1 - p_y``. Smallest sets on average; ignores how the rest of the
  mass is spread.
* ``aps`` (Romano et al. 2020): the total probability of the labels at least as probable as ``y``,
  ``sum_{j: p_j >= p_y} p_j``. Sets grow with the model's uncertainty.
* ``raps`` (Angelopoulos et al. 2021): the APS score plus ``lam * max(0, o(y) - k_reg)``, ``o(y)`` the rank of ``y``
  (1 = most probable), which penalises long tails of unlikely labels.

These are the **non-randomised** scores: the server's answer must be a function of the input, and the randomised
variants (a uniform ``U`` replacing ``p_y`` by ``U * p_y`` in the last term) need a fresh random number per input
to reach their exact coverage. The price is over-coverage (at most ``1 / (n + 1)`` above ``1 - alpha`` with
distinct scores, as stated; APS/RAPS sets are also somewhat larger than the randomised ones). Sets may be empty
(when even the top label's score exceeds ``qhat``, i.e. a confident model at a large ``alpha``); an empty set is a
valid answer ("no label at this level"), and keeping it is what keeps the upper coverage bound. Equal
probabilities are counted together (``p_j >= p_y`` above, and the rank counts ties), so equally probable labels
enter or leave a set together and the score does not depend on label order. Without ties the scores, ``qhat`` and
sets are exactly MAPIE's (1.6: ``lac``; the non-randomised APS/RAPS cumulated scores with fixed ``k_reg``, ``lam``
and ``include_last_label=False``, where MAPIE puts the top label into a set that would be empty), which
``tests/service/core/test_conformal.py`` checks.

**OOD p-values** (conformal outlier detection, Bates et al. 2023): for an outlier score (higher = more OOD) and
``n`` ID calibration scores, ``p(s) = (1 + #{i: s_i >= s}) / (n + 1)``. For an ID test input exchangeable with
the calibration inputs, ``P(p <= a) <= a`` for every ``a`` (flag "OOD at level a" iff ``p <= a``: false-alarm
rate at most ``a``). Scores where higher means in-distribution (MSP) are negated by the caller.

**Selective classification with a risk guarantee** (Learn then Test, Angelopoulos et al. 2021): see
:func:`selective_thresholds`, whose docstring states the guarantee and its conditions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

__all__ = [
    "P_VALUES",
    "SCORES",
    "SelectiveRule",
    "SetCalibrator",
    "binomial_cdf",
    "binomial_p_value",
    "conformal_quantile",
    "hb_p_value",
    "label_scores",
    "min_accepted",
    "min_alpha",
    "ood_p_values",
    "quantile_rank",
    "selective_thresholds",
    "true_label_scores",
]

SCORES = ("lac", "aps", "raps")
P_VALUES = ("binomial", "hb")

# alpha within this distance of a multiple of 1 / (n + 1) is read as that multiple: 0.1 and n = 9 give the 9th
# smallest score, as the caller means, whatever the last bit of the float 0.1 (the coverage this costs: <= 1e-9)
_ALPHA_TOL = 1e-9


# ----------------------------------------------------------------------------- validation
def _alpha(alpha: float | Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(alpha, dtype=np.float64)
    if a.size == 0 or not np.all((a > 0) & (a < 1)):  # also rejects NaN
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return a


def _level(name: str, value: float) -> float:
    v = float(value)
    if not 0 < v < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def _probs(probs: np.ndarray | torch.Tensor) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] == 0:
        raise ValueError(f"probs must be (N, C) with C >= 1, got shape {p.shape}")
    if not np.all(np.isfinite(p)) or (p.size and p.min() < 0):
        raise ValueError("probs must be finite and non-negative")
    return p


def _labels(labels: np.ndarray | torch.Tensor, n: int, classes: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.shape != (n,):
        raise ValueError(f"labels must be (N,) = ({n},) like probs, got shape {y.shape}")
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= classes):
        raise ValueError(f"labels must be integers in [0, {classes}), got {y.dtype} in [{y.min()}, {y.max()}]")
    return y.astype(np.int64)


def _method(method: str, k_reg: int, lam: float) -> None:
    if method not in SCORES:
        raise ValueError(f"unknown conformal score {method!r}; expected one of {list(SCORES)}")
    if int(k_reg) != k_reg or k_reg < 0:
        raise ValueError(f"k_reg must be an integer >= 0, got {k_reg!r}")
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be finite and >= 0, got {lam!r}")


# ----------------------------------------------------------------------------- scores
def label_scores(
    probs: np.ndarray | torch.Tensor, method: str = "aps", k_reg: int = 1, lam: float = 0.01
) -> np.ndarray:
    """Nonconformity score of every candidate label ``(N, C)`` from probabilities ``probs (N, C)``.

    ``method``: ``lac`` (``1 - p_j``), ``aps`` (mass of the labels at least as probable as ``j``) or ``raps`` (APS
    plus ``lam * max(0, rank_j - k_reg)``, rank 1 = most probable; ``k_reg`` and ``lam`` are used by ``raps``
    only). Higher = label fits worse. Non-randomised; ties counted together (module docstring).
    """
    _method(method, k_reg, lam)
    return _label_scores(_probs(probs), method, k_reg, lam)


def _label_scores(p: np.ndarray, method: str, k_reg: int, lam: float) -> np.ndarray:
    """:func:`label_scores` of checked float64 probabilities ``(N, C)`` (the server's own softmax outputs)."""
    if method == "lac":
        return 1.0 - p
    c = p.shape[1]
    order = np.argsort(-p, axis=1, kind="stable")  # most probable first
    ps = np.take_along_axis(p, order, axis=1)
    cs = np.cumsum(ps, axis=1)  # the same left-to-right sums as MAPIE's, so the floats agree exactly
    # A run of equal probabilities takes the cumulated mass and the rank at its last member: tied labels score alike.
    last = np.ones(ps.shape, dtype=bool)
    last[:, :-1] = ps[:, :-1] != ps[:, 1:]
    run_end = np.minimum.accumulate(np.where(last, np.arange(c), c)[:, ::-1], axis=1)[:, ::-1]
    sorted_scores = np.take_along_axis(cs, run_end, axis=1)
    if method == "raps":
        sorted_scores = sorted_scores + lam * np.maximum(run_end + 1 - k_reg, 0)
    out = np.empty_like(sorted_scores)
    np.put_along_axis(out, order, sorted_scores, axis=1)
    return out


def true_label_scores(
    probs: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    method: str = "aps",
    k_reg: int = 1,
    lam: float = 0.01,
) -> np.ndarray:
    """Nonconformity score of the true label ``(N,)``: :func:`label_scores` at ``labels (N,)``."""
    p = _probs(probs)
    y = _labels(labels, p.shape[0], p.shape[1])
    return np.take_along_axis(label_scores(p, method, k_reg, lam), y[:, None], axis=1)[:, 0]


# ----------------------------------------------------------------------------- the conformal quantile
def min_alpha(n: int | np.ndarray) -> float | np.ndarray:
    """The smallest ``alpha`` that ``n`` calibration scores support with a finite ``qhat``: ``1 / (n + 1)``."""
    return 1.0 / (np.asarray(n, dtype=np.float64) + 1.0) if np.ndim(n) else 1.0 / (int(n) + 1)


def quantile_rank(n: int | np.ndarray, alpha: float | np.ndarray) -> int | np.ndarray:
    """``k = ceil((n + 1)(1 - alpha))``: the rank (1-based) of ``qhat`` among ``n`` sorted scores; ``> n``: none.

    ``alpha`` within 1e-9 of a multiple of ``1 / (n + 1)`` counts as that multiple (float round-off must not move
    an exact boundary by one rank). Vectorised over ``n`` and ``alpha`` (broadcast); ``k >= 1`` always.
    """
    a = _alpha(alpha)
    nn = np.asarray(n, dtype=np.float64)
    t = (nn + 1.0) * (1.0 - a)
    r = np.rint(t)
    k = np.where(np.abs(t - r) <= _ALPHA_TOL * (nn + 1.0), r, np.ceil(t))
    k = np.maximum(k, 1).astype(np.int64)
    return int(k) if k.ndim == 0 else k


def conformal_quantile(sorted_scores: np.ndarray, alpha: float | np.ndarray) -> float | np.ndarray:
    """``qhat`` from calibration scores ``(n,)`` sorted ascending: the ``quantile_rank(n, alpha)``-th smallest.

    ``+inf`` when that rank exceeds ``n`` (``alpha < min_alpha(n)``): no finite threshold is valid and the set is
    every label. ``alpha`` a float gives a float, an array ``(A,)`` gives ``(A,)``. O(1) per alpha: one index, no
    search (the scores are not checked for order, which would cost O(n) per request).
    """
    s = np.asarray(sorted_scores, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"sorted_scores must be (n,), got shape {s.shape}")
    n = s.shape[0]
    k = np.asarray(quantile_rank(n, alpha))
    q = np.where(k <= n, s[np.clip(k - 1, 0, max(n - 1, 0))] if n else np.inf, np.inf)
    return float(q) if q.ndim == 0 else q


# ----------------------------------------------------------------------------- a fitted calibrator
@dataclass(frozen=True, eq=False)
class SetCalibrator:
    """Sorted calibration scores of one score function, marginal and per class, for prediction sets.

    ``scores (n,)``: the true-label scores of the calibration points, ascending. ``class_scores (n,)``: the same
    scores grouped by true class and ascending within each class; class ``j`` holds
    ``class_scores[class_offsets[j]:class_offsets[j + 1]]`` (``class_offsets (C + 1,)``, so classes of unequal
    sizes, or none at all, fit in one flat array). Build with :meth:`fit`; store with :meth:`to_tensors`.
    """

    method: str
    k_reg: int
    lam: float
    scores: np.ndarray
    class_scores: np.ndarray
    class_offsets: np.ndarray

    def __post_init__(self) -> None:
        _method(self.method, self.k_reg, self.lam)
        s, cs, off = self.scores, self.class_scores, self.class_offsets
        if s.ndim != 1 or cs.shape != s.shape:
            raise ValueError(f"scores and class_scores must both be (n,), got {s.shape} and {cs.shape}")
        if off.ndim != 1 or off.shape[0] < 2 or off[0] != 0 or off[-1] != s.shape[0] or np.any(np.diff(off) < 0):
            raise ValueError(
                f"class_offsets must be (C + 1,), non-decreasing from 0 to n = {s.shape[0]}, got {off.tolist()}"
            )
        if not np.all(np.isfinite(s)) or np.any(np.diff(s) < 0):
            raise ValueError("scores must be finite and sorted ascending")
        inner = np.diff(cs) < 0  # a decrease is allowed only where one class's segment ends and the next begins
        bounds = off[1:-1]
        inner[bounds[(bounds > 0) & (bounds < s.shape[0])] - 1] = False
        if not np.all(np.isfinite(cs)) or np.any(inner):
            raise ValueError("class_scores must be finite and sorted ascending within each class")

    @classmethod
    def fit(
        cls,
        probs: np.ndarray | torch.Tensor,
        labels: np.ndarray | torch.Tensor,
        method: str = "aps",
        k_reg: int = 1,
        lam: float = 0.01,
    ) -> SetCalibrator:
        """Calibrate on ``probs (n, C)`` with true ``labels (n,)``; ``method``, ``k_reg``, ``lam`` as in
        :func:`label_scores`."""
        p = _probs(probs)
        if p.shape[0] == 0:
            raise ValueError("need at least one calibration point, got probs of shape (0, C)")
        y = _labels(labels, p.shape[0], p.shape[1])
        s = true_label_scores(p, y, method, k_reg, lam)
        by_class = np.lexsort((s, y))  # class first, then score
        offsets = np.concatenate([[0], np.cumsum(np.bincount(y, minlength=p.shape[1]))]).astype(np.int64)
        return cls(method, int(k_reg), float(lam), np.sort(s), s[by_class], offsets)

    @property
    def num_classes(self) -> int:
        return int(self.class_offsets.shape[0] - 1)

    @property
    def class_counts(self) -> np.ndarray:
        """Calibration points per class ``(C,)``."""
        return np.diff(self.class_offsets)

    def min_alpha(self, mondrian: bool = False) -> float | np.ndarray:
        """Smallest ``alpha`` with a finite ``qhat``: ``1 / (n + 1)``, or per class ``(C,)`` for Mondrian."""
        return min_alpha(self.class_counts) if mondrian else min_alpha(self.scores.shape[0])

    def qhat(self, alpha: float, mondrian: bool = False) -> float | np.ndarray:
        """The threshold: a float, or per class ``(C,)`` for Mondrian (``+inf`` where ``alpha`` is too small)."""
        if _alpha(alpha).ndim != 0:
            raise ValueError(f"alpha must be one number here, got shape {np.shape(alpha)}")
        if not mondrian:
            return conformal_quantile(self.scores, alpha)
        counts = self.class_counts
        k = quantile_rank(counts, float(alpha))
        idx = np.clip(self.class_offsets[:-1] + k - 1, 0, max(self.class_scores.shape[0] - 1, 0))
        return np.where(k <= counts, self.class_scores[idx], np.inf)

    def sets(self, probs: np.ndarray | torch.Tensor, alpha: float, mondrian: bool = False) -> np.ndarray:
        """Prediction sets ``(B, C)`` bool for ``probs (B, C)``: label ``j`` is in iff its score is ``<= qhat``
        (``<= qhat_j`` for Mondrian)."""
        return self.sets_at(probs, self.qhat(alpha, mondrian))

    def sets_at(self, probs: np.ndarray | torch.Tensor, qhat: float | np.ndarray, checked: bool = False) -> np.ndarray:
        """Prediction sets ``(B, C)`` bool for ``probs (B, C)`` at a threshold :meth:`qhat` returned; ``checked``:
        ``probs`` is already a finite, non-negative float64 ``(B, C)`` array (a model's softmax: the per-request
        path skips the checks, which cost more than the set at batch 1)."""
        p = cast(np.ndarray, probs) if checked else _probs(probs)
        if p.shape[1] != self.num_classes:
            raise ValueError(f"probs have {p.shape[1]} classes, the calibrator {self.num_classes}")
        return _label_scores(p, self.method, self.k_reg, self.lam) <= qhat

    def to_tensors(self, prefix: str = "conformal.") -> dict[str, torch.Tensor]:
        """The calibrator's tensors by name, for a safetensors file (the method's name as uint8 bytes)."""
        return {
            prefix + "method": torch.tensor(list(self.method.encode()), dtype=torch.uint8),
            prefix + "params": torch.tensor([float(self.k_reg), self.lam], dtype=torch.float64),
            prefix + "scores": torch.from_numpy(np.ascontiguousarray(self.scores, dtype=np.float64)),
            prefix + "class_scores": torch.from_numpy(np.ascontiguousarray(self.class_scores, dtype=np.float64)),
            prefix + "class_offsets": torch.from_numpy(np.ascontiguousarray(self.class_offsets, dtype=np.int64)),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "conformal.") -> SetCalibrator:
        """:class:`SetCalibrator` back from :meth:`to_tensors`' names (shapes and order checked)."""
        names = ("method", "params", "scores", "class_scores", "class_offsets")
        missing = [prefix + k for k in names if prefix + k not in tensors]
        if missing:
            raise ValueError(f"conformal calibrator lacks {missing}")
        t = {k: tensors[prefix + k] for k in names}
        if t["params"].shape != (2,) or t["method"].dim() != 1:
            raise ValueError(
                f"params must be (2,) and method (L,), got {tuple(t['params'].shape)}, {tuple(t['method'].shape)}"
            )
        method = bytes(t["method"].to(torch.uint8).tolist()).decode(errors="replace")
        k_reg, lam = t["params"].to(torch.float64).tolist()
        return cls(
            method,
            int(k_reg),
            float(lam),
            t["scores"].to(torch.float64).numpy(),
            t["class_scores"].to(torch.float64).numpy(),
            t["class_offsets"].to(torch.int64).numpy(),
        )


# ----------------------------------------------------------------------------- OOD p-values
def keep_top(sets: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sets, filled)``: prediction sets ``(B, C)`` bool with the most probable label of ``probs (B, C)`` put into
    every empty set, and ``(B,)`` which sets were empty. A superset of a conformal set covers the true label at least
    as often, so the guarantee holds unchanged; an empty set (no label passes the threshold: at a large ``alpha``,
    or an input unlike any class) would otherwise answer nothing a caller can act on. The server and the build's
    report both serve and measure these sets."""
    filled = ~sets.any(axis=1)
    if filled.any():
        sets = sets.copy()
        rows = np.flatnonzero(filled)
        sets[rows, np.asarray(probs)[rows].argmax(axis=1)] = True
    return sets, np.asarray(filled)


def ood_p_values(scores: np.ndarray | torch.Tensor, sorted_cal: np.ndarray) -> np.ndarray:
    """Conformal p-values ``(B,)`` of outlier scores ``(B,)`` against ID calibration scores ``(n,)`` sorted ascending.

    ``p = (1 + #{i: cal_i >= s}) / (n + 1)``, in ``[1 / (n + 1), 1]``; small = unusually high score. O(B log n).
    A NaN score gets a NaN p-value.
    """
    s = np.asarray(scores, dtype=np.float64)
    cal = np.asarray(sorted_cal, dtype=np.float64)
    if s.ndim != 1 or cal.ndim != 1:
        raise ValueError(f"scores (B,) and sorted_cal (n,) must be 1-D, got {s.shape} and {cal.shape}")
    n = cal.shape[0]
    at_least = n - np.searchsorted(cal, s, side="left")  # ties count as "at least as extreme"
    return np.where(np.isnan(s), np.nan, (1.0 + at_least) / (n + 1.0))


# ----------------------------------------------------------------------------- binomial tails and LTT p-values
_LOG_FACT = np.zeros(1)


def _log_factorials(n: int) -> np.ndarray:
    """``log(i!)`` for ``i = 0..n`` (cached; float64 lgamma, exact to ~1e-15 relative)."""
    global _LOG_FACT
    if _LOG_FACT.shape[0] <= n:
        m = max(n + 1, 2 * _LOG_FACT.shape[0])
        _LOG_FACT = torch.lgamma(torch.arange(1, m + 1, dtype=torch.float64)).numpy()
    return _LOG_FACT


def binomial_cdf(k: np.ndarray | int, n: np.ndarray | int, p: float) -> np.ndarray:
    """``P(Binom(n, p) <= k)`` for integer arrays ``k``, ``n`` (broadcast), ``0 < p < 1``; float64.

    Sums the probability mass over a window of ``12 sqrt(n) + 40`` terms next to ``k`` (the log-pmf is concave, so
    a term that far from ``k`` on the far side of the mode is ``e^-72`` times the nearest one: the truncation is
    below 1e-25 relative up to ``n = 1e6``): the lower tail when ``k`` is at most the mode, one minus the upper
    tail above it. Relative error about ``1e-16 log(n!)`` in the lower tail, where tests reject (1e-12 at
    ``n = 1,000``), absolute 1e-15 near 1.
    """
    p = _level("p", p)
    k_, n_ = np.broadcast_arrays(np.asarray(k, dtype=np.int64), np.asarray(n, dtype=np.int64))
    if n_.size and n_.min() < 0:
        raise ValueError(f"n must be >= 0, got {n_.min()}")
    k_, n_ = k_.ravel(), n_.ravel()
    out = np.where(k_ < 0, 0.0, 1.0)
    todo = np.flatnonzero((k_ >= 0) & (k_ < n_))
    if todo.size:
        lf = _log_factorials(int(n_[todo].max()))
        lp, lq = math.log(p), math.log1p(-p)
        for chunk in np.array_split(todo, max(1, todo.size // 256)):
            kk, nn = k_[chunk], n_[chunk]
            lower = kk <= np.floor((nn + 1) * p)  # at or below the mode: sum the lower tail directly
            w = (12.0 * np.sqrt(nn)).astype(np.int64) + 40
            start = np.where(lower, np.maximum(kk - w, 0), kk + 1)
            stop = np.where(lower, kk, np.minimum(kk + 1 + w, nn))  # inclusive
            i = start[:, None] + np.arange(int((stop - start).max()) + 1)[None, :]
            valid = i <= stop[:, None]
            i = np.minimum(i, nn[:, None])
            logpmf = lf[nn][:, None] - lf[i] - lf[nn[:, None] - i] + i * lp + (nn[:, None] - i) * lq
            logpmf = np.where(valid, logpmf, -np.inf)
            top = logpmf.max(axis=1, keepdims=True)
            tail = np.exp(top[:, 0]) * np.exp(logpmf - top).sum(axis=1)
            out[chunk] = np.where(lower, np.minimum(tail, 1.0), np.clip(1.0 - tail, 0.0, 1.0))
    return out.reshape(np.broadcast(np.asarray(k), np.asarray(n)).shape)


def binomial_p_value(k: np.ndarray | int, n: np.ndarray | int, eps: float) -> np.ndarray:
    """Exact binomial p-value of ``H0: risk > eps`` after ``k`` errors in ``n`` i.i.d. 0/1 trials.

    ``P(Binom(n, eps) <= k)``; ``n = 0`` gives 1 (no evidence). Shapes broadcast.
    """
    return binomial_cdf(k, n, _level("eps", eps))


def hb_p_value(k: np.ndarray | int, n: np.ndarray | int, eps: float) -> np.ndarray:
    """Hoeffding-Bentkus p-value of ``H0: risk > eps`` (Bates et al. 2021, as in LTT) for ``k`` errors in ``n``.

    ``min(exp(-n h(min(k/n, eps), eps)), e * P(Binom(n, eps) <= k))`` with
    ``h(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b))``. Valid for any losses in [0, 1]; for 0/1 losses it is never
    smaller than :func:`binomial_p_value` (so ``binomial`` is the sharper choice here, ``hb`` the
    assumption-light one). ``n = 0`` gives 1.
    """
    eps = _level("eps", eps)
    k_, n_ = np.broadcast_arrays(np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64))
    a = np.minimum(np.divide(k_, n_, out=np.full(k_.shape, eps), where=n_ > 0), eps)
    xlogx = np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0) / eps), 0.0)
    h = xlogx + (1 - a) * (np.log1p(-a) - math.log1p(-eps))
    hoeffding = np.exp(-n_ * h)
    bentkus = math.e * binomial_cdf(k, n, eps)
    return np.minimum(np.minimum(hoeffding, bentkus), 1.0)


def min_accepted(eps: float, delta: float) -> int:
    """Fewest accepted points at which ``H0: risk > eps`` can be rejected at ``delta``: zero errors,
    ``(1 - eps)^n <= delta`` (the same for both p-values: Hoeffding's term equals ``(1 - eps)^n`` at ``k = 0``)."""
    eps, delta = _level("eps", eps), _level("delta", delta)
    n = max(1, math.ceil(math.log(delta) / math.log1p(-eps)))
    while (1 - eps) ** n > delta:  # float round-off in the ceil: settle on the exact smallest n
        n += 1
    while n > 1 and (1 - eps) ** (n - 1) <= delta:
        n -= 1
    return n


# ----------------------------------------------------------------------------- selective risk control (LTT)
@dataclass(frozen=True)
class SelectiveRule:
    """A selective-classification rule certified by :func:`selective_thresholds`.

    Accept an input iff it is eligible and its confidence is ``>= threshold``. ``threshold`` None: no threshold
    could be certified for ``eps`` (accept nothing). ``n_accepted``, ``accept_rate`` (of all calibration points),
    ``risk`` (errors among the accepted, NaN when none) and ``p_value`` describe the calibration split;
    ``tested``: thresholds tested, the one that ended the sequence included.
    """

    eps: float
    delta: float
    threshold: float | None
    n_accepted: int
    accept_rate: float
    risk: float
    p_value: float
    tested: int


def _selective_inputs(
    conf: np.ndarray | torch.Tensor,
    correct: np.ndarray | torch.Tensor,
    eps: float | Sequence[float],
    delta: float,
    eligible: np.ndarray | torch.Tensor | None,
    p_value: str,
    min_accept: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, list[float]]:
    """:func:`selective_thresholds`' arguments checked: ``(conf, correct, eligible, delta, targets)``."""
    c = np.asarray(conf, dtype=np.float64)
    ok = np.asarray(correct)
    if c.ndim != 1 or ok.shape != c.shape:
        raise ValueError(f"conf and correct must both be (n,), got {c.shape} and {ok.shape}")
    if ok.dtype != np.bool_:
        raise ValueError(f"correct must be bool, got {ok.dtype}")
    if not np.all(np.isfinite(c)):
        raise ValueError("conf must be finite")
    elig = np.ones(c.shape, dtype=bool) if eligible is None else np.asarray(eligible)
    if elig.shape != c.shape or elig.dtype != np.bool_:
        raise ValueError(f"eligible must be a bool (n,) = {c.shape} mask, got {elig.dtype} {elig.shape}")
    if p_value not in P_VALUES:
        raise ValueError(f"unknown p_value {p_value!r}; expected one of {list(P_VALUES)}")
    delta = _level("delta", delta)
    targets = [_level("eps", e) for e in np.atleast_1d(np.asarray(eps, dtype=np.float64)).tolist()]
    if not targets:
        raise ValueError("eps must name at least one target risk")
    if min_accept is not None and (int(min_accept) != min_accept or min_accept < 0):
        raise ValueError(f"min_accept must be an integer >= 0, got {min_accept!r}")
    return c, ok, elig, delta, targets


def _candidates(
    ce: np.ndarray, err: np.ndarray, grid: np.ndarray | Sequence[float] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(thresholds, n_acc, k)`` descending: the candidate thresholds, and the eligible points each accepts and the
    errors among them, from eligible confidences ``ce (n_e,)`` and errors ``err (n_e,)``."""
    order = np.argsort(-ce, kind="stable")
    desc = ce[order]
    cum_err = np.concatenate([[0], np.cumsum(err[order])])  # errors among the top j, j = 0..n_e
    if grid is None:
        # one candidate per distinct confidence: the top j points, j at the end of each run of equal confidences
        n_acc = np.flatnonzero(np.concatenate([desc[:-1] != desc[1:], [True]])) + 1 if desc.size else np.zeros(0, int)
        thresholds = desc[n_acc - 1]
    else:
        g = np.asarray(grid, dtype=np.float64)
        if g.ndim != 1 or g.size == 0 or not np.all(np.isfinite(g)):
            raise ValueError(f"grid must be a non-empty finite (G,) array, got shape {g.shape}")
        thresholds = np.unique(g)[::-1]
        n_acc = desc.size - np.searchsorted(desc[::-1], thresholds, side="left")
    return thresholds, n_acc, cum_err[n_acc]


def selective_thresholds(
    conf: np.ndarray | torch.Tensor,
    correct: np.ndarray | torch.Tensor,
    eps: float | Sequence[float],
    delta: float = 0.1,
    *,
    eligible: np.ndarray | torch.Tensor | None = None,
    p_value: str = "binomial",
    grid: np.ndarray | Sequence[float] | None = None,
    min_accept: int | None = None,
) -> list[SelectiveRule]:
    """Confidence thresholds whose selective risk is certified at most ``eps`` (Learn then Test, fixed sequence).

    Args:
        conf: ``(n,)`` calibration confidences (e.g. the ensemble's MSP); higher = more confident.
        correct: ``(n,)`` bool, whether the prediction was right.
        eps: target selective risk(s), each in (0, 1); one :class:`SelectiveRule` per value, in order.
        delta: allowed failure probability of each guarantee (use ``delta / len(eps)`` for all at once).
        eligible: ``(n,)`` bool, inputs the rule may accept at all (e.g. those passing a fixed OOD cut, chosen
            without this split's labels); default every input. The rule is "accept iff eligible and
            ``conf >= threshold``".
        p_value: ``binomial`` (exact, for 0/1 losses) or ``hb`` (Hoeffding-Bentkus).
        grid: candidate thresholds fixed before seeing this split; default: the distinct confidences of the
            eligible calibration points.
        min_accept: with the default grid, the sequence starts at the highest threshold that accepts at least this
            many calibration points; default :func:`min_accepted` ``(eps, delta)``, below which no threshold can be
            rejected anyway (started at the top, the sequence would end at once).

    For a threshold ``lam`` the selective risk is ``R(lam) = P(error | accepted by lam)`` on the distribution the
    calibration and test points are drawn from, and ``H0(lam): R(lam) > eps``. Its p-value: among the ``n_acc``
    eligible calibration points with ``conf >= lam`` there are ``k`` errors; ``binomial`` gives
    ``P(Binom(n_acc, eps) <= k)``. Thresholds are tested from the highest (fewest accepted) downwards; the first
    p-value above ``delta`` ends the sequence and the returned threshold is the last (lowest, most accepting)
    rejected one.

    Why the conditional test is valid although ``n_acc`` is random: with i.i.d. calibration points, given which
    points are accepted by a fixed ``lam`` (in particular given ``n_acc``), the accepted points are i.i.d. draws
    from the distribution conditioned on acceptance, so their errors are i.i.d. Bernoulli(``R(lam)``); under
    ``H0(lam)`` the binomial (and HB) p-value is super-uniform conditionally on ``n_acc``, hence also without the
    conditioning. It controls the selective risk ``P(error | accepted)``, not the joint ``P(error and accepted)``.
    Fixed-sequence testing needs nothing about the dependence between the p-values: a false rejection requires
    rejecting the first true null of the sequence, which has probability at most ``delta``.

    Guarantee. Let the calibration points and the test point be i.i.d. and ``lam_hat`` the returned threshold.

    * With ``grid`` fixed before the split is drawn: ``P(R(lam_hat) > eps) <= delta`` over the draw of the split,
      for any model (a threshold that accepts no calibration point has p-value 1 and ends the sequence, so start
      the grid where the rule accepts enough points).
    * With the default grid (data-chosen thresholds, started ``min_accept`` points down): the same holds when the
      confidence is continuously distributed (no ties) and higher thresholds are never riskier in the sense that
      ``{lam : R(lam) > eps}`` is a down-set (a threshold within ``eps`` keeps every higher one within ``eps``).
      Proof sketch: testing the top ``j`` calibration points is testing the rule ``conf > c_(j+1)``, ``c_(j+1)``
      the next confidence down; given ``c_(j+1)``, those ``j`` points are i.i.d. from the distribution above it.
      Let ``lam_0`` be the edge of the down-set; the first null tested is either the start (``c_(min_accept+1)``
      below ``lam_0``; given it, the top ``min_accept`` points are i.i.d. with risk ``> eps``) or ``c_(j+1)``, the
      first confidence below ``lam_0`` (given it and that the ``j`` above lie above ``lam_0``, they are i.i.d. with
      risk ``R(lam_0) >= eps``): either way its p-value is super-uniform and the events partition, so the false
      rejection probability is at most ``delta``. The returned ``c_(j)`` lies above the certified ``c_(j+1)``,
      within ``eps`` by the down-set assumption. Without that assumption a high-risk slice of confidences above
      the start (holding fewer than ``min_accept`` calibration points) could go unseen; pass a fixed ``grid`` for a
      model-free guarantee.

    Each ``eps`` is a separate guarantee at level ``delta``.
    """
    c, ok, elig, delta, targets = _selective_inputs(conf, correct, eps, delta, eligible, p_value, min_accept)
    fn = binomial_p_value if p_value == "binomial" else hb_p_value
    n_all = c.shape[0]
    thresholds, n_acc, k = _candidates(c[elig], ~ok[elig], grid)

    return [_fixed_sequence(thresholds, n_acc, k, n_all, e, delta, fn, grid is None, min_accept) for e in targets]


def _fixed_sequence(
    thresholds: np.ndarray,
    n_acc: np.ndarray,
    k: np.ndarray,
    n_all: int,
    e: float,
    delta: float,
    fn: Any,
    data_grid: bool,
    min_accept: int | None,
) -> SelectiveRule:
    """One target ``e``: the candidates tested from the highest down, stopping at the first p-value above ``delta``;
    the rule of the last rejected (see :func:`selective_thresholds`)."""
    start = 0
    if data_grid:
        m = min_accepted(e, delta) if min_accept is None else int(min_accept)
        start = int(np.searchsorted(n_acc, m, side="left"))
    last, p_last, p_stop, tested = -1, 1.0, 1.0, 0
    for lo in range(start, thresholds.size, 512):  # early stop: most sequences end long before the last
        p = fn(k[lo : lo + 512], n_acc[lo : lo + 512], e)
        fail = np.flatnonzero(p > delta)
        stop = lo + (int(fail[0]) if fail.size else p.size)
        tested = stop - start + (1 if fail.size else 0)
        if stop > lo:
            last, p_last = stop - 1, float(p[stop - 1 - lo])
        if fail.size:
            p_stop = float(p[fail[0]])
            break
    if last < 0:
        return SelectiveRule(e, delta, None, 0, 0.0, float("nan"), p_stop, tested)
    na, kk = int(n_acc[last]), int(k[last])
    return SelectiveRule(e, delta, float(thresholds[last]), na, na / n_all, kk / na, p_last, tested)
