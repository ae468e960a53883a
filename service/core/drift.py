"""The drift alarm: a mixture of CUSUM e-detectors over the served inputs' OOD scores, on while traffic has changed,
off again once it is back to normal.

**What it answers.** Is the traffic *now* still like the calibration split, the data every guarantee of the server
was calibrated on? It reports a sustained change, not a burst: a handful of odd inputs is what the per-request OOD
flag is for. Scores are outlier-oriented (higher = more OOD; negate MSP-like scores first).

**Bets.** Each served score ``s`` gets the served conformal p-value against the calibration scores,
``p = (1 + #{cal >= s}) / (n + 1)``, and ``J`` bets on it, one per component of :data:`COMPONENTS`. Component ``j``
stakes a fraction ``lambda_j`` of its capital in equal shares on small p-values at its levels ``c_l``::

    e_j(s) = 1 - lambda_j + (lambda_j / L_j) * sum_{l in j} [p <= c_l] / u_l

``p <= c_l`` is the event ``s > tau_l``, with ``tau_l`` the ``(m_l + 1)``-th largest calibration score and
``m_l = floor(c_l (n + 1)) - 1``, so a bet is a comparison with a fixed threshold: O(L J) work per input. ``u_l`` is
an upper bound of the event's probability: given the split, ``P(s > tau_l)`` is at most ``1 - U`` with ``U`` the
matching order statistic of ``n`` uniforms (exactly so for continuous scores; ties only lower it), and
``1 - U ~ Beta(m_l + 1, n - m_l)``: ``u_l`` is that law's ``1 - delta / L`` quantile (Bonferroni over the ``L``
distinct levels), the Clopper-Pearson upper bound for ``m_l`` of ``n`` (:func:`clopper_pearson_upper`). So with
probability at least ``1 - delta`` over the draw of the split, every bet of every component pays at most fair odds:
``E[e_j(s) | split] <= 1`` for traffic like the calibration data.

The components (:data:`COMPONENTS`): the previous alarm's one bet (levels 0.05, 0.1, 0.2, stake 0.25) at weight
3/10, and single-level bets at 0.02, 0.05 and 0.2 with stakes 0.25, 0.5 and 0.9 sharing the rest. A shift that puts
most inputs far out wins fastest on a high stake; a mild one on a low stake, which loses little per ID input. Every
stake is cut so that no input multiplies a component by more than :data:`MAX_PAYOFF` (10^0.8): five foreign inputs
from a quiet state lift the mixture to at most 10^4, a tenth of ``A``. The mixture was chosen by
``benchmarks/alarm_grid.py`` on synthetic shifts only (results/alarm_grid.md): mean delay 2.15 times Lorden's bound
(median over the shifts whose bound is at most 50 inputs) against 2.84 for the previous bet alone, clearing after a
long shift in 128 inputs against 116.

Why not p-values against a bag that grows with the stream (Vovk et al. 2003)? The bag absorbs a sustained drift, so
the alarm clears while it goes on; the fixed split never moves, at the price of the split's condition above.

**The statistic** is a mixture of CUSUM e-detectors (Shin, Ramdas & Rinaldo 2022, "E-detectors: a nonparametric
framework for sequential change detection"), the e-value analogue of Page's CUSUM, one per component::

    C^j_t = min(max(C^j_{t-1}, 1) * e_j(s_t), cap),    C^j_0 = 1,    C_t = sum_j w_j C^j_t

``C^j_t`` (without the cap) is the largest product of component ``j``'s bets over the inputs since any start: the
best evidence a change that began at some input would have gathered. The first input of that product is the
component's change point; when the alarm goes on, the episode's ``changed_at`` is the change point of the component
that contributes most to ``C_t`` (where the shift is estimated to have begun: the recall, ``service.runtime``, lists
the answers given from there to the alarm).

**The alarm** goes on when ``C_t >= A`` and off when ``C_t < 1`` (hysteresis). The cap ``cap = 100 A`` per component
bounds what a drift of any length leaves behind, so the alarm clears within a few hundred ID inputs of its end
however long it lasted. ``A = HORIZON / delta`` with ``HORIZON = 1,000``: ``A = 10^5`` at the default ``delta =
0.01``.

**Guarantee.** Suppose the served scores are i.i.d. from the calibration data's distribution (more generally:
calibration split and traffic exchangeable). What is random: the draw of the calibration split and of the traffic;
the procedure itself is deterministic. With probability at least ``1 - delta`` over the split (the event that every
``u_l`` bounds its bet's probability), given the split:

* the mean number of inputs from a start (start-up or a reset) to the next alarm is at least ``A``, and from a clear
  at least ``A - 1`` (each component's ``C^j_t`` is at most its Shiryaev-Roberts statistic
  ``R^j_t = (R^j_{t-1} + 1) e_j``, so ``C_t <= sum_j w_j R^j_t =: R_t``, and ``R_t - t`` is a supermartingale
  because every ``E[e_j] <= 1``: optional stopping at the first time ``R_t >= A`` bounds its mean below by
  ``A - R_0``, with ``R_0 = 1`` at a start and ``R_0 < 1`` at a clear);
* the chance of an alarm within the first ``m`` inputs after a start or reset is at most ``m / A``, and after a
  clear at most ``(m + 1) / A`` (Ville's inequality on the weighted sums of the ``m`` bet products started at inputs
  ``1..m``, plus what the clear left, a nonnegative supermartingale that dominates ``C``): at most ``delta`` within
  the first 1,000 inputs;
* hence over a long in-distribution stream the alarm starts at most about one episode per ``A`` inputs.

Unconditionally (the split's draw included) the chance of an alarm within the first ``m`` inputs is at most
``delta + m / A``. Under the null the alarm does fire in the end, as any procedure that can fire again after it
clears must: the guarantee is a rate, not a probability over the whole stream. The bound is the same for every
mixture of bets that each pay at most fair odds: choosing the mixture (on synthetic shifts) spends no error.

Measured (``tests/service/core/test_drift.py``, ``tests/service/test_guarantees_simulation.py``):

* the bound's tightest case (a mixture of bets at exactly fair odds on i.i.d. uniform p-values, stakes up to 0.9):
  mean run length at least ``A`` at ``A`` = 10 and 40, and the early-alarm rate within ``(m + 1) / A``;
* false alarms at the defaults: at most 2 of 200 streams of 10,000 uniform scores (a fresh split each; the bound:
  11 %), and of 100 streams of 10,000 ID inputs per default model with a fresh draw of the split;
* a burst of 5 inputs above every calibration score: from a quiet state never; inside ID traffic, where the mixture
  sits up to a decade above its floor at times, 9 of 1,000 positions (the per-request flag catches such inputs);
* the change point: within 10 inputs of the true start in at least 80 of 100 runs of a 60 % switch.

**Memory and history.** The state is the L thresholds and bounds, the statistic, and the last ``history`` (20) alarm
episodes (:class:`DriftEpisode`: the input it started at, the input it cleared at, its peak, what cleared it), with
the total number of episodes: O(L + history) whatever the traffic.

**Reset and restart.** :meth:`DriftMonitor.reset` restarts the statistic at 1 (a fresh procedure, with the same
guarantee from then on) and closes an open episode (``cleared_by: "reset"``); the input count and the history go
on. A restart of the server starts all over, history included: it lives in memory.

**Replicas and workers.** The workers of one server share one state (:mod:`service.core.drift_shared`): one alarm
over all their traffic, with the bound above. Each replica (pod) watches its own traffic (a substream of i.i.d.
traffic is i.i.d.) with the same thresholds; with ``R`` replicas the fleet starts at most ``R`` false episodes per
``A`` inputs of each replica.

**Concurrency.** :meth:`DriftMonitor.update`, :meth:`DriftMonitor.reset` and :meth:`DriftMonitor.state` hold a
lock: concurrent callers are serialised.

**Feeding it from the request path.** A call has a fixed cost however few scores it gets (a lock and a few numpy
calls), which a batch-1 answer should not pay each time. The server therefore feeds the monitor through a
:class:`DriftFeed`: served scores are appended to a buffer in arrival order, and the monitor advances over the buffer
once ``every`` (64) inputs have gathered, once ``max_delay_s`` (1 s) has passed since it last advanced, and whenever
the state is read (the drift route, the model list, a ``/metrics`` scrape) or reset. Order and content are
unchanged, so the statistic is exactly that of feeding every score at once, and what a reader sees is the state of
every input served.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.core.selective import binomial_cdf

__all__ = [
    "BURST",
    "COMPONENTS",
    "HISTORY",
    "MAX_PAYOFF",
    "HORIZON",
    "LEVELS",
    "STAKE",
    "DriftEpisode",
    "DriftFeed",
    "DriftMonitor",
    "TailBets",
    "alarm_paths",
    "clopper_pearson_upper",
    "log_mix",
]

LEVELS = (0.05, 0.1, 0.2)  # p-value levels bet on: a sustained excess of small p-values, not single extreme ones
STAKE = 0.25  # fraction of the capital staked per input: e_max = 3.0 at n = 1,000, so 5 foreign inputs give <= 3^5
# the most one input may multiply a component's statistic by: 5 foreign inputs in a row reach at most
# MAX_PAYOFF^5 = 10^4 < A = 10^5 (a burst is the per-request flag's to catch, not the alarm's)
MAX_PAYOFF = 10**0.8
BURST = 5
# the bets' mixture, (levels, stake, weight) per component: the previous single bet at 3/10, and a single-level bet
# per (level, stake) of the grid below sharing the rest. Chosen on synthetic shifts by benchmarks/alarm_grid.py
# (results/alarm_grid.md: the smallest median delay / Lorden's bound of its candidates; no test stream read)
MIX_LEVELS = (0.02, 0.05, 0.2)
MIX_STAKES = (0.25, 0.5, 0.9)
COMPONENTS: tuple[tuple[Any, ...], ...] = ((LEVELS, STAKE, 0.3),) + tuple(
    ((c,), st, 0.7 / (len(MIX_LEVELS) * len(MIX_STAKES))) for c in MIX_LEVELS for st in MIX_STAKES
)
HORIZON = 1_000  # A = HORIZON / delta: the chance of a false alarm within HORIZON inputs of a start is <= delta
CAP_DECADES = 2.0  # the statistic is capped at 10^CAP_DECADES * A: an episode's peak reads up to there
HISTORY = 20  # alarm episodes kept
_LN10 = math.log(10)


def clopper_pearson_upper(k: int, n: int, level: float) -> float:
    """The ``1 - level`` quantile of ``Beta(k + 1, n - k)``: the Clopper-Pearson upper bound for ``k`` successes in
    ``n`` trials, i.e. the ``x`` with ``P(Binom(n, x) <= k) = level`` (bisection; ``0 <= k < n``)."""
    if not 0 <= k < n:
        raise ValueError(f"need 0 <= k < n, got k={k}, n={n}")
    lo, hi = k / n, 1.0  # P(Binom(n, x) <= k) falls from >= 1/2-ish at x = k/n to 0 at x = 1
    for _ in range(60):  # 2^-60: below float resolution of the bound
        mid = 0.5 * (lo + hi)
        if float(binomial_cdf(k, n, mid)) > level:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class TailBets:
    """The bets on each served score: ``J`` components, each a tail bet on the score's conformal p-value against the
    calibration scores (module docstring). ``thresholds (L,)``: ``p <= levels[l]`` iff ``score > thresholds[l]``;
    ``upper (L,)``: the bound ``u_l`` of that event's probability given the split (probability ``1 - delta`` over
    the split, all L at once); component ``j`` stakes ``stakes[j]`` in equal shares on the levels ``members[j]``
    (indices into ``levels``) and has the weight ``weights[j]`` in the mixture (the weights sum to 1)."""

    levels: tuple[float, ...]
    thresholds: np.ndarray
    upper: np.ndarray
    stakes: tuple[float, ...]
    members: tuple[tuple[int, ...], ...]
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.weights:  # equal weights
            object.__setattr__(self, "weights", tuple(1.0 / len(self.stakes) for _ in self.stakes))
        if len(self.weights) != len(self.stakes) or abs(sum(self.weights) - 1.0) > 1e-9:
            raise ValueError(f"weights {self.weights!r} must be one per component and sum to 1")

    @property
    def log_weights(self) -> np.ndarray:
        """``log w_j`` ``(J,)``."""
        return np.log(np.asarray(self.weights))

    @classmethod
    def fit(
        cls,
        calibration_scores: np.ndarray | torch.Tensor | Sequence[float],
        delta: float,
        components: Sequence[tuple[Any, ...]] = COMPONENTS,
        max_payoff: float = MAX_PAYOFF,
    ) -> TailBets:
        """The bets of a calibration split ``(n,)`` for ``components`` (each: its levels, its stake and optionally its
        weight, default 1; the weights are normalised to sum to 1). A level with no calibration score to bet against
        (``c (n + 1) < 1``) is left out of every component, and a component left with none is dropped; at least one
        must remain. The bounds ``u_l`` are Bonferroni over the distinct levels. A component's stake is lowered, where
        needed, so that the most outlying input multiplies its statistic by at most ``max_payoff``."""
        cal = np.sort(np.asarray(calibration_scores, dtype=np.float64).ravel())[::-1]  # (n,) descending
        if not np.all(np.isfinite(cal)):
            raise ValueError("calibration_scores must be finite")
        if not 0 < float(delta) < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if not components:
            raise ValueError("components must not be empty")
        if not max_payoff > 1:
            raise ValueError(f"max_payoff must be > 1, got {max_payoff!r}")
        comps = [(sorted(float(x) for x in c[0]), float(c[1])) for c in components]
        weight = [float(c[2]) if len(c) > 2 else 1.0 for c in components]
        if not all(x > 0 and math.isfinite(x) for x in weight):
            raise ValueError(f"component weights must be finite and > 0, got {weight!r}")
        for lv, st in comps:
            if not 0 < st < 1:
                raise ValueError(f"stake must be in (0, 1), got {st!r}")
            if not lv or not all(0 < x < 1 for x in lv):
                raise ValueError(f"levels must be a non-empty list of numbers in (0, 1), got {lv!r}")
        n = cal.size
        c = sorted({x for lv, _ in comps for x in lv})
        m = {x: math.floor(x * (n + 1)) - 1 for x in c}  # p <= c  <=>  #{cal >= s} <= m
        kept = [x for x in c if m[x] >= 0]
        used = [
            (tuple(kept.index(x) for x in lv if x in kept), st, wt) for (lv, st), wt in zip(comps, weight, strict=True)
        ]
        used = [u for u in used if u[0]]
        if not used:
            raise ValueError(
                f"{n} calibration scores are too few to bet at any of the levels {c} (need c (n + 1) >= 1)"
            )
        live = sorted({i for ix, _, _ in used for i in ix})  # the levels some component bets on
        remap = {old: new for new, old in enumerate(live)}
        share = float(delta) / len(live)  # Bonferroni over the levels: every bound holds at once w.p. 1 - delta
        upper = np.array([clopper_pearson_upper(m[kept[i]], n, share) for i in live])
        members = [(tuple(remap[i] for i in ix), st, wt) for ix, st, wt in used]
        merged = _cut_stakes(members, upper, max_payoff)
        total = sum(merged.values())
        return cls(
            levels=tuple(kept[i] for i in live),
            thresholds=np.array([cal[m[kept[i]]] for i in live]),
            upper=upper,
            stakes=tuple(st for _, st in merged),
            members=tuple(ix for ix, _ in merged),
            weights=tuple(wt / total for wt in merged.values()),
        )

    @property
    def pay(self) -> np.ndarray:
        """``(L, J)``: what a hit at level ``l`` adds to component ``j``'s payoff, ``1 / (u_l |members_j|)``."""
        out = np.zeros((len(self.levels), len(self.stakes)))
        for j, ix in enumerate(self.members):
            for i in ix:
                out[i, j] = 1.0 / (float(self.upper[i]) * len(ix))
        return out

    def log_e(self, scores: np.ndarray) -> np.ndarray:
        """``log e_j(s)`` of outlier scores ``(...)`` -> ``(..., J)``."""
        hit = np.asarray(scores, dtype=np.float64)[..., None] > self.thresholds  # (..., L)
        stakes = np.asarray(self.stakes)
        return np.log1p(stakes * (hit.astype(np.float64) @ self.pay - 1.0))  # (..., J)

    def log_e_list(self, scores: Sequence[float]) -> list[list[float]]:
        """:meth:`log_e` of a few outlier scores in plain Python (a request's: numpy's fixed cost per call is larger
        than the work): one list of ``J`` per score, the same numbers up to round-off."""
        pay = self.pay.tolist()
        thresholds = self.thresholds.tolist()
        stakes = self.stakes
        out = []
        for s in scores:
            total = [0.0] * len(stakes)
            for t, row in zip(thresholds, pay, strict=True):
                if s > t:
                    total = [a + b for a, b in zip(total, row, strict=True)]
            out.append([math.log1p(st * (v - 1.0)) for st, v in zip(stakes, total, strict=True)])
        return out

    @property
    def max_log_e(self) -> np.ndarray:
        """``log e_max`` per component ``(J,)``: what the most outlying input multiplies each statistic by."""
        return np.log1p(np.asarray(self.stakes) * (self.pay.sum(axis=0) - 1.0))


