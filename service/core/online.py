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

**Harmful-shift alarm** (:class:`HarmfulShiftAlarm`; Podkopaev & Ramdas 2021, "Tracking the risk of a deployed
model and detecting harmful distribution shifts"). It fires when the labelled answers' risk (0/1 error, or any loss
in ``[0, 1]``) rises above ``theta = U + tolerance``, ``U`` an upper confidence bound on the source risk at level
``delta_source`` (:func:`clopper_pearson_upper` of the calibration split's errors). The test bets (Waudby-Smith &
Ramdas 2023): a bet of ``lambda`` on loss ``l`` multiplies the capital by ``1 + lambda (l - theta)``, a fair or
losing game while the risk is at most ``theta``. A bet from the first label dilutes a late change in a long history,
so the capital is a mixture over when the change starts, as in :mod:`service.core.drift`: a share ``pi_b = g(b) -
g(b + 1)``, ``g(b) = 1 / ln(b + e - 1)``, joins the ``m = 6`` bets ``lambda_j = 2^-j / (2 theta)`` (equal shares)
at the first label of block ``b`` (``block = 50`` labels: a change is met at most 49 labels late, for ``ln 50``
fewer nats of prior penalty); the rest waits in reserve. The alarm fires, and stays on, at capital ``1 / delta_test``.

Guarantee. Let the calibration split be i.i.d. from the source distribution, of risk ``R_S``, and every labelled
answer's risk given everything before it be at most ``R_S + tolerance`` (e.g. i.i.d. target traffic of risk
``R_T <= R_S + tolerance``). Then ``P(the alarm ever fires) <= delta_source + delta_test`` over the draw of the split
and the stream, however long it runs: ``U >= R_S`` but with probability ``delta_source``, and then each component
of the mixture, so the mixture too, is a nonnegative supermartingale (each factor has mean ``1 + lambda (risk -
theta) <= 1``), which reaches ``1 / delta_test`` with probability at most ``delta_test`` (Ville's inequality).
:meth:`HarmfulShiftAlarm.from_errors` splits ``delta`` in halves, as MAPIE's ``RiskMonitoring`` does. For errors
among accepted answers the source bound is the risk rule's certified ``eps`` (which holds with probability
``1 - delta`` of the rule). Defaults ``delta = 0.05``, ``tolerance = 0.02``: a drop of 10 points of accuracy after
1,000 ID labels is found within 2,500 labels, where MAPIE's full-history bound needs up to 4,700 (the docs page).

