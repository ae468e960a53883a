"""The drift alarm (service/core/drift.py): known answers for the p-values and the martingale, exactness of the p-values
under the null, and the false-alarm rate and detection delay by simulation.

The simulations are seeded. A false-alarm rate is compared with ``delta`` plus 4 binomial standard errors of a rate
``delta`` over the runs (Ville's bound is the claim; the rates measured are well below it).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from scipy.stats import kstest

from service.core.drift import DriftFeed, DriftMonitor, change_weights, mixture_log_martingale, tail_bets

Z = 4.0
BETS = tail_bets((0.01, 0.05, 0.2), (0.1, 0.3, 0.6))


def _thetas(seed: int, size: int) -> np.ndarray:
    """The smoothing draws of a monitor seeded with ``seed``: the second stream spawned from it."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1]).random(size)


# ----------------------------------------------------------------------------- p-values
def test_p_values_known_answers():
    # bins: (-inf, 1) (1, 2) (2, 3) (3, inf); with fixed edges the whole calibration set is the bag: counts [1 2 1 1]
    mon = DriftMonitor([0.5, 1.5, 1.5, 2.5, 3.5], bins=4, edges=[1.0, 2.0, 3.0], seed=7)
    assert mon.bag_size == 5 and mon.count == 0 and mon.statistic == 1.0 and mon.log10_statistic == 0.0
    mon.update([1.7, 3.2, 1.2])
    # p = (#{higher bin} + theta * #{same bin, itself included}) / n_t over the bag and the stream so far:
    #   1.7: bin 1, 2 above, 2 + 1 equal, n 6;  3.2: bin 3, 0 above, 1 + 1 equal, n 7;  1.2: bin 1, 3 above, 3 + 1, n 8
    lower, width = np.array([2 / 6, 0.0, 3 / 8]), np.array([3 / 6, 2 / 7, 4 / 8])
    np.testing.assert_allclose(mon.p_values, lower + _thetas(7, 3) * width, rtol=1e-12)
    assert mon.count == 3 and mon.bag_size == 8
    # one at a time gives the same p-values (the same smoothing draws, in order)
    single = DriftMonitor([0.5, 1.5, 1.5, 2.5, 3.5], bins=4, edges=[1.0, 2.0, 3.0], seed=7)
    got = []
    for s in (1.7, 3.2, 1.2):
        single.update(np.array([s]))
        got.append(single.p_values[0])
    np.testing.assert_array_equal(got, mon.p_values)
    assert single.log10_statistic == pytest.approx(mon.log10_statistic, abs=1e-12)


def test_batches_are_processed_in_order_across_chunks():
    rng = np.random.default_rng(1)
    cal, stream = rng.normal(size=3000), rng.normal(size=1000) + np.linspace(0, 2, 1000)
    one = DriftMonitor(cal, seed=3)
    one.update(stream)  # 1,000 inputs: 16 chunks of 64
    many = DriftMonitor(cal, seed=3)
    ps = []
    for lo in range(0, 1000, 37):
        many.update(stream[lo : lo + 37])
        ps.append(many.p_values)
    np.testing.assert_allclose(np.concatenate(ps), one.p_values, rtol=0, atol=1e-15)
    assert many.log10_statistic == pytest.approx(one.log10_statistic, abs=1e-9)
    assert (many.alarm, many.alarm_at) == (one.alarm, one.alarm_at)


def test_calibration_split_sets_the_edges():
    rng = np.random.default_rng(2)
    mon = DriftMonitor(rng.random(10000), bins=1024, seed=0)
    assert mon.bag_size == 10000 - 4096  # min(n / 2, 4 K) scores set the edges, the rest is the bag
    assert mon.edges.shape == (1023,) and np.all(np.diff(mon.edges) >= 0)
    assert DriftMonitor(rng.random(100), bins=1024).bag_size == 50