def _cut_stakes(
    components: list[tuple[tuple[int, ...], float, float]], upper: np.ndarray, max_payoff: float
) -> dict[tuple[tuple[int, ...], float], float]:
    """Each component ``(levels, stake, weight)`` with its stake cut so that no input pays more than ``max_payoff``
    (it depends on ``n`` through ``upper``, never on the split's values); components made equal by the cut become
    one, their weights summed: ``{(levels, stake): weight}``."""
    merged: dict[tuple[tuple[int, ...], float], float] = {}
    for ix, st, wt in components:
        top = float(np.mean(1.0 / upper[list(ix)]))  # the payoff when every level of the component is hit
        cut = min(st, (max_payoff - 1.0) / (top - 1.0)) if top > 1.0 else st
        merged[(ix, cut)] = merged.get((ix, cut), 0.0) + wt
    return merged


def log_mix(w: np.ndarray, log_weights: np.ndarray) -> np.ndarray:
    """``log sum_j w_j exp(W_j)`` over the last axis: the mixture's log statistic from its components'
    ``W (..., J)``."""
    return np.logaddexp.reduce(w + log_weights, axis=-1)


def _log_mix(w: list[float], lw: list[float]) -> float:
    """:func:`log_mix` of one state in plain Python."""
    z = [a + b for a, b in zip(w, lw, strict=True)]
    top = max(z)
    return top + math.log(sum(math.exp(v - top) for v in z))


