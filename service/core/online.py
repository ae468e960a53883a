"""Online statistics over the answers a model served and the true labels that come back for some of them.

Pure statistics on float64 numpy arrays, like :mod:`service.core.conformal`. Each tracker's whole state is a plain
dict of JSON values (``to_state``, ``from_state``) that a store keeps so replicas agree; updates are applied one at a
time (no lock), in the order the labels were accepted. For users, and the measurements: ``docs/monitoring.md``.

**Adaptive conformal sets** (:class:`AdaptiveConformal`; Gibbs & Candes 2021, "Adaptive conformal inference under
distribution shift"). A split conformal set covers only while traffic is exchangeable with the calibration split.
The adaptive set is built from the same calibration scores at a level ``alpha_t`` that every label moves:
``alpha_{t+1} = alpha_t + gamma (alpha - err_t)``, ``err_t = 1`` when the set served at ``alpha_t`` missed the label.
``alpha_t <= 0`` gives every label, ``alpha_t >= 1`` the empty set (served, as every set, with the top label put in:
:func:`~service.core.conformal.keep_top`); ``err_t`` is the miss of the set before the top label was put in
(:func:`raw_misses`), so the served set covers whenever that one does.

Guarantee (deterministic: nothing is random; it holds for ANY sequence of inputs and labels, an adversary's too).
With ``T`` labels applied, ``alpha_1`` the starting level and ``D`` the most answers ever waiting at once for their
label (served at an adaptive level, labelled later; ``D = 1`` when each label is applied before the next adaptive
answer, the setting of Gibbs & Candes' Proposition 4.1)::

    | (1/T) sum_{t<=T} err_t - alpha |  <=  (max(alpha_1, 1 - alpha_1) + gamma D) / (gamma T)

Proof: the update telescopes, ``alpha_{T+1} - alpha_1 = gamma sum_t (alpha - err_t)``, and ``alpha_t`` stays in
``[-gamma D (1 - alpha), 1 + gamma D alpha]``: below 0 every set holds every label, so only the at most ``D``
answers served before ``alpha_t`` fell below 0 can still lower it (above 1 likewise: every set misses). It bounds the
miss rate averaged over time, not any one answer's, and needs ``alpha_t`` unclipped (MAPIE 1.6 clips it to
``[0, 1]``, which breaks the telescoping sum). Foreign inputs (labels outside the model's) are left out: no set
covers them, so they would drive ``alpha_t`` down for ever. The state is two counts, ``alpha_t = alpha_1 + gamma
(alpha T - misses)``, which do not depend on the order labels arrive in. ``gamma = 0.01`` by default (Gibbs & Candes
use 0.005; the bound is then ``91 / T``): measured after a switch to a harder class mix, back at ``alpha`` within
about 250 labels and steadier than at 0.005, for sets at most 3 % larger (``docs/monitoring.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from statistics import NormalDist
from typing import Any, TypeVar

import numpy as np
import torch

from .conformal import SetCalibrator, keep_top
from .selective import binomial_cdf

__all__ = ["AdaptiveConformal", "clopper_pearson_upper", "raw_misses", "wilson_interval"]

Array = np.ndarray | torch.Tensor | Sequence[float]
_D = TypeVar("_D")


def _level(name: str, value: float) -> float:
    v = float(value)
    if not 0 < v < 1:  # also rejects NaN
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def _z(level: float) -> float:
    """The standard normal quantile of a two-sided interval at ``level``: 1.96 at 0.95."""
    return NormalDist().inv_cdf(0.5 + _level("level", level) / 2)


def _require(what: str, state: Mapping[str, Any], names: Sequence[str]) -> None:
    if missing := [k for k in names if k not in state]:
        raise ValueError(f"{what} state lacks {missing}; expected the keys {list(names)}")


def _from_state(cls: type[_D], state: Mapping[str, Any]) -> _D:
    """The dataclass ``cls`` from a state dict holding each of its fields (extra keys ignored, ranges checked)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    _require(cls.__name__, state, names)
    return cls(**{k: state[k] for k in names})