**Label-free accuracy** (as NannyML's CBPE): with calibrated probabilities, answer ``i`` is right with probability
``p_i``, its top-label probability, so ``N`` answers' realised accuracy lies within ``z sqrt(sum p_i (1 - p_i)) / N``
of ``mean(p_i)`` (Poisson-binomial variance, normal interval). Where calibration fails (a class mix the model is
overconfident on, foreign inputs) it fails silently, so :class:`Quality` puts it beside the labelled answers'
realised accuracy: a difference whose interval misses 0 says the probabilities are off on this traffic.

**Realised figures** (:class:`QualityWindow`), over the last ``window`` labelled answers and over all: accuracy,
coverage of the served sets, error among accepted answers, the OOD flag's precision and recall (positives: labels
outside the model's, which count as wrong and uncovered), each with a Wilson score interval (pointwise: one look at
one window; watching over time is the alarm's job).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from statistics import NormalDist
from typing import Any, TypeVar

import numpy as np
import torch

from service.core.conformal import SetCalibrator, keep_top
from service.core.selective import binomial_cdf

__all__ = [
    "AdaptiveConformal",
    "Counts",
    "Figure",
    "HarmfulShiftAlarm",
    "Quality",
    "QualityWindow",
    "clopper_pearson_upper",
    "estimate_figure",
    "quality",
    "raw_misses",
    "shift_log_statistic",
    "wilson_interval",
]

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
        """The set threshold at ``alpha_t``: the calibrator's marginal one (the guarantee is over the stream);
        ``+inf`` (every label) at ``alpha_t <= 0``, ``-inf`` (empty) at ``alpha_t >= 1``; ``(C,)`` for Mondrian."""
        a = self.alpha_t
        if 0 < a < 1:
            return calibrator.qhat(a, mondrian, marginal=True)
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


# ----------------------------------------------------------------------------- the harmful-shift alarm
def _change_weights(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log pi_b, log g(b + 1))`` for blocks ``b >= 1`` ``(T,)``: the capital joining the bets at block ``b`` and
    the reserve left after it, ``pi_b = g(b) - g(b + 1)``, ``g(b) = 1 / ln(b + e - 1)`` (``g(1) = 1``)."""
    b = np.asarray(b, dtype=np.float64)
    a, c = np.log(b + math.e - 1.0), np.log(b + math.e)
    # g(b) - g(b + 1) = (c - a) / (a c), with c - a = log1p(1 / (b + e - 1)) computed without cancellation
    return np.log(np.log1p(1.0 / (b + math.e - 1.0))) - np.log(a) - np.log(c), -np.log(c)


def shift_log_statistic(
    losses: np.ndarray, theta: float, lambdas: np.ndarray, log_a: np.ndarray, start: int, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """Advance the change-point mixture of bets over losses ``(..., T)`` in ``[0, 1]``, labels ``start + 1 ..
    start + T``, against risk ``theta``, bets ``lambdas (m,)`` (each in ``[0, 1 / theta)``), blocks of ``block``.

    ``log_a (..., m)``: log of each bet's capital before (``-inf`` at the start of a test). Returns ``(log M_t
    (..., T), log_a after (..., m))``; leading dimensions are independent streams. Each bet's capital follows
    ``A_t = (A_{t-1} + w_t) (1 + lambda (l_t - theta))``, ``w_t = pi_b / m`` at the first label of block ``b`` and 0
    elsewhere; ``M_t = sum_j A_t^j + g(b_t + 1)``. Vectorised over ``t`` with cumulative sums in log space.
    """
    lam = np.asarray(lambdas, dtype=np.float64)
    x = np.asarray(losses, dtype=np.float64)
    t = start + np.arange(1, x.shape[-1] + 1)  # the labels' 1-based indices (T,)
    log_pi, log_reserve = _change_weights((t - 1) // block + 1)
    log_w = np.where((t - 1) % block == 0, log_pi - math.log(lam.shape[0]), -np.inf)  # (T,)
    # the exponentials below stay in float range over spans of up to 600 nats of bets (factors fixed by theta, lam)
    worst = max(math.log1p(float(lam.max()) * (1 - theta)), -math.log1p(-float(lam.max()) * theta), 1e-12)
    span = max(1, int(600 // worst))
    log_m = np.empty(x.shape)
    for lo in range(0, x.shape[-1], span):
        log_f = np.log1p(lam * (x[..., lo : lo + span, None] - theta))  # (..., L, m)
        cum = np.cumsum(log_f, axis=-2)
        # A_t = exp(cum_t) (A_0 + sum_{s <= t} w_s exp(-cum_{s-1})), and exp(-cum_{s-1}) = exp(log_f_s - cum_s)
        joined = np.cumsum(np.exp(log_w[lo : lo + span, None] + log_f - cum), axis=-2)
        with np.errstate(divide="ignore"):
            log_at = cum + np.logaddexp(log_a[..., None, :], np.log(joined))  # (..., L, m)
        top = np.max(log_at, axis=-1)
        top = np.where(np.isfinite(top), top, 0.0)
        log_sum = top + np.log(np.exp(log_at - top[..., None]).sum(axis=-1))
        log_m[..., lo : lo + span] = np.logaddexp(log_sum, log_reserve[lo : lo + span])
        log_a = log_at[..., -1, :]
    return log_m, log_a


@dataclass
class HarmfulShiftAlarm:
    """Any-time test of "the labelled answers' risk is at most ``source_upper + tolerance``" (module docstring).

    ``source_upper``: an upper confidence bound on the source risk at level ``delta_source`` (:meth:`from_errors`);
    ``delta_test``: the test's false-alarm probability (in all ``delta_source + delta_test``); ``bets``: how many bet
    sizes; ``block``: labels per block of change times. The rest is the test's state since the last reset: labels,
    summed loss, each bet's log capital (None: 0, before the first label), the log statistic now and at its highest,
    and the label at which the alarm fired.
    """

    source_upper: float
    tolerance: float = 0.02
    delta_test: float = 0.025
    bets: int = 6
    block: int = 50
    labelled: int = 0
    loss_sum: float = 0.0
    log_capital: list[float | None] = field(default_factory=list)
    log_statistic: float = 0.0
    log_statistic_max: float = 0.0
    alarm_at: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.source_upper <= 1 or not 0 <= self.tolerance < 1:
            raise ValueError(
                f"need source_upper in [0, 1] and tolerance in [0, 1), got {self.source_upper}, {self.tolerance}"
            )
        if int(self.bets) != self.bets or self.bets < 1 or int(self.block) != self.block or self.block < 1:
            raise ValueError(f"bets and block must be integers >= 1, got {self.bets!r} and {self.block!r}")
        self.delta_test = _level("delta_test", self.delta_test)
        self.log_capital = list(self.log_capital) or [None] * self.bets
        if len(self.log_capital) != self.bets:
            raise ValueError(f"{len(self.log_capital)} log capitals for {self.bets} bets")

    @classmethod
    def from_errors(cls, errors: int, n: int, tolerance: float = 0.02, delta: float = 0.05) -> HarmfulShiftAlarm:
        """The alarm for a source risk measured as ``errors`` in ``n`` calibration labels: ``delta`` split in halves,
        the Clopper-Pearson bound at ``delta / 2`` and the test at ``delta / 2``."""
        half = _level("delta", delta) / 2
        return cls(clopper_pearson_upper(errors, n, half), tolerance, half)

    @property
    def threshold(self) -> float:
        """``theta``: the risk above which the labelled answers count as harmed, ``source_upper + tolerance``."""
        return min(self.source_upper + self.tolerance, 1.0)

    @property
    def lambdas(self) -> np.ndarray:
        """The bet sizes ``(m,)``: half of the largest that a loss of 0 allows (``1 / theta``), then halved."""
        return 0.5 / max(self.threshold, 1e-12) * 2.0 ** -np.arange(self.bets)

    def reset(self) -> None:
        """Start a fresh test (a new model version, or after an alarm was dealt with): capital back to 1."""
        self.labelled, self.loss_sum, self.log_capital = 0, 0.0, [None] * self.bets
        self.log_statistic, self.log_statistic_max, self.alarm_at = 0.0, 0.0, None

    def update(self, losses: Array) -> None:
        """Apply labels: ``losses (B,)`` in ``[0, 1]`` (0/1 errors, or errors among accepted answers), in order."""
        x = np.asarray(losses, dtype=np.float64)
        if x.ndim != 1 or (x.size and not (np.all(x >= 0) and np.all(x <= 1))):  # also rejects NaN
            raise ValueError(f"losses must be (B,) numbers in [0, 1], got shape {x.shape}")
        if not x.size:
            return
        log_a = np.array([-np.inf if v is None else v for v in self.log_capital])
        log_m, log_a = shift_log_statistic(x, self.threshold, self.lambdas, log_a, self.labelled, self.block)
        hits = np.flatnonzero(log_m >= -math.log(self.delta_test))
        if self.alarm_at is None and hits.size:
            self.alarm_at = self.labelled + int(hits[0]) + 1
        self.labelled += int(x.size)
        self.loss_sum += float(x.sum())
        self.log_capital = [None if math.isinf(v) else float(v) for v in log_a]
        self.log_statistic = float(log_m[-1])
        self.log_statistic_max = max(self.log_statistic_max, float(log_m.max()))

    @property
    def alarm(self) -> bool:
        """Whether the statistic reached ``1 / delta_test`` since the last reset (the alarm stays on)."""
        return self.alarm_at is not None

    @property
    def risk(self) -> float | None:
        """The mean loss of the labels applied since the last reset (None before any)."""
        return self.loss_sum / self.labelled if self.labelled else None

    def to_state(self) -> dict[str, Any]:
        """The state as a plain dict of JSON values (:meth:`from_state` reads it back)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> HarmfulShiftAlarm:
        """An alarm back from :meth:`to_state`'s dict (keys and lengths checked)."""
        return _from_state(cls, state)