def alarm_paths(
    log_e: np.ndarray, log_a: float, log_cap: float, log_weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The procedure on many independent streams at once (simulation): ``log e (S, T, J)`` (or ``(S, T)``: one
    component) -> ``(log C_t (S, T), alarm on after input t (S, T) bool)``, each stream from a fresh start. ``C_t``
    is the components' weighted mean (``log_weights (J,)``, default equal); each component is capped at ``log_cap``
    (so is the mean)."""
    x = np.asarray(log_e, dtype=np.float64)
    if x.ndim == 2:
        x = x[..., None]
    j = x.shape[-1]
    lw = np.full(j, -math.log(j)) if log_weights is None else np.asarray(log_weights, dtype=np.float64)
    w = np.zeros(x.shape[:-2] + (j,))
    on = np.zeros(x.shape[:-2], dtype=bool)
    log_c, alarm = np.empty(x.shape[:-1]), np.empty(x.shape[:-1], dtype=bool)
    for t in range(x.shape[-2]):
        w = np.minimum(np.maximum(w, 0.0) + x[..., t, :], log_cap)
        mix = log_mix(w, lw)
        on = np.where(on, mix >= 0.0, mix >= log_a)  # on at A, off below 1
        log_c[..., t], alarm[..., t] = mix, on
    return log_c, alarm


@dataclass
class DriftEpisode:
    """One alarm episode: on at input ``started_at`` (1 = the first input since start-up), off at ``cleared_at``
    (None while on), the largest ``log10 C_t`` in between (at most ``log10 A + CAP_DECADES``). ``changed_at``: where
    the shift is estimated to have begun, the first input of the run of the component that leads the mixture when
    the alarm goes on (the CUSUM change point: the start ``j`` of its largest product since any start)."""

    started_at: int
    peak_log10: float
    cleared_at: int | None = None
    cleared_by: str | None = None  # "traffic" (the statistic fell below 1) or "reset"
    changed_at: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "changed_at": self.changed_at,
            "cleared_at": self.cleared_at,
            "peak_log10_statistic": self.peak_log10,
            "cleared_by": self.cleared_by,
        }


class DriftMonitor:
    """The drift alarm of one model (module docstring): on while ``C_t >= A`` was reached and ``C_t >= 1`` since.

    Args:
        calibration_scores: ``(n,)`` ID outlier scores (higher = more OOD) of the calibration split.
        delta: the split's failure probability of the guarantee; also sets ``A = HORIZON / delta``.
        arl: the alarm level ``A`` (the mean run length to a false alarm is at least this), default
            ``HORIZON / delta``.
        components: the bets' components, each its levels and stake (:class:`TailBets`).
        history: alarm episodes kept.

    Thread-safe: :meth:`update`, :meth:`reset` and :meth:`state` take a lock; ``delta``, ``arl`` and
    ``log10_threshold`` are fixed at construction.
    """

    def __init__(
        self,
        calibration_scores: np.ndarray | torch.Tensor | Sequence[float],
        delta: float = 0.01,
        *,
        arl: float | None = None,
        components: Sequence[tuple[Any, ...]] = COMPONENTS,
        history: int = HISTORY,
    ) -> None:
        self.bets = TailBets.fit(calibration_scores, delta, components)
        a = HORIZON / float(delta) if arl is None else float(arl)
        if not a > 1 or not math.isfinite(a):
            raise ValueError(f"arl must be a finite number > 1, got {arl!r}")
        if int(history) != history or history < 1:
            raise ValueError(f"history must be an integer >= 1, got {history!r}")
        self.delta = float(delta)
        self.arl = a  # A, also the least mean number of ID inputs from a start or clear to a false alarm
        self._j = len(self.bets.stakes)
        self._log_a = math.log(a)
        self._lw = self.bets.log_weights.tolist()  # log w_j
        self._log_cap = self._log_a + CAP_DECADES * math.log(10)
        self.log10_threshold = self._log_a / _LN10  # the alarm goes on when log10 C_t reaches it
        self._lock = threading.Lock()
        self._w = [0.0] * self._j  # log C_t of each component
        self._from = [1] * self._j  # the first input of each component's current run
        self._count = 0
        self._episodes: deque[DriftEpisode] = deque(maxlen=int(history))
        self._open: DriftEpisode | None = None
        self._total = 0

    def update(self, scores: np.ndarray | torch.Tensor | Sequence[float]) -> None:
        """Feed a batch of outlier scores ``(B,)``, in order: the statistic, the alarm and its episodes advance."""
        if isinstance(scores, list) and len(scores) <= 16:  # a request's few scores: plain Python
            if any(v != v for v in scores):
                raise ValueError("scores must not be NaN")
            x = self.bets.log_e_list(scores)
        else:
            s = np.asarray(scores, dtype=np.float64).ravel()
            if np.isnan(s).any():
                raise ValueError("scores must not be NaN")
            x = self.bets.log_e(s).tolist()
        with self._lock:
            w, start, ep, t = list(self._w), list(self._from), self._open, self._count
            log_a, lw = self._log_a, self._lw
            cap = self._log_cap
            js = range(self._j)
            for xi in x:  # plain loops over floats: cheaper than numpy for the feed's chunks of ~64 and J ~ 10
                t += 1
                for j in js:
                    if w[j] <= 0.0:
                        w[j], start[j] = 0.0, t  # a fresh run from this input
                    w[j] = min(w[j] + xi[j], cap)
                mix = _log_mix(w, lw)
                if ep is not None:
                    if mix < 0.0:
                        ep.cleared_at, ep.cleared_by, ep = t, "traffic", None
                    elif mix > ep.peak_log10 * _LN10:
                        ep.peak_log10 = mix / _LN10
                elif mix >= log_a:
                    lead = max(js, key=lambda k: w[k] + lw[k])  # the component that contributes most
                    ep = self._start(t, mix, start[lead])
            self._w, self._from, self._open, self._count = w, start, ep, t

    def _start(self, t: int, w: float, changed_at: int) -> DriftEpisode:
        ep = DriftEpisode(started_at=t, peak_log10=w / _LN10, changed_at=changed_at)
        self._episodes.append(ep)
        self._total += 1
        return ep

    def reset(self) -> None:
        """Restart the statistic at 1 (a fresh procedure); an open episode closes (``cleared_by: "reset"``)."""
        with self._lock:
            self._w = [0.0] * self._j
            self._from = [self._count + 1] * self._j
            if self._open is not None:
                self._open.cleared_at, self._open.cleared_by = self._count, "reset"
                self._open = None

    def state(self) -> dict[str, Any]:
        """The alarm now: ``alarm``, ``log10_statistic``, ``log10_threshold`` (``log10 A``), ``inputs``, ``alarm_at``
        (the input the open episode started at, None while off), ``delta``, ``arl`` (``A``), ``episodes`` (started
        since start-up) and ``history`` (the last episodes, oldest first)."""
        with self._lock:
            return {
                "alarm": self.alarm,
                "log10_statistic": self.log10_statistic,
                "log10_threshold": self.log10_threshold,
                "inputs": self.count,
                "alarm_at": self.alarm_at,
                "delta": self.delta,
                "arl": self.arl,
                "episodes": self.episodes_total,
                "history": [e.as_dict() for e in self._episodes],
            }

    def simulate(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This alarm's procedure, from a fresh start, on independent streams of outlier scores ``(S, T)``
        (simulation; the monitor's own state is untouched): ``(log10 C_t (S, T), alarm on after input t (S, T))``."""
        log_c, on = alarm_paths(self.bets.log_e(scores), self._log_a, self._log_cap, self.bets.log_weights)
        return log_c / _LN10, on

    @property
    def log10_statistic(self) -> float:
        """``log10 C_t``, the components' mean (0 at a start; the alarm goes on at ``log10 A``)."""
        if not any(self._w):  # every component at 1 (a start or reset): the mixture is 1 exactly
            return 0.0
        return _log_mix(self._w, self._lw) / _LN10

    @property
    def statistic(self) -> float:
        return 10.0**self.log10_statistic

    @property
    def alarm(self) -> bool:
        """True while an episode is open: ``C_t`` reached ``A`` and has not fallen below 1 since."""
        return self._open is not None

    @property
    def last_marks(self) -> tuple[int, int | None] | None:
        """``(started_at, changed_at)`` of the latest episode (None: none yet), read without the lock."""
        eps = self._episodes
        return (eps[-1].started_at, eps[-1].changed_at) if eps else None

    @property
    def alarm_at(self) -> int | None:
        """The input (counted since start-up, 1 = the first) at which the open episode started; None while off."""
        return None if self._open is None else self._open.started_at

    @property
    def count(self) -> int:
        """Inputs seen since start-up (a reset does not restart the count)."""
        return self._count

    @property
    def episodes_total(self) -> int:
        """Alarm episodes started since start-up."""
        return self._total

    @property
    def episodes_started_here(self) -> int:
        """Alarm episodes that this process's updates started: all of them, unless the state is shared by several
        processes (:class:`~service.core.drift_shared.SharedDriftMonitor`), whose episode counters are summed."""
        return self._total

    def sync(self) -> None:
        """Read the latest state (a state shared with other processes; nothing to do for one in memory)."""

    @property
    def episodes(self) -> list[DriftEpisode]:
        """The last ``history`` episodes, oldest first (copies)."""
        with self._lock:
            return [dataclasses.replace(e) for e in self._episodes]


class DriftFeed:
    """A :class:`DriftMonitor` fed from the request path: scores buffered, the monitor advanced in chunks.

    :meth:`add` appends a batch of outlier scores; the monitor advances over everything buffered once ``every``
    scores are waiting or ``max_delay_s`` has passed since it last advanced (checked at each :meth:`add`), and at
    every :meth:`flush` (call it before reading the monitor). ``on_update(monitor)`` runs after each advance (the
    server's drift metrics). :meth:`reset` advances over the buffer first (those inputs were served before it), then
    restarts the statistic. Not thread-safe by itself: the server calls it from its event loop only.
    """

    def __init__(
        self,
        monitor: DriftMonitor,
        every: int = 64,
        max_delay_s: float = 1.0,
        on_update: Callable[[DriftMonitor], None] | None = None,
    ) -> None:
        if every < 1 or max_delay_s < 0:
            raise ValueError(f"every must be >= 1 and max_delay_s >= 0, got {every!r}, {max_delay_s!r}")
        self.monitor = monitor
        self.every, self.max_delay_s, self.on_update = int(every), float(max_delay_s), on_update
        self._pending: list[float] = []
        self._unreported = False  # the monitor advanced since on_update last ran
        self._last = time.monotonic()

    @property
    def waiting(self) -> int:
        """Scores buffered, not yet in the monitor."""
        return len(self._pending)

    def add(self, scores: np.ndarray | Sequence[float]) -> None:
        """Buffer a batch of outlier scores ``(B,)``; advance the monitor if enough are waiting or time has passed."""
        s = np.asarray(scores, dtype=np.float64).ravel().tolist() if isinstance(scores, np.ndarray) else scores
        if any(v != v for v in s):
            raise ValueError("scores must not be NaN")
        self._pending.extend(float(v) for v in s)
        if len(self._pending) >= self.every or time.monotonic() - self._last >= self.max_delay_s:
            self.flush()

    def flush(self, notify: bool = True) -> DriftMonitor:
        """Advance the monitor over every buffered score (in arrival order); the monitor, up to date. ``on_update``
        runs when it advanced, unless ``notify`` is False (a request that only reads the alarm: the next notifying
        flush, a ``/metrics`` scrape's, reports every advance since)."""
        self._last = time.monotonic()
        if self._pending:
            batch, self._pending = self._pending, []
            self.monitor.update(batch)
            self._unreported = True
        else:
            self.monitor.sync()  # another worker's inputs may have advanced a shared state
        if notify and self._unreported and self.on_update is not None:
            self._unreported = False
            self.on_update(self.monitor)
        return self.monitor

    def reset(self) -> None:
        """The buffered inputs into the monitor, then the statistic restarted (:meth:`DriftMonitor.reset`)."""
        self.flush()
        self.monitor.reset()
        if self.on_update is not None:
            self.on_update(self.monitor)