# ----------------------------------------------------------------------------- intervals
def wilson_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` of a proportion, ``k`` successes in ``n`` trials, at ``level``
    (two-sided). ``n = 0`` gives ``(0, 1)``: nothing known."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k = {k}, n = {n}")
    if n == 0:
        return 0.0, 1.0
    z = _z(level)
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    """One-sided Clopper-Pearson upper bound on a risk after ``k`` errors in ``n`` i.i.d. 0/1 trials: the ``p`` with
    ``P(Binom(n, p) <= k) = delta``, so ``P(risk > bound) <= delta`` (exact); 1 when ``k = n``. Bisection to 1e-12."""
    delta = _level("delta", delta)
    if not 0 <= k <= n or n == 0:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k = {k}, n = {n}")
    if k == n:
        return 1.0
    lo, hi = k / n, 1.0
    while hi - lo > 1e-12:  # P(Binom(n, p) <= k) falls as p grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(binomial_cdf(k, n, mid)) > delta else (lo, mid)
    return hi


# ----------------------------------------------------------------------------- adaptive conformal inference
def raw_misses(covered: Array, filled: Array | None = None) -> np.ndarray:
    """``err_t (B,)`` bool of answers served with adaptive sets: the true label was not in the served set, or the set
    was empty before the top label was put in (``filled``, as :meth:`AdaptiveConformal.sets` returns it)."""
    miss = ~np.asarray(covered, dtype=bool)
    return miss if filled is None else miss | np.asarray(filled, dtype=bool)


@dataclass
class AdaptiveConformal:
    """The level ``alpha_t`` of adaptive conformal sets for one target miscoverage ``alpha`` (module docstring).

    ``alpha``: the target in (0, 1); ``gamma``: the step in (0, 1); ``alpha_1``: the starting level (default
    ``alpha``); ``labelled`` and ``misses``: the labels applied so far and how many of them the set missed.
    """

    alpha: float
    gamma: float = 0.01
    alpha_1: float | None = None
    labelled: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.alpha = _level("alpha", self.alpha)
        self.gamma = _level("gamma", self.gamma)
        self.alpha_1 = self.alpha if self.alpha_1 is None else float(self.alpha_1)
        if not 0 <= self.alpha_1 <= 1:
            raise ValueError(f"alpha_1 must be in [0, 1], got {self.alpha_1!r}")
        if not 0 <= self.misses <= self.labelled:
            raise ValueError(f"need 0 <= misses <= labelled, got {self.misses} and {self.labelled}")

    @property
    def alpha_t(self) -> float:
        """The level the next set is built at: ``alpha_1 + gamma (alpha T - misses)`` (not clipped)."""
        assert self.alpha_1 is not None
        return self.alpha_1 + self.gamma * (self.alpha * self.labelled - self.misses)

    def qhat(self, calibrator: SetCalibrator, mondrian: bool = False) -> float | np.ndarray:
        """The set threshold at ``alpha_t``: the calibrator's (:meth:`SetCalibrator.qhat`); ``+inf`` (every label)
        at ``alpha_t <= 0``, ``-inf`` (the empty set) at ``alpha_t >= 1``; per class ``(C,)`` for Mondrian."""
        a = self.alpha_t
        if 0 < a < 1:
            return calibrator.qhat(a, mondrian)
        q = math.inf if a <= 0 else -math.inf
        return np.full(calibrator.num_classes, q) if mondrian else q

    def sets(
        self, calibrator: SetCalibrator, probs: np.ndarray, mondrian: bool = False
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """``(sets (B, C) bool, filled (B,) bool, alpha_t)`` for ``probs (B, C)``: the sets at ``alpha_t`` as served
        (never empty: ``filled`` marks those that were and got the top label) and the level they were built at."""
        a = self.alpha_t
        raw = calibrator.sets_at(probs, self.qhat(calibrator, mondrian))
        sets, filled = keep_top(raw, np.asarray(probs, dtype=np.float64))
        return sets, filled, a

    def update(self, misses: Array) -> None:
        """Apply labels: ``misses (B,)`` bool, ``err_t`` of answers served at adaptive levels, in arrival order
        (:func:`raw_misses`; leave foreign inputs out)."""
        m = np.asarray(misses)
        if m.ndim != 1 or (m.size and not np.isin(m, (0, 1)).all()):
            raise ValueError(f"misses must be (B,) of 0/1 or bool, got shape {m.shape}")
        self.labelled += int(m.size)
        self.misses += int(m.sum())

    @property
    def miscoverage(self) -> float | None:
        """The realised miss rate ``misses / labelled`` (None before any label)."""
        return self.misses / self.labelled if self.labelled else None

    def bound(self, delay: int = 1) -> float:
        """The deterministic bound on ``|miscoverage - alpha|`` after the labels applied so far, with at most
        ``delay`` answers waiting for their label at once (``inf`` before any label)."""
        if delay < 1:
            raise ValueError(f"delay must be >= 1, got {delay}")
        assert self.alpha_1 is not None
        top = max(self.alpha_1, 1 - self.alpha_1) + self.gamma * delay
        return top / (self.gamma * self.labelled) if self.labelled else math.inf

    def to_state(self) -> dict[str, Any]:
        """The state as a plain dict (:meth:`from_state` reads it back)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> AdaptiveConformal:
        """A tracker back from :meth:`to_state`'s dict (keys and ranges checked)."""
        return _from_state(cls, state)