# ----------------------------------------------------------------------------- realised and estimated quality
@dataclass(frozen=True)
class Figure:
    """A proportion or an estimate: ``value`` with its interval ``[low, high]`` over ``n`` answers (None: n = 0);
    :class:`Quality` holds them and ``dataclasses.asdict`` makes plain JSON values of it."""

    value: float | None
    low: float | None
    high: float | None
    n: int


@dataclass
class Counts:
    """Sums over a set of answers, from which :func:`quality` computes every figure. Labelled answers: ``labelled``,
    how many were ``correct``, got a set (``with_set``) that ``covered`` the label, were ``accepted`` (and of those
    wrong: ``accepted_errors``), ``flagged`` OOD, labelled ``foreign`` (and of those flagged: ``flagged_foreign``);
    ``conf_sum`` and ``conf_var``: ``sum p`` and ``sum p (1 - p)`` of their top-label probabilities. All served
    answers, labelled or not: ``served``, ``served_sum``, ``served_var``, the same sums."""

    labelled: int = 0
    correct: int = 0
    with_set: int = 0
    covered: int = 0
    accepted: int = 0
    accepted_errors: int = 0
    flagged: int = 0
    foreign: int = 0
    flagged_foreign: int = 0
    conf_sum: float = 0.0
    conf_var: float = 0.0
    served: int = 0
    served_sum: float = 0.0
    served_var: float = 0.0

    def __iadd__(self, other: Counts) -> Counts:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclass(frozen=True)
