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

**Training-conditional (PAC) sets** (Vovk 2012, "Conditional validity of inductive conformal predictors"; Bian &
Barber 2023). The guarantee above averages over the draw of the calibration split: one deployed artifact, with its
one split, may cover less than ``1 - alpha`` of its future inputs, and about half of all splits do (by up to a few
``sqrt(alpha (1 - alpha) / n)``). With a ``delta`` in (0, 1) the rank is instead :func:`pac_rank`, the smallest
``k`` with ``P(Binom(n, 1 - alpha) >= k) <= delta``; then, for i.i.d. data, the coverage of the deployed sets,
``P(y in C(x) | calibration split)``, is at least ``1 - alpha`` with probability at least ``1 - delta`` over the
draw of the split. (With continuous scores that coverage is ``F(s_(k))``, distributed ``Beta(k, n + 1 - k)``, and
``P(F(s_(k)) < 1 - alpha)`` is the probability that ``k`` or more of the ``n`` scores fall below the
``(1 - alpha)``-quantile: the binomial tail above; ties only raise the coverage.) Per class for Mondrian sets,
each class at level ``delta``. The price: ``k / (n + 1)`` is about ``1 - alpha + z_(1 - delta) sqrt(alpha
(1 - alpha) / n)``, e.g. 0.909 instead of 0.900 at ``n = 2000``, ``alpha = delta = 0.1``; and the smallest
``alpha`` with a finite ``qhat`` is ``1 - delta^(1/n)`` (``(1 - alpha)^n <= delta``), about ``log(1 / delta) / n``.

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
:mod:`service.core.selective`, whose docstring states the guarantee and its conditions; its names are re-exported
here (:func:`selective_thresholds`, the binomial and Hoeffding-Bentkus p-values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from service.core.selective import (
    P_VALUES,
    SelectiveRule,
    _level,
    binomial_cdf,
    binomial_p_value,
    hb_p_value,
    min_accepted,
    selective_thresholds,
)

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
    "pac_rank",
    "quantile_rank",
    "selective_thresholds",
    "true_label_scores",
]

SCORES = ("lac", "aps", "raps")

# alpha within this distance of a multiple of 1 / (n + 1) is read as that multiple: 0.1 and n = 9 give the 9th
# smallest score, as the caller means, whatever the last bit of the float 0.1 (the coverage this costs: <= 1e-9)
_ALPHA_TOL = 1e-9


