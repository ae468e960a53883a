"""The drift alarm: a CUSUM e-detector over the served inputs' OOD scores, on while traffic has changed, off again
once it is back to normal.

**What it answers.** Is the traffic *now* still like the calibration split, the data every guarantee of the server
was calibrated on? It reports a sustained change, not a burst: a handful of odd inputs is what the per-request OOD
flag is for. Scores are outlier-oriented (higher = more OOD; negate MSP-like scores first).

**Bets.** Each served score ``s`` gets the served conformal p-value against the calibration scores,
``p = (1 + #{cal >= s}) / (n + 1)``, and one bet on it: tail bets on small p-values at the levels ``c_l`` in
``levels`` = (0.05, 0.1, 0.2), a fraction ``stake`` (0.25) of the capital staked on them in equal shares::

    e(s) = 1 - stake + (stake / L) * sum_l [p <= c_l] / u_l

``p <= c_l`` is the event ``s > tau_l``, with ``tau_l`` the ``(m_l + 1)``-th largest calibration score and
``m_l = floor(c_l (n + 1)) - 1``, so a bet is a comparison with a fixed threshold: O(L) work and memory per input.
``u_l`` is an upper bound of the event's probability: given the split, ``P(s > tau_l)`` is at most ``1 - U``
with ``U`` the matching order statistic of ``n`` uniforms (exactly so for continuous scores; ties only lower it),
and ``1 - U ~ Beta(m_l + 1, n - m_l)``: ``u_l`` is that law's ``1 - delta / L`` quantile, the Clopper-Pearson upper
bound for ``m_l`` of ``n`` (:func:`clopper_pearson_upper`). So with probability at least ``1 - delta`` over the draw
of the split, every bet pays at most fair odds: ``E[e(s) | split] <= 1`` for traffic like the calibration data.

Why not the exchangeability test's conformal p-values against a bag that grows with the stream (Vovk et al.
2003; this module's previous version)? They are exactly i.i.d. uniform with no condition on the split, but the
reference then absorbs a sustained drift: once the drifted inputs are a fair share of the bag they look normal, and
a procedure that forgets old evidence (as this one must, to clear) clears while the drift goes on. In simulation
on the default models' outputs (a switch to 30 % held-out-class or far-OOD inputs after 2,000 ID inputs, with 1,000
calibration scores in the bag) it cleared during the switch in half or more of the runs within 3,000 drifted
inputs. Against the fixed calibration scores the reference never moves; the price is the split's condition above
and bets that pay ``1 / u_l`` instead of ``1 / c_l`` (``u_l`` = 0.071, 0.127, 0.235 at ``n = 1,000``,
``delta = 0.01``).

**The statistic** is the CUSUM e-detector of Shin, Ramdas & Rinaldo (2022, "E-detectors: a nonparametric framework
for sequential change detection"), the e-value analogue of Page's CUSUM::

    C_t = min(max(C_{t-1}, 1) * e_t, cap),    C_0 = 1

``C_t`` (without the cap) is the largest product of the bets over the inputs since any start ``j <= t``: the best
evidence a change that began at some ``j`` would have gathered. One foreign input multiplies it by at most
``e_max = 1 - stake + (stake / L) sum_l 1 / u_l`` (2.94 at ``n = 1,000``: five of them, 10^2.3, are far from
``A = 10^5``), and in-distribution inputs shrink it (the bets lose 0.14 nats per ID input on average at
``n = 1,000``), so a burst lifts it only briefly, while a sustained excess of small p-values makes it grow
geometrically.

**The alarm** goes on when ``C_t >= A`` and off when ``C_t < 1`` (hysteresis): at ``C_t < 1`` the next input starts
from ``max(C_t, 1) = 1``, exactly as a fresh procedure would, so "off" means that no evidence of a change is left.
The cap ``cap = 100 A`` bounds what a drift of any length leaves behind, so the alarm clears within a few hundred ID
inputs of its end however long it lasted (the peak of an episode is read up to the cap); being above ``A``, it
never changes when the alarm goes on. ``A = HORIZON / delta``
with ``HORIZON = 1,000``: ``A = 10^5`` at the default ``delta = 0.01``.

**Guarantee.** Suppose the served scores are i.i.d. from the calibration data's distribution (more generally:
calibration split and traffic exchangeable). What is random: the draw of the calibration split and of the traffic;
the procedure itself is deterministic. With probability at least ``1 - delta`` over the split (the event that every
``u_l`` bounds its bet's probability), given the split:

* the mean number of inputs from a start (start-up or a reset) or a clear to the next alarm is at least ``A``
  (Lorden-type bound on the average run length, via the Shiryaev-Roberts statistic ``R_t = (R_{t-1} + 1) e_t``:
  ``R_t - t`` is a supermartingale, and ``C_t <= R_t`` term by term, so the CUSUM alarms no earlier than the SR one,
  whose mean run length is at least ``A`` by optional stopping);
* the chance of an alarm within the first ``m`` inputs after a start, reset or clear is at most ``m / A`` (Ville's
  inequality on the sum of the ``m`` bet products started at inputs ``1..m``, a supermartingale from ``m`` that
  dominates ``R``): at most ``delta`` within the first 1,000 inputs;
* hence over a long in-distribution stream the alarm starts at most one episode per ``A`` inputs on average (each
  stretch from a clear to the next alarm is a fresh copy of the procedure: the bets are i.i.d. given the split).

Unconditionally (the split's draw included) the chance of an alarm within the first ``m`` inputs is at most
``delta + m / A``. Under the null the alarm does fire in the end, as any procedure that can fire again after it
clears must: the guarantee is a rate, not a probability over the whole stream.

Measured (``tests/service/core/test_drift.py``, ``tests/service/test_guarantees_simulation.py`` and the build
report rerun these on the default models' cached outputs):

* the bound's tightest case (bets at exactly fair odds, i.i.d. uniform p-values): mean run length 11 A and 14 A
  at ``A`` = 10 and 40, and 2 % of the runs alarmed within ``A / 2`` inputs (the bound: 50 %). The default bets pay
  less than fair odds on ID traffic (mean ``e`` 0.945 at nominal p-values): longer still;
* false alarms at the defaults: none in 200 streams of 10,000 uniform scores (a fresh split each), none in 100
  streams of 10,000 ID inputs per default model, with the served split or a fresh draw of it (the bound: 11 %);
* a burst of 5 inputs of any OOD test set inside ID traffic: fired in none of 100 streams per set;
* a switch to 30 % of an OOD test set's inputs (held-out classes, digits, noise, news; sets whose flag at
  ``ood_alpha`` 0.05 catches at least 30 %): alarm within 41-65 inputs (median by set), 119 at most (50 streams
  each); on until the switch ends; off 105 ID inputs after it (median), 276 at most. Uniform scores, 30 % drawn
  above the calibration 95th percentile (the weakest such shift): median 49, at most 139 (200 streams). A set the
  flag catches 25 % of (neutral tweets for a sentiment model) at 30 %: within 1,000 inputs in 21 of 50 streams.

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

from .selective import binomial_cdf

__all__ = [
    "HISTORY",
    "HORIZON",
    "LEVELS",
    "STAKE",
    "DriftEpisode",
    "DriftFeed",
    "DriftMonitor",
    "TailBets",
    "alarm_paths",
    "clopper_pearson_upper",
]

LEVELS = (0.05, 0.1, 0.2)  # p-value levels bet on: a sustained excess of small p-values, not single extreme ones
STAKE = 0.25  # fraction of the capital staked per input: e_max = 3.0 at n = 1,000, so 5 foreign inputs give <= 3^5
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
    """The bet on each served score: tail bets on its conformal p-value against the calibration scores (module
    docstring). ``thresholds (L,)``: ``p <= levels[l]`` iff ``score > thresholds[l]``; ``upper (L,)``: the bound
    ``u_l`` of that event's probability given the split (probability ``1 - delta`` over the split, all L at once)."""

    levels: tuple[float, ...]
    thresholds: np.ndarray
    upper: np.ndarray
    stake: float

    @classmethod
    def fit(
        cls,
        calibration_scores: np.ndarray | torch.Tensor | Sequence[float],
        delta: float,
        levels: Sequence[float] = LEVELS,
        stake: float = STAKE,
    ) -> TailBets:
        """The bets of a calibration split ``(n,)``: levels with no calibration score to bet against
        (``c (n + 1) < 1``) are left out; at least one must remain."""
        cal = np.sort(np.asarray(calibration_scores, dtype=np.float64).ravel())[::-1]  # (n,) descending
        if not np.all(np.isfinite(cal)):
            raise ValueError("calibration_scores must be finite")
        if not 0 < float(delta) < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if not 0 < float(stake) < 1:
            raise ValueError(f"stake must be in (0, 1), got {stake!r}")
        c = sorted(float(x) for x in levels)
        if not c or not all(0 < x < 1 for x in c):
            raise ValueError(f"levels must be a non-empty list of numbers in (0, 1), got {levels!r}")
        n = cal.size
        m = [math.floor(x * (n + 1)) - 1 for x in c]  # p <= c  <=>  #{cal >= s} <= m
        kept = [(x, k) for x, k in zip(c, m, strict=True) if k >= 0]
        if not kept:
            raise ValueError(
                f"{n} calibration scores are too few to bet at any of the levels {c} (need c (n + 1) >= 1)"
            )
        share = float(delta) / len(kept)  # Bonferroni over the levels: every bound holds at once w.p. 1 - delta
        return cls(
            levels=tuple(x for x, _ in kept),
            thresholds=np.array([cal[k] for _, k in kept]),
            upper=np.array([clopper_pearson_upper(k, n, share) for _, k in kept]),
            stake=float(stake),
        )

    def log_e(self, scores: np.ndarray) -> np.ndarray:
        """``log e(s)`` of outlier scores ``(...)`` -> ``(...)``."""
        hit = np.asarray(scores, dtype=np.float64)[..., None] > self.thresholds  # (..., L)
        pay = (hit / self.upper).sum(axis=-1)  # (...,)
        return np.log1p(self.stake * (pay / len(self.levels) - 1.0))

    def log_e_list(self, scores: Sequence[float]) -> list[float]:
        """:meth:`log_e` of a few outlier scores in plain Python (a request's: numpy's fixed cost per call is larger
        than the work); the same numbers, summed in the same order."""
        pairs = list(zip(self.thresholds.tolist(), (1.0 / self.upper).tolist(), strict=True))
        k, stake = len(self.levels), self.stake
        out = []
        for s in scores:
            pay = 0.0
            for t, w in pairs:
                pay += w if s > t else 0.0
            out.append(math.log1p(stake * (pay / k - 1.0)))
        return out

    @property
    def max_log_e(self) -> float:
        """``log e_max``: what the most outlying input multiplies the statistic by."""
        return math.log1p(self.stake * (float(np.mean(1.0 / self.upper)) - 1.0))


