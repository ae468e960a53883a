"""Selective classification with a certified risk: Learn then Test (Angelopoulos et al. 2021) on binomial tails.

A rule accepts an input iff it is eligible (e.g. it passes a fixed OOD cut) and its confidence is at least a
threshold; :func:`selective_thresholds` picks the threshold on a calibration split so that the selective risk, the
error rate among the accepted inputs, is at most ``eps`` with probability at least ``1 - delta``. Pure statistics on
float64 numpy arrays, like :mod:`service.core.conformal` (which re-exports these names).

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

Each ``eps`` is a separate guarantee at level ``delta``. The p-values: :func:`binomial_p_value` (exact, for 0/1
losses) and :func:`hb_p_value` (Hoeffding-Bentkus, for any losses in [0, 1]), both over :func:`binomial_cdf`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "P_VALUES",
    "Candidates",
    "SelectiveRule",
    "binomial_cdf",
    "binomial_p_value",
    "hb_p_value",
    "min_accepted",
    "selective_thresholds",
]

P_VALUES = ("binomial", "hb")


def _level(name: str, value: float) -> float:
    v = float(value)
    if not 0 < v < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


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


class Candidates(NamedTuple):
    """The candidate thresholds of a selective rule, highest first, with what each accepts on calibration data."""

    thresholds: np.ndarray  # (G,) descending
    n_acc: np.ndarray  # (G,) eligible calibration points with conf >= the threshold (ascending)
    k: np.ndarray  # (G,) errors among them


def _candidates(ce: np.ndarray, err: np.ndarray, grid: np.ndarray | Sequence[float] | None) -> Candidates:
    """The candidates (:class:`Candidates`) from eligible confidences ``ce (n_e,)`` and errors ``err (n_e,)``:
    ``grid``'s thresholds, or one per distinct confidence."""
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
    return Candidates(thresholds, n_acc, cum_err[n_acc])


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

    The test, why it is valid and the guarantee (with its conditions) are in the module docstring. Each ``eps`` is
    a separate guarantee at level ``delta``.
    """
    c, ok, elig, delta, targets = _selective_inputs(conf, correct, eps, delta, eligible, p_value, min_accept)
    fn = binomial_p_value if p_value == "binomial" else hb_p_value
    cands = _candidates(c[elig], ~ok[elig], grid)
    rules = []
    for e in targets:
        start = 0  # a fixed grid is tested from its top; the data's own from min_accept points down
        if grid is None:
            m = min_accepted(e, delta) if min_accept is None else int(min_accept)
            start = int(np.searchsorted(cands.n_acc, m, side="left"))
        rules.append(_fixed_sequence(cands, start, c.shape[0], e, delta, fn))
    return rules


def _fixed_sequence(
    cands: Candidates, start: int, n_all: int, e: float, delta: float, fn: Callable[..., np.ndarray]
) -> SelectiveRule:
    """One target ``e``: the candidates tested from ``start`` (the highest threshold tested) down, stopping at the
    first p-value above ``delta``; the rule of the last rejected (see :func:`selective_thresholds`). ``n_all``: the
    calibration points, eligible or not (the accept rate's denominator)."""
    thresholds, n_acc, k = cands
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