class Quality:
    """The figures over one set of answers (:func:`quality`). ``estimated_accuracy``: label-free, over the served
    answers; ``estimated_on_labelled``: the same estimate over the labelled ones; ``estimate_error``: that estimate
    minus their realised ``accuracy``, with the interval it lies in if the probabilities are calibrated."""

    labelled: int
    served: int
    accuracy: Figure
    coverage: Figure
    accepted_error: Figure
    ood_precision: Figure
    ood_recall: Figure
    estimated_accuracy: Figure
    estimated_on_labelled: Figure
    estimate_error: Figure


def _proportion(k: int, n: int, level: float) -> Figure:
    if n == 0:
        return Figure(None, None, None, 0)
    low, high = wilson_interval(k, n, level)
    return Figure(k / n, low, high, n)


def estimate_figure(conf_sum: float, conf_var: float, n: int, level: float = 0.95) -> Figure:
    """The label-free accuracy of ``n`` answers from ``sum p`` and ``sum p (1 - p)`` of their top-label
    probabilities: ``mean p`` with the normal interval of the Poisson-binomial mean, clipped to ``[0, 1]``."""
    if n == 0:
        return Figure(None, None, None, 0)
    mean, half = conf_sum / n, _z(level) * math.sqrt(max(conf_var, 0.0)) / n
    return Figure(mean, max(0.0, mean - half), min(1.0, mean + half), n)


def quality(c: Counts, level: float = 0.95) -> Quality:
    """Every figure of :class:`Quality` from the sums ``c``; intervals at ``level`` (Wilson for proportions)."""
    error = Figure(None, None, None, 0)
    if c.labelled:  # the estimate minus the realised accuracy, with the estimate's (unclipped) half-width
        d, half = (c.conf_sum - c.correct) / c.labelled, _z(level) * math.sqrt(max(c.conf_var, 0.0)) / c.labelled
        error = Figure(d, d - half, d + half, c.labelled)
    return Quality(
        labelled=c.labelled,
        served=c.served,
        accuracy=_proportion(c.correct, c.labelled, level),
        coverage=_proportion(c.covered, c.with_set, level),
        accepted_error=_proportion(c.accepted_errors, c.accepted, level),
        ood_precision=_proportion(c.flagged_foreign, c.flagged, level),
        ood_recall=_proportion(c.flagged_foreign, c.foreign, level),
        estimated_accuracy=estimate_figure(c.served_sum, c.served_var, c.served, level),
        estimated_on_labelled=estimate_figure(c.conf_sum, c.conf_var, c.labelled, level),
        estimate_error=error,
    )


# one labelled answer in the window: these bits of an int, and its top-label probability beside it
_CORRECT, _WITH_SET, _COVERED, _ACCEPTED, _FLAGGED, _FOREIGN = 1, 2, 4, 8, 16, 32


def _label_counts(bits: np.ndarray, conf: np.ndarray) -> Counts:
    """:class:`Counts` of labelled answers from their bits ``(B,)`` and top-label probabilities ``(B,)``."""
    on = {b: (bits & b) != 0 for b in (_CORRECT, _WITH_SET, _COVERED, _ACCEPTED, _FLAGGED, _FOREIGN)}
    return Counts(
        labelled=int(bits.size),
        correct=int(on[_CORRECT].sum()),
        with_set=int(on[_WITH_SET].sum()),
        covered=int((on[_WITH_SET] & on[_COVERED]).sum()),
        accepted=int(on[_ACCEPTED].sum()),
        accepted_errors=int((on[_ACCEPTED] & ~on[_CORRECT]).sum()),
        flagged=int(on[_FLAGGED].sum()),
        foreign=int(on[_FOREIGN].sum()),
        flagged_foreign=int((on[_FLAGGED] & on[_FOREIGN]).sum()),
        conf_sum=float(conf.sum()),
        conf_var=float((conf * (1 - conf)).sum()),
    )