# ----------------------------------------------------------------------------- validation
def _alpha(alpha: float | Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(alpha, dtype=np.float64)
    if a.size == 0 or not np.all((a > 0) & (a < 1)):  # also rejects NaN
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return a


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


def pac_rank(n: int | np.ndarray, alpha: float, delta: float) -> int | np.ndarray:
    """The training-conditional rank (module docstring): the smallest ``k`` in ``[1, n]`` with
    ``P(Binom(n, 1 - alpha) >= k) <= delta``, i.e. one plus the ``(1 - delta)``-quantile of ``Binom(n, 1 - alpha)``;
    ``n + 1`` (no finite ``qhat``) when even ``k = n`` fails, i.e. ``(1 - alpha)^n > delta``. Vectorised over ``n``
    (per-class counts); ``alpha`` and ``delta`` one number each. A bisection on the exact binomial CDF of
    :func:`~service.core.selective.binomial_cdf`: O(log n) CDF evaluations per ``n``."""
    a, d = _level("alpha", alpha), _level("delta", delta)
    nn = np.atleast_1d(np.asarray(n, dtype=np.int64))
    if nn.size and nn.min() < 0:
        raise ValueError(f"n must be >= 0, got {nn.min()}")
    out = np.empty_like(nn)
    for i, m in enumerate(nn.tolist()):
        # the CDF at j is non-decreasing in j and reaches 1 at j = n: find the smallest j with CDF(j) >= 1 - d
        lo, hi = -1, m  # CDF(lo) < 1 - d (CDF(-1) = 0), CDF(hi) >= 1 - d
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if float(binomial_cdf(mid, m, 1.0 - a)) >= 1.0 - d else (mid, hi)
        out[i] = hi + 1 if hi < m else m + 1  # j = n - 1 failing means k = n fails too: P(Bin >= n) > d
    return int(out[0]) if np.ndim(n) == 0 else out


def _pac_min_alpha(n: np.ndarray, delta: float) -> np.ndarray:
    """Smallest ``alpha`` with :func:`pac_rank` ``<= n``: ``1 - delta^(1/n)`` (every ``alpha`` for ``n = 0`` would
    need ``1``, so ``1.0`` there: no set is finite)."""
    nn = np.asarray(n, dtype=np.float64)
    return np.where(nn > 0, -np.expm1(math.log(delta) / np.maximum(nn, 1.0)), 1.0)


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
    sizes, or none at all, fit in one flat array). ``delta``: None for the marginal rank (:func:`quantile_rank`),
    else the training-conditional one at this ``delta`` (:func:`pac_rank`; module docstring). Build with
    :meth:`fit`; store with :meth:`to_tensors` (the tensors hold the scores; ``delta`` travels in the manifest).
    """

    method: str
    k_reg: int
    lam: float
    scores: np.ndarray
    class_scores: np.ndarray
    class_offsets: np.ndarray
    delta: float | None = None

    def __post_init__(self) -> None:
        _method(self.method, self.k_reg, self.lam)
        if self.delta is not None:
            _level("delta", self.delta)
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
        delta: float | None = None,
    ) -> SetCalibrator:
        """Calibrate on ``probs (n, C)`` with true ``labels (n,)``; ``method``, ``k_reg``, ``lam`` as in
        :func:`label_scores`; ``delta`` as in the class docstring."""
        p = _probs(probs)
        if p.shape[0] == 0:
            raise ValueError("need at least one calibration point, got probs of shape (0, C)")
        y = _labels(labels, p.shape[0], p.shape[1])
        s = true_label_scores(p, y, method, k_reg, lam)
        by_class = np.lexsort((s, y))  # class first, then score
        offsets = np.concatenate([[0], np.cumsum(np.bincount(y, minlength=p.shape[1]))]).astype(np.int64)
        return cls(method, int(k_reg), float(lam), np.sort(s), s[by_class], offsets, delta)

    @property
    def num_classes(self) -> int:
        return int(self.class_offsets.shape[0] - 1)

    @property
    def class_counts(self) -> np.ndarray:
        """Calibration points per class ``(C,)``."""
        return np.diff(self.class_offsets)

    def min_alpha(self, mondrian: bool = False) -> float | np.ndarray:
        """Smallest ``alpha`` with a finite ``qhat``, or per class ``(C,)`` for Mondrian: ``1 / (n + 1)``; with
        ``delta``, ``1 - delta^(1/n)``."""
        n = self.class_counts if mondrian else self.scores.shape[0]
        if self.delta is None:
            return min_alpha(n)
        m = _pac_min_alpha(np.asarray(n), self.delta)
        return m if mondrian else float(m)

    def rank(self, n: int | np.ndarray, alpha: float, marginal: bool = False) -> int | np.ndarray:
        """The rank (1-based) of ``qhat`` among ``n`` sorted scores at ``alpha``: with ``delta`` the
        training-conditional one unless ``marginal``, else the marginal one; ``> n``: no finite ``qhat``."""
        return quantile_rank(n, alpha) if self.delta is None or marginal else pac_rank(n, alpha, self.delta)

    def qhat(self, alpha: float, mondrian: bool = False, marginal: bool = False) -> float | np.ndarray:
        """The threshold: a float, or per class ``(C,)`` for Mondrian (``+inf`` where ``alpha`` is too small).
        ``marginal``: the marginal rank even with ``delta`` (the adaptive method's sets, whose guarantee is over
        the stream, :mod:`service.core.online`)."""
        if _alpha(alpha).ndim != 0:
            raise ValueError(f"alpha must be one number here, got shape {np.shape(alpha)}")
        if not mondrian:
            n = self.scores.shape[0]
            r = int(self.rank(n, float(alpha), marginal))
            return float(self.scores[r - 1]) if r <= n else math.inf
        counts = self.class_counts
        k = np.asarray(self.rank(counts, float(alpha), marginal))
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
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], prefix: str = "conformal.", delta: float | None = None
    ) -> SetCalibrator:
        """:class:`SetCalibrator` back from :meth:`to_tensors`' names (shapes and order checked); ``delta`` from the
        manifest (``guarantees.conformal.delta``)."""
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
            delta,
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