def test_p_values_are_uniform_under_the_null_even_with_ties():
    """Scores on a grid of 21 values (heavy ties) in 64 bins: the smoothed p-values are exactly i.i.d. uniform."""
    rng = np.random.default_rng(4)
    draw = lambda n: np.round(rng.random(n) * 20) / 20
    mon = DriftMonitor(draw(4000), bins=64, seed=5)
    ps = []
    for _ in range(100):
        mon.update(draw(100))
        ps.append(mon.p_values)
    ps = np.concatenate(ps)
    assert kstest(ps, "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(ps[:-1], ps[1:])[0, 1]) < Z / math.sqrt(ps.size)  # no serial dependence


# ----------------------------------------------------------------------------- the martingale
def test_martingale_first_step_known_answer():
    c, hi, lo = BETS
    log_m, _ = mixture_log_martingale(np.array([0.001]), np.full(9, -np.inf), 0, c, hi, lo)
    # M_1 = g(2) + pi_1 * mean_j f_j(0.001), g(t) = 1 / ln(t + e - 1), pi_1 = g(1) - g(2) = 1 - g(2)
    g2 = 1 / math.log(1 + math.e)
    f = [1 - r + r / lv for lv in (0.01, 0.05, 0.2) for r in (0.1, 0.3, 0.6)]
    assert math.exp(log_m[0]) == pytest.approx(g2 + (1 - g2) * np.mean(f), rel=1e-12)
    lp, lr = change_weights(np.array([1, 10, 10**6]))
    np.testing.assert_allclose(np.exp(lr), 1 / np.log(np.array([1, 10, 10**6]) + math.e), rtol=1e-12)
    np.testing.assert_allclose(
        np.exp(lp),
        [
            1 - g2,
            1 / math.log(9 + math.e) - 1 / math.log(10 + math.e),
            1 / math.log(10**6 - 1 + math.e) - 1 / math.log(10**6 + math.e),
        ],
        rtol=1e-6,
    )


def test_martingale_matches_the_plain_recursion():
    """The vectorised log-space computation against A_t = (A_{t-1} + pi_t / m) f(p_t), one input at a time."""
    c, hi, lo = BETS
    rng = np.random.default_rng(6)
    p = rng.random(1500)
    p[700:] *= np.where(rng.random(800) < 0.3, 0.03, 1.0)  # a drift: the statistic grows far past float range
    ref, a, log_scale = [], np.zeros(9), 0.0
    for t in range(1, p.size + 1):
        log_pi, log_res = change_weights(np.array([t]))
        a = (a + math.exp(log_pi[0] - log_scale) / 9) * np.exp(np.where(p[t - 1] <= c, hi, lo))
        log_scale += math.log(a.sum())  # keep a normalised; log_scale = log of the active capital
        a /= a.sum()
        ref.append(np.logaddexp(log_scale, log_res[0]))
    log_m, _ = mixture_log_martingale(p, np.full(9, -np.inf), 0, c, hi, lo)
    np.testing.assert_allclose(log_m, ref, rtol=0, atol=1e-9 * max(1.0, abs(ref[-1])))
    assert log_m[-1] > 300  # beyond exp's range: only log space holds it


def test_statistic_never_falls_below_the_reserve():
    c, hi, lo = BETS
    log_m, _ = mixture_log_martingale(np.ones(5000), np.full(9, -np.inf), 0, c, hi, lo)  # every bet loses
    reserve = -np.log(np.log(np.arange(1, 5001) + math.e))
    assert np.all(log_m >= reserve - 1e-12)
    assert log_m[-1] == pytest.approx(reserve[-1], abs=1e-3)  # the losing bets hold almost nothing


# ----------------------------------------------------------------------------- false alarms and detection
def test_false_alarm_rate_end_to_end():
    """10,000 i.i.d. uniform scores after 5,000 calibration scores, delta = 0.01, through the whole monitor."""
    runs, alarms = 150, 0
    for r in range(runs):
        rng = np.random.default_rng(1000 + r)
        mon = DriftMonitor(rng.random(5000), delta=0.01, seed=r)
        mon.update(rng.random(10000))
        alarms += mon.alarm
    assert alarms / runs <= 0.01 + Z * math.sqrt(0.01 * 0.99 / runs), alarms


def test_false_alarm_rate_of_the_martingale():
    """The martingale on i.i.d. uniform p-values (what the monitor's p-values are under the null, exactly), 1,000
    streams of 10,000 inputs at once: P(max_t M_t >= 100) <= 0.01."""
    c, hi, lo = BETS
    rng = np.random.default_rng(11)
    runs, log_a, alarm = 1000, np.full((1000, 9), -np.inf), np.zeros(1000, dtype=bool)
    for start in range(0, 10000, 500):
        log_m, log_a = mixture_log_martingale(rng.random((runs, 500)), log_a, start, c, hi, lo)
        alarm |= (log_m >= math.log(100)).any(axis=1)
    assert alarm.mean() <= 0.01 + Z * math.sqrt(0.01 * 0.99 / runs), alarm.mean()


def test_detection_delay_after_a_long_in_distribution_stretch():
    """10,000 ID inputs, then 30 % of the inputs above the calibration 95th percentile (uniform between it and the
    top of the ID range: the weakest such drift) and 70 % ID: the alarm fires within 300 inputs in nearly all runs
    (measured: all of 300 runs, median delay 48)."""
    runs, delays, early = 100, [], 0
    for r in range(runs):
        rng = np.random.default_rng(2000 + r)
        cal = rng.random(5000)
        q95 = np.quantile(cal, 0.95)
        mon = DriftMonitor(cal, delta=0.01, seed=r)
        mon.update(rng.random(10000))
        if mon.alarm:
            early += 1
            continue
        ood = rng.random(1000) < 0.3
        mon.update(np.where(ood, q95 + (1 - q95) * rng.random(1000), rng.random(1000)))
        delays.append(mon.alarm_at - 10000 if mon.alarm else math.inf)
    d = np.array(delays)
    assert early <= 2
    assert np.mean(d <= 300) >= 0.9, d
    assert np.median(d) <= 120, np.median(d)


# ----------------------------------------------------------------------------- reset, concurrency, validation
def test_alarm_latches_and_reset_starts_a_fresh_test():
    rng = np.random.default_rng(8)
    mon = DriftMonitor(rng.random(2000), delta=0.01, seed=1)
    bag = mon.bag_size
    mon.update(0.99 + 0.01 * rng.random(200))  # far out: the alarm fires quickly
    assert mon.alarm and 1 <= mon.alarm_at <= 50 and mon.statistic >= 100
    at = mon.alarm_at
    mon.update(rng.random(500))  # back to normal: the alarm stays latched, at the same input
    assert mon.alarm and mon.alarm_at == at and mon.count == 700
    mon.reset()
    assert (mon.alarm, mon.alarm_at, mon.count, mon.statistic, mon.bag_size) == (False, None, 0, 1.0, bag)
    assert mon.p_values.size == 0
    mon.update(rng.random(1000))
    assert not mon.alarm and mon.bag_size == bag + 1000


def test_concurrent_updates_are_serialised():
    rng = np.random.default_rng(9)
    mon = DriftMonitor(rng.random(2000), seed=2)
    batches = [rng.random(32) for _ in range(200)]

    def feed(part: list[np.ndarray]) -> None:
        for b in part:
            mon.update(b)

    threads = [threading.Thread(target=feed, args=(batches[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mon.count == 6400 and mon.bag_size == 1000 + 6400


def test_invalid_inputs_are_rejected():
    cal = np.linspace(0, 1, 100)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        DriftMonitor(cal, delta=1.0)
    with pytest.raises(ValueError, match="bins must be an integer >= 2"):
        DriftMonitor(cal, bins=1)
    with pytest.raises(ValueError, match="calibration_scores must be finite"):
        DriftMonitor(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(ValueError, match="at least 2 calibration scores"):
        DriftMonitor([0.5])
    with pytest.raises(ValueError, match=r"edges must be \(3,\)"):
        DriftMonitor(cal, bins=4, edges=[0.5, 0.2, 0.9])
    with pytest.raises(ValueError, match=r"levels must be .* in \(0, 1\)"):
        DriftMonitor(cal, levels=(0.0, 0.1))
    with pytest.raises(ValueError, match=r"fractions must be .* in \(0, 1\)"):
        DriftMonitor(cal, fractions=(1.0,))
    mon = DriftMonitor(cal)
    with pytest.raises(ValueError, match="must not be NaN"):
        mon.update([0.1, float("nan")])
    assert mon.count == 0  # a rejected batch changes nothing


# ----------------------------------------------------------------------------- the server's feed
def test_drift_feed_gives_the_statistic_of_feeding_every_score_at_once(monkeypatch):
    """Buffered in chunks (by count, by time, on flush) the test sees the same scores in the same order: the same
    p-values, statistic and alarm point as one monitor fed the whole stream."""
    rng = np.random.default_rng(3)
    cal = rng.normal(size=2000)
    stream = np.concatenate([rng.normal(size=700), rng.normal(3.0, 1.0, size=300)])  # drifts at input 701
    reference = DriftMonitor(cal, delta=0.01, bins=256, seed=5)
    reference.update(stream)
    clock = [0.0]
    monkeypatch.setattr("service.core.drift.time.monotonic", lambda: clock[0])
    updates: list[int] = []
    feed = DriftFeed(
        DriftMonitor(cal, delta=0.01, bins=256, seed=5),
        every=64,
        max_delay_s=1.0,
        on_update=lambda m: updates.append(m.count),
    )
    i, quiet = 0, False
    for size in rng.integers(1, 9, size=10_000):
        if i >= stream.size:
            break
        feed.add(stream[i : i + size])
        i += int(size)
        clock[0] += 0.001
        if i >= 40 and not quiet:  # a quiet second: the next add advances the test with fewer than 64 waiting
            clock[0] += 1.5
            quiet = True
    mon = feed.flush()
    assert feed.waiting == 0 and mon.count == stream.size
    assert mon.log10_statistic == pytest.approx(reference.log10_statistic, rel=1e-12, abs=1e-12)
    assert mon.alarm_at == reference.alarm_at and reference.alarm_at is not None and reference.alarm_at > 700
    steps = np.diff([0, *updates])
    assert updates[-1] == stream.size and max(steps) < 64 + 8  # at most every + one batch behind
    assert any(s < 64 for s in steps[:-1])  # the time rule advanced it once with fewer than 64 waiting


def test_drift_feed_reset_drops_the_buffer_and_restarts_the_test():
    feed = DriftFeed(DriftMonitor(np.arange(100.0), bins=16, seed=0), every=64, max_delay_s=60.0)
    feed.add(np.full(10, 1e6))
    assert feed.waiting == 10 and feed.monitor.count == 0  # buffered, not yet tested
    feed.reset()
    assert feed.waiting == 0 and feed.flush().count == 0 and feed.monitor.statistic == 1.0
    with pytest.raises(ValueError, match="NaN"):
        feed.add(np.array([np.nan]))
    with pytest.raises(ValueError, match="every"):
        DriftFeed(feed.monitor, every=0)