def _served_counts(conf: np.ndarray) -> Counts:
    return Counts(served=int(conf.size), served_sum=float(conf.sum()), served_var=float((conf * (1 - conf)).sum()))


def _conf(name: str, values: Array) -> np.ndarray:
    p = np.asarray(values, dtype=np.float64)
    if p.ndim != 1 or (p.size and not (np.all(p >= 0) and np.all(p <= 1))):
        raise ValueError(f"{name} must be (B,) probabilities in [0, 1], got shape {p.shape}")
    return p


def _flag(name: str, values: Array | None, size: int) -> np.ndarray:
    if values is None:
        return np.zeros(size, dtype=bool)
    f = np.asarray(values)
    if f.shape != (size,) or (f.size and not np.isin(f, (0, 1)).all()):
        raise ValueError(f"{name} must be (B,) = ({size},) of 0/1 or bool, got shape {f.shape}")
    return f.astype(bool)


class QualityWindow:
    """Realised and label-free figures over the last ``window`` answers and over all of them (module docstring).

    :meth:`served` takes every served answer's top-label probability (the label-free estimate); :meth:`labelled`
    takes the answers whose labels came back; :meth:`window` and :meth:`overall` give the figures.
    """

    def __init__(self, window: int = 1000, level: float = 0.95) -> None:
        if int(window) != window or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.size, self.level = int(window), _level("level", level)
        self._served: deque[float] = deque(maxlen=self.size)
        self._bits: deque[int] = deque(maxlen=self.size)
        self._conf: deque[float] = deque(maxlen=self.size)
        self.totals = Counts()

    def served(self, confidence: Array) -> None:
        """Record served answers: their top-label probabilities ``(B,)``, labelled or not."""
        p = _conf("confidence", confidence)
        self._served.extend(p.tolist())
        self.totals += _served_counts(p)

    def labelled(
        self,
        correct: Array,
        confidence: Array,
        flagged: Array,
        foreign: Array,
        covered: Array | None = None,
        accepted: Array | None = None,
    ) -> None:
        """Record labelled answers, each ``(B,)``: whether the top label was ``correct`` (a foreign input never is),
        its probability, the OOD ``flag``, whether the label was ``foreign`` (outside the model's labels), whether
        the served set ``covered`` it (None: no set was served) and whether the risk rule ``accepted`` the answer."""
        p = _conf("confidence", confidence)
        n = p.size
        bits = (
            _flag("correct", correct, n) * _CORRECT
            + (covered is not None) * _WITH_SET
            + _flag("covered", covered, n) * _COVERED
            + _flag("accepted", accepted, n) * _ACCEPTED
            + _flag("flagged", flagged, n) * _FLAGGED
            + _flag("foreign", foreign, n) * _FOREIGN
        ).astype(np.int64)
        self._bits.extend(bits.tolist())
        self._conf.extend(p.tolist())
        self.totals += _label_counts(bits, p)

    def window(self) -> Quality:
        """The figures over the last ``window`` labelled answers (and the last ``window`` served ones)."""
        c = _label_counts(np.asarray(self._bits, dtype=np.int64), np.asarray(self._conf, dtype=np.float64))
        c += _served_counts(np.asarray(self._served, dtype=np.float64))
        return quality(c, self.level)

    def overall(self) -> Quality:
        """The figures over every answer recorded."""
        return quality(self.totals, self.level)

    def to_state(self) -> dict[str, Any]:
        """The state as a plain dict: the window's answers, oldest first, and the totals."""
        return {
            "window": self.size,
            "level": self.level,
            "served": list(self._served),
            "bits": list(self._bits),
            "confidence": list(self._conf),
            "totals": asdict(self.totals),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> QualityWindow:
        """A window back from :meth:`to_state`'s dict (keys and lengths checked)."""
        _require("QualityWindow", state, ("window", "level", "served", "bits", "confidence", "totals"))
        out = cls(state["window"], state["level"])
        if len(state["bits"]) != len(state["confidence"]) or max(len(state["bits"]), len(state["served"])) > out.size:
            raise ValueError(f"QualityWindow state holds more answers than its window of {out.size}, or unpaired ones")
        out._served.extend(float(v) for v in state["served"])
        out._bits.extend(int(v) for v in state["bits"])
        out._conf.extend(float(v) for v in state["confidence"])
        out.totals = _from_state(Counts, state["totals"])
        return out