def alarm_paths(log_e: np.ndarray, log_a: float, log_cap: float) -> tuple[np.ndarray, np.ndarray]:
    """The procedure on many independent streams at once (simulation): ``log e (S, T)`` ->
    ``(log C_t (S, T), alarm on after input t (S, T) bool)``, each stream from a fresh start."""
    x = np.asarray(log_e, dtype=np.float64)
    w = np.zeros(x.shape[:-1])
    on = np.zeros(x.shape[:-1], dtype=bool)
    log_c, alarm = np.empty(x.shape), np.empty(x.shape, dtype=bool)
    for t in range(x.shape[-1]):
        w = np.minimum(np.maximum(w, 0.0) + x[..., t], log_cap)
        on = np.where(on, w >= 0.0, w >= log_a)  # on at A, off below 1
        log_c[..., t], alarm[..., t] = w, on
    return log_c, alarm


@dataclass
class DriftEpisode:
    """One alarm episode: on at input ``started_at`` (1 = the first input since start-up), off at ``cleared_at``
    (None while on), the largest ``log10 C_t`` in between (at most ``log10 A + CAP_DECADES``)."""

    started_at: int
    peak_log10: float
    cleared_at: int | None = None
    cleared_by: str | None = None  # "traffic" (the statistic fell below 1) or "reset"

    def as_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
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
        levels, stake: the bets (:class:`TailBets`).
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
        levels: Sequence[float] = LEVELS,
        stake: float = STAKE,
        history: int = HISTORY,
    ) -> None:
        self.bets = TailBets.fit(calibration_scores, delta, levels, stake)
        a = HORIZON / float(delta) if arl is None else float(arl)
        if not a > 1 or not math.isfinite(a):
            raise ValueError(f"arl must be a finite number > 1, got {arl!r}")
        if int(history) != history or history < 1:
            raise ValueError(f"history must be an integer >= 1, got {history!r}")
        self.delta = float(delta)
        self.arl = a  # A, also the least mean number of ID inputs from a start or clear to a false alarm
        self._log_a = math.log(a)
        self._log_cap = self._log_a + CAP_DECADES * math.log(10)
        self.log10_threshold = self._log_a / _LN10  # the alarm goes on when log10 C_t reaches it
        self._lock = threading.Lock()
        self._w = 0.0  # log C_t
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
            w, ep, t = self._w, self._open, self._count
            log_a, log_cap = self._log_a, self._log_cap
            for xi in x:  # a plain loop over floats: cheaper than numpy for the feed's chunks of ~64
                t += 1
                w = min(max(w, 0.0) + xi, log_cap)
                if ep is not None:
                    if w < 0.0:
                        ep.cleared_at, ep.cleared_by, ep = t, "traffic", None
                    elif w > ep.peak_log10 * _LN10:
                        ep.peak_log10 = w / _LN10
                elif w >= log_a:
                    ep = self._start(t, w)
            self._w, self._open, self._count = w, ep, t

    def _start(self, t: int, w: float) -> DriftEpisode:
        ep = DriftEpisode(started_at=t, peak_log10=w / _LN10)
        self._episodes.append(ep)
        self._total += 1
        return ep

    def reset(self) -> None:
        """Restart the statistic at 1 (a fresh procedure); an open episode closes (``cleared_by: "reset"``)."""
        with self._lock:
            self._w = 0.0
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
        log_c, on = alarm_paths(self.bets.log_e(scores), self._log_a, self._log_cap)
        return log_c / _LN10, on

    @property
    def log10_statistic(self) -> float:
        """``log10 C_t`` (0 at a start; the alarm goes on at ``log10 A`` and off below 0)."""
        return self._w / _LN10

    @property
    def statistic(self) -> float:
        return math.exp(self._w)

    @property
    def alarm(self) -> bool:
        """True while an episode is open: ``C_t`` reached ``A`` and has not fallen below 1 since."""
        return self._open is not None

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
