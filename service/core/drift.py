"""An anytime-valid drift alarm: a conformal test martingale over the stream of served inputs' OOD scores.

**What is tested.** The null hypothesis is that the model's calibration scores followed by the scores of the inputs
it serves form an exchangeable sequence (e.g. i.i.d. from one distribution): served traffic looks like the data the
thresholds were calibrated on. The alarm fires when the evidence against it reaches ``1 / delta``. Guarantee (Ville's
inequality): under the null, ``P(the alarm ever fires) <= delta``, over an unbounded stream and whenever anyone
looks; the probability is over the draw of the scores and of this monitor's own random numbers (below). Scores are
outlier-oriented (higher = more OOD; negate MSP-like scores first).

**P-values.** A p-value per input computed against one fixed calibration set is uniform, but the p-values of
different inputs share that set and are dependent, so their product is not a martingale and Ville's inequality
does not apply to it. Instead (Vovk, Nouretdinov & Gammerman 2003, "Testing exchangeability on-line"; Vovk,
Gammerman & Shafer 2005, ch. 7) the calibration scores are the first observations of the sequence and each new
score gets the *smoothed conformal p-value* against everything seen so far, itself included::

    p_t = (#{j <= t: s_j > s_t} + theta_t * #{j <= t: s_j == s_t}) / n_t,    theta_t ~ U(0, 1)

(``n_t`` observations so far). Under exchangeability of the whole sequence these p-values are *independent* and
exactly uniform on (0, 1) (Vovk et al.'s theorem; the smoothing ``theta_t`` is what makes them exact with ties), so
any betting strategy on them gives a test martingale. Small ``p_t``: an input more outlying than almost everything
seen.

**Bounded memory.** Keeping every score of a stream that runs for weeks is not an option. The scores are mapped by
a fixed non-decreasing quantisation into ``K`` bins (``bins``, default 2048) and only the per-bin counts are kept:
O(K) memory, O(K / 64 + 64) work per input. A fixed function of exchangeable observations is exchangeable, and the
smoothing handles the ties the binning creates, so the p-values of the binned scores are still exactly i.i.d.
uniform. "Fixed" matters: the bin edges must not depend on the scores they are applied to, so the calibration
scores are split once (seeded): ``min(n / 2, 4 K)`` of them set the edges (their quantiles at ``i / K``, equal-mass
bins) and the others form the initial bag; alternatively the caller passes ``edges`` computed on other data and
every calibration score goes to the bag. (Edges taken from the bag itself would make the bag's bins exactly
balanced while a new score's are not: a bias of order ``1 / n`` per p-value, which a product over millions of
inputs could compound.) The cost is resolution: two scores in one bin are tied, so a shift that moves scores within bins
is invisible, and an input above every ID score gets a p-value of order ``1 / K`` (the top bin holds ``1 / K`` of
the ID mass) instead of ``1 / n_t``; with the bets below, which never pay more for ``p < 0.01``, that loses nothing
at ``K = 2048``.

**Betting.** Drift towards OOD makes small p-values more frequent, so the bets pay on small p-values: "tail" bets
``f(p) = 1 - rho + (rho / c) * [p <= c]`` (stake a fraction ``rho`` of the capital on ``p <= c`` at fair odds),
for ``c`` in ``levels`` = (0.01, 0.05, 0.2) and ``rho`` in ``fractions`` = (0.1, 0.3, 0.6), nine bets of equal
prior weight; each integrates to 1 on (0, 1), so under the null every bet is a fair game. A product of such bets
started at the first input decays towards 0 along a long in-distribution stretch and then needs very long to
recover (so does Vovk et al.'s Simple Jumper, whose capital keeps moving into losing bets: in simulation, at
jumping rate 0.01, its log falls by about 6 nats per 1,000 ID inputs). So the statistic is a *mixture over the
time the change starts*: the capital starts in a reserve, a share ``pi_nu`` of it joins the ``m = 9`` bets at input
``nu`` (split equally) and then bets on every later input::

    M_t = reserve_t + sum_j A_t^j,   A_t^j = (A_{t-1}^j + pi_t / m) * f_j(p_t),   reserve_t = 1 - sum_{nu <= t} pi_nu

with ``pi_nu = g(nu) - g(nu + 1)``, ``g(nu) = 1 / ln(nu + e - 1)`` (``g(1) = 1``, so the shares sum to 1 and
``reserve_t = 1 / ln(t + e)``). Each component "hold 1 until ``nu``, then bet ``f_j``" is a test martingale
(the p-values are independent uniforms), and a mixture of test martingales with weights summing to 1 is one:
``M_0 = 1``, ``M_t >= 0``, ``E[M_t | past] = M_{t-1}``, so Ville's inequality gives the guarantee above. The
statistic never falls below the reserve ``1 / ln(t + e)`` (0.07 after 10^6 inputs), and a change at input ``nu``
is found once the bets started at ``nu`` have won about ``ln(1 / delta) + ln(m) + ln(1 / pi_nu)`` nats, where
``ln(1 / pi_nu) ~ ln nu + 2 ln ln nu``: the delay grows only logarithmically with the time of the change. (The
Shiryaev-Roberts statistic sums these bets instead of mixing them; it is not a martingale and bounds only the mean
time to a false alarm, not its probability.) Everything is computed in log space.

Measured (scores uniform, 5,000 calibration scores, ``delta = 0.01``; delay = inputs after the change until the
alarm; the drift draws 30 % of the inputs uniformly between the calibration 95th percentile and the top of the ID
range, the weakest such shift, and 70 % from the ID distribution; ``tests/service/core/test_drift.py`` reruns smaller
versions):

* false alarms within 10,000 ID inputs: 0.5 % (20 of 4,000 runs of the martingale on i.i.d. uniform p-values,
  which the theorem above makes exact) and 1 of 300 end-to-end monitor runs;
* change after 10,000 ID inputs: alarm within 300 inputs in all 299 runs; delay median 48, 90 % within 76,
  99 % within 99, longest 122 (the statistic just before the change: median e^-2.2, i.e. at its floor). Change
  after 100,000 ID inputs: median 52, longest 106 (40 runs);
* weaker drifts (200 runs each): 10 % of the inputs above the 95th percentile, 63 % of the runs within 300 inputs
  (median 252); 30 % above the 80th percentile, all within 300 (median 112).

**Randomness.** The smoothing ``theta_t`` and the calibration split come from ``seed``; the same seed and stream
give the same statistic. The guarantee needs the ``theta_t`` to be uniform and independent of the scores, not
secret.

**Reset and restart.** :meth:`DriftMonitor.reset` (like restarting the server) starts a fresh test: the
statistic goes back to 1 and the bag back to the calibration scores only. The stream's scores are dropped because
the new test asks whether the traffic *from now on* is exchangeable with the calibration data: after a real drift
the bag holds drifted scores, which would become part of the reference and hide the drift that is still going on.
A test started at a time chosen without looking at the scores (a restart, a deploy, a schedule) has the same
guarantee ``delta``. A reset triggered by this monitor's own alarm follows an alarm: if nothing ever drifted, that
alarm already was the false alarm of probability ``<= delta``, so "any false alarm ever, across such resets" stays
``<= delta``.

**Replicas.** Each replica tests its own traffic (a substream of i.i.d. traffic is i.i.d.) with its own monitor and
seed. Raising an alarm when any of ``R`` replicas alarms has false-alarm probability ``<= R * delta`` (union bound;
the replicas share the calibration scores, so they are not independent and nothing better holds in general): give
each replica ``delta / R`` for a fleet-wide ``delta``.

**Concurrency.** :meth:`DriftMonitor.update` and :meth:`DriftMonitor.reset` hold a lock, so concurrent callers are
serialised (the order batches enter is the order they take the lock, which does not depend on the scores, as
validity requires). Cost: about 1-2 microseconds per input for batches of 32 in numpy (no Python loop per input).

**Feeding it from the request path.** A call costs about 80 microseconds however few scores it gets (a few
dozen numpy calls), which is more than 1 % of a batch-1 answer. The server therefore feeds the monitor through a
:class:`DriftFeed`: served scores are appended to a buffer in arrival order, and the monitor advances over the
buffer once ``every`` (64) inputs have gathered, once ``max_delay_s`` (1 s) has passed since it last advanced, and
whenever the test is read (the drift route) or reset. Order and content are unchanged, so the statistic and the
guarantee are exactly those of feeding every score at once; the alarm (and ``/metrics``) may lag the traffic by up
to 63 inputs or a second, and at idle the last inputs wait for the next request or read.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["DriftFeed", "DriftMonitor", "tail_bets", "change_weights", "mixture_log_martingale"]

_CHUNK = 64  # inputs per vectorised step: the within-chunk pairwise counts cost CHUNK^2, the bin totals O(K)
_TRI = np.tri(_CHUNK, k=-1, dtype=bool)  # [i, j]: j comes before i


def tail_bets(levels: Sequence[float], fractions: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (level ``c``, fraction ``rho``) tail bet: ``(c (m,), log f(p <= c) (m,), log f(p > c) (m,))``.

    ``f(p) = 1 - rho + (rho / c) [p <= c]``; ``m = len(levels) * len(fractions)``.
    """
    c = np.asarray(levels, dtype=np.float64)
    r = np.asarray(fractions, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or not np.all((c > 0) & (c < 1)):
        raise ValueError(f"levels must be a non-empty list of numbers in (0, 1), got {levels!r}")
    if r.ndim != 1 or r.size == 0 or not np.all((r > 0) & (r < 1)):
        raise ValueError(f"fractions must be a non-empty list of numbers in (0, 1), got {fractions!r}")
    cc, rr = np.meshgrid(c, r, indexing="ij")
    cc, rr = cc.ravel(), rr.ravel()  # type: ignore[assignment]  # (levels * fractions,)
    return cc, np.log1p(rr * (1.0 / cc - 1.0)), np.log1p(-rr)


def change_weights(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log pi_t, log reserve_t)`` for input indices ``t >= 1`` ``(T,)``: the capital joining the bets at ``t``
    and the reserve left after it, ``pi_t = g(t) - g(t + 1)``, ``reserve_t = g(t + 1)``, ``g(t) = 1 / ln(t + e - 1)``.
    """
    t = np.asarray(t, dtype=np.float64)
    a = np.log(t + math.e - 1.0)  # ln(t + e - 1)
    b = np.log(t + math.e)  # ln(t + e)
    # g(t) - g(t+1) = (b - a) / (a b), with b - a = log1p(1 / (t + e - 1)) computed without cancellation
    return np.log(np.log1p(1.0 / (t + math.e - 1.0))) - np.log(a) - np.log(b), -np.log(b)


def mixture_log_martingale(
    p: np.ndarray, log_a: np.ndarray, start: int, levels: np.ndarray, log_hi: np.ndarray, log_lo: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Advance the change-point mixture of tail bets over p-values ``p (..., T)`` for inputs ``start + 1 .. start + T``.

    ``log_a (..., m)``: log of each bet's active capital before (``-inf`` at the start of a test). Returns
    ``(log M_t (..., T), log_a after (..., m))``. Leading dimensions are independent streams (simulation).
    """
    steps = p.shape[-1]
    log_m = np.empty(p.shape)
    # A_t = A_0 prod_{1..t} f + sum_{s <= t} (pi_s / m) prod_{s..t} f = exp(cum_t) (A_0 + sum_s w_s exp(-cum_{s-1})):
    # vectorised over t with cumulative sums. The exponentials stay in float range over spans of up to 600 nats of
    # bets, so the stream is cut into spans that short; across spans only log_a is carried.
    span = max(1, int(600 // max(np.abs(log_hi).max(), np.abs(log_lo).max())))
    for lo in range(0, steps, span):
        log_f = np.where(p[..., lo : lo + span, None] <= levels, log_hi, log_lo)  # (..., L, m)
        cum = np.cumsum(log_f, axis=-2)
        log_pi, log_reserve = change_weights(start + lo + np.arange(1, log_f.shape[-2] + 1))
        joined = np.cumsum(np.exp(log_pi - math.log(levels.shape[0]))[:, None] * np.exp(log_f - cum), axis=-2)
        log_at = cum + np.logaddexp(log_a[..., None, :], np.log(joined))
        top = log_at.max(axis=-1)
        log_sum = top + np.log(np.exp(log_at - top[..., None]).sum(axis=-1))
        log_m[..., lo : lo + span] = np.logaddexp(log_sum, log_reserve)
        log_a = log_at[..., -1, :]
    return log_m, log_a


class DriftMonitor:
    """Online test of "served scores are exchangeable with the calibration scores", alarm at ``1 / delta``.

    Args:
        calibration_scores: ``(n,)`` ID outlier scores (higher = more OOD) of calibration inputs, ``n >= 2``
            (``n >= 1`` with ``edges``).
        delta: false-alarm probability over the whole (unbounded) stream, in (0, 1).
        bins: number of quantisation bins ``K``.
        seed: seeds the calibration split and the smoothing.
        edges: ``(K - 1,)`` non-decreasing bin edges fixed without the calibration scores (e.g. from another
            split); default: quantiles of ``min(n / 2, 4 K)`` calibration scores set aside for it.
        levels, fractions: the tail bets (module docstring).

    Thread-safe: :meth:`update` and :meth:`reset` take a lock.
    """

    def __init__(
        self,
        calibration_scores: np.ndarray | torch.Tensor | Sequence[float],
        delta: float = 0.01,
        bins: int = 2048,
        seed: int = 0,
        *,
        edges: np.ndarray | Sequence[float] | None = None,
        levels: Sequence[float] = (0.01, 0.05, 0.2),
        fractions: Sequence[float] = (0.1, 0.3, 0.6),
    ) -> None:
        cal = np.asarray(calibration_scores, dtype=np.float64).ravel()
        if not np.all(np.isfinite(cal)):
            raise ValueError("calibration_scores must be finite")
        if not 0 < float(delta) < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if int(bins) != bins or bins < 2:
            raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
        split_seed, smooth_seed = np.random.SeedSequence(seed).spawn(2)
        if edges is None:
            if cal.size < 2:
                raise ValueError(f"need at least 2 calibration scores (half of them set the bin edges), got {cal.size}")
            perm = np.random.default_rng(split_seed).permutation(cal.size)
            n_edge = min(cal.size // 2, 4 * int(bins))
            e = np.quantile(cal[perm[:n_edge]], np.arange(1, bins) / bins)
            bag = cal[perm[n_edge:]]
        else:
            e = np.asarray(edges, dtype=np.float64)
            if e.shape != (bins - 1,) or not np.all(np.isfinite(e)) or np.any(np.diff(e) < 0):
                raise ValueError(f"edges must be ({bins - 1},) finite and non-decreasing, got shape {e.shape}")
            if cal.size < 1:
                raise ValueError("need at least 1 calibration score")
            bag = cal
        self._delta = float(delta)
        self._log_threshold = -math.log(self._delta)
        self._edges = e
        self._bag_counts = np.bincount(np.searchsorted(e, bag, side="right"), minlength=int(bins)).astype(np.int64)
        self._bag_n = int(bag.size)
        self._levels, self._log_hi, self._log_lo = tail_bets(levels, fractions)
        self._rng = np.random.default_rng(smooth_seed)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._counts = self._bag_counts.copy()
        self._n = self._bag_n
        self._count = 0
        self._log_a = np.full(self._levels.shape, -np.inf)
        self._log_m = 0.0
        self._alarm_at: int | None = None
        self._p_values = np.zeros(0)

    def reset(self) -> None:
        """Start a fresh test: statistic back to 1, bag back to the calibration scores, alarm cleared."""
        with self._lock:
            self._reset()

    def update(self, scores: np.ndarray | torch.Tensor | Sequence[float]) -> None:
        """Feed a batch of outlier scores ``(B,)`` (processed in order); may latch the alarm."""
        s = np.asarray(scores, dtype=np.float64).ravel()
        if np.isnan(s).any():
            raise ValueError("scores must not be NaN")
        with self._lock:
            out = np.empty(s.size)
            for lo in range(0, s.size, _CHUNK):
                out[lo : lo + _CHUNK] = self._step(s[lo : lo + _CHUNK])
            self._p_values = out

    def _step(self, s: np.ndarray) -> np.ndarray:
        b = np.searchsorted(self._edges, s, side="right")  # (B,) bin of each score, non-decreasing in the score
        size = b.shape[0]
        at_least = np.cumsum(self._counts[::-1])[::-1]  # scores in the bag with bin >= k
        equal = self._counts[b]
        earlier = _TRI[:size, :size]
        above_in = ((b[None, :] > b[:, None]) & earlier).sum(1)  # earlier scores of this chunk in higher bins
        equal_in = ((b[None, :] == b[:, None]) & earlier).sum(1)
        n_t = self._n + np.arange(1, size + 1)  # everything seen so far, this input included
        theta = self._rng.random(size)
        p = (at_least[b] - equal + above_in + theta * (equal + equal_in + 1)) / n_t
        self._counts += np.bincount(b, minlength=self._counts.shape[0])
        self._n += size
        log_m, self._log_a = mixture_log_martingale(
            p, self._log_a, self._count, self._levels, self._log_hi, self._log_lo
        )
        if self._alarm_at is None:
            hit = np.flatnonzero(log_m >= self._log_threshold)
            if hit.size:
                self._alarm_at = self._count + int(hit[0]) + 1
        self._count += size
        self._log_m = float(log_m[-1])
        return p

    @property
    def delta(self) -> float:
        return self._delta

    @property
    def log10_statistic(self) -> float:
        """``log10`` of the martingale (0 at the start of a test; the alarm level is ``log10(1 / delta)``)."""
        return self._log_m / math.log(10)

    @property
    def statistic(self) -> float:
        """The martingale's current value (``inf`` past float range)."""
        return math.exp(self._log_m) if self._log_m < 709 else math.inf

    @property
    def alarm(self) -> bool:
        """True once the statistic has reached ``1 / delta`` (latched until :meth:`reset`)."""
        return self._alarm_at is not None

    @property
    def alarm_at(self) -> int | None:
        """Number of inputs since the test started when the alarm fired (1 = the first), None before."""
        return self._alarm_at

    @property
    def count(self) -> int:
        """Inputs seen since the test started."""
        return self._count

    @property
    def bag_size(self) -> int:
        """Scores the p-values are computed against: the calibration bag plus the stream since the test started."""
        return self._n

    @property
    def p_values(self) -> np.ndarray:
        """The smoothed conformal p-values ``(B,)`` of the last batch (a copy)."""
        return self._p_values.copy()

    @property
    def edges(self) -> np.ndarray:
        """The bin edges ``(K - 1,)`` (a copy)."""
        return self._edges.copy()


class DriftFeed:
    """A :class:`DriftMonitor` fed from the request path: scores buffered, the test advanced in chunks.

    :meth:`add` appends a batch of outlier scores; the monitor advances over everything buffered once ``every``
    scores are waiting or ``max_delay_s`` has passed since it last advanced (checked at each :meth:`add`), and at
    every :meth:`flush` (call it before reading the test). ``on_update(monitor)`` runs after each advance (the
    server's drift metrics). :meth:`reset` drops the buffer: those inputs were served before the new test started.
    Not thread-safe by itself: the server calls it from its event loop only.
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
        self._pending: list[np.ndarray] = []
        self._waiting = 0
        self._last = time.monotonic()

    @property
    def waiting(self) -> int:
        """Scores buffered, not yet in the test."""
        return self._waiting

    def add(self, scores: np.ndarray) -> None:
        """Buffer a batch of outlier scores ``(B,)``; advance the test if enough are waiting or time has passed."""
        s = np.asarray(scores, dtype=np.float64).ravel()
        if np.isnan(s).any():
            raise ValueError("scores must not be NaN")
        self._pending.append(s)
        self._waiting += s.size
        if self._waiting >= self.every or time.monotonic() - self._last >= self.max_delay_s:
            self.flush()

    def flush(self) -> DriftMonitor:
        """Advance the test over every buffered score (in arrival order); the monitor, up to date."""
        self._last = time.monotonic()
        if self._pending:
            batch = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
            self._pending, self._waiting = [], 0
            self.monitor.update(batch)
            if self.on_update is not None:
                self.on_update(self.monitor)
        return self.monitor

    def reset(self) -> None:
        """A fresh test: the buffer dropped, the monitor reset."""
        self._pending, self._waiting = [], 0
        self._last = time.monotonic()
        self.monitor.reset()
