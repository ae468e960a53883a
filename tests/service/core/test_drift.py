"""The drift alarm (service/core/drift.py): known answers for the bets and the CUSUM, the split bound against SciPy,
the average-run-length and early-alarm guarantees by simulation, bursts, detection, clearing, episodes, the feed.

The simulations are seeded. A rate is compared with its bound plus ``Z`` binomial standard errors of a rate at the
bound over the runs; a mean with its bound minus ``Z`` standard errors of the simulated mean.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest
from scipy.stats import beta

from service.core.conformal import ood_p_values
from service.core.drift import (
    BURST,
    CAP_DECADES,
    HORIZON,
    LEVELS,
    MAX_PAYOFF,
    STAKE,
    DriftFeed,
    DriftMonitor,
    TailBets,
    alarm_paths,
    clopper_pearson_upper,
)

Z = 4.0
LN10 = math.log(10)


def _fair_bets(stake: float = STAKE) -> TailBets:
    """The default bets on i.i.d. uniform scores with ``u_l = c_l``: each pays exactly fair odds (mean 1), the
    tightest case the guarantee allows."""
    c = np.array(LEVELS)
    return TailBets(levels=LEVELS, thresholds=1.0 - c, upper=c, stakes=(stake,), members=(tuple(range(len(c))),))


# ----------------------------------------------------------------------------- the bets
@pytest.mark.parametrize(("k", "n", "level"), [(0, 10, 0.05), (49, 1000, 0.01 / 3), (14, 300, 0.2), (199, 999, 0.5)])
def test_clopper_pearson_upper_matches_scipy(k, n, level):
    """The upper bound is the ``1 - level`` quantile of Beta(k + 1, n - k) (SciPy's), i.e. P(Binom(n, u) <= k) =
    level."""
    u = clopper_pearson_upper(k, n, level)
    assert u == pytest.approx(beta.ppf(1 - level, k + 1, n - k), rel=1e-9, abs=1e-12)


def test_bets_known_answers():
    """n = 19 scores 1..19: at c = 0.05, 0.1, 0.2, m = floor(20 c) - 1 = 0, 1, 3, so the thresholds are the 1st, 2nd
    and 4th largest scores (19, 18, 16); e = 1 - stake + stake/3 sum_l [s > tau_l] / u_l."""
    bets = TailBets.fit(np.arange(1.0, 20.0), delta=0.03, components=[((0.05, 0.1, 0.2), 0.3)])
    np.testing.assert_array_equal(bets.thresholds, [19.0, 18.0, 16.0])
    np.testing.assert_allclose(bets.upper, [beta.ppf(0.99, k + 1, 19 - k) for k in (0, 1, 3)], rtol=1e-9)
    u = bets.upper
    want = {
        25.0: 0.7 + 0.1 * (1 / u[0] + 1 / u[1] + 1 / u[2]),
        18.5: 0.7 + 0.1 * (1 / u[1] + 1 / u[2]),
        17.0: 0.7 + 0.1 / u[2],
        16.0: 0.7,  # not above the threshold: p = (1 + 4) / 20 = 0.25 > 0.2
        -3.0: 0.7,
    }
    np.testing.assert_allclose(np.exp(bets.log_e(np.array(list(want))))[:, 0], list(want.values()), rtol=1e-12)
    np.testing.assert_allclose(np.exp(bets.log_e_list(list(want)))[:, 0], list(want.values()), rtol=1e-12)
    assert math.exp(bets.max_log_e[0]) == pytest.approx(want[25.0], rel=1e-12)


def test_a_bet_is_a_bet_on_the_served_p_value():
    """score > tau_l exactly when the served p-value (1 + #{cal >= s}) / (n + 1) is at most c_l."""
    rng = np.random.default_rng(0)
    cal = np.round(rng.normal(size=1000), 2)  # ties
    bets = TailBets.fit(cal, delta=0.01)
    s = np.concatenate([np.round(rng.normal(size=5000) * 1.3, 2), cal])
    p = ood_p_values(s, np.sort(cal))
    for c, tau in zip(bets.levels, bets.thresholds, strict=True):
        np.testing.assert_array_equal(s > tau, p <= c + 1e-12)


def test_levels_without_a_calibration_score_to_bet_against_are_left_out():
    assert TailBets.fit(np.arange(10.0), delta=0.01).levels == (0.1, 0.2)  # 11 * 0.05 < 1
    with pytest.raises(ValueError, match="too few"):
        TailBets.fit([0.1, 0.2, 0.3], delta=0.01)


def test_the_split_bound_holds_with_probability_one_minus_delta():
    """Over 4,000 draws of a split of n = 200 uniform scores, the true chance of each bet's event, 1 - tau_l, exceeds
    its bound u_l for some level in at most delta = 0.1 of the draws (Bonferroni over the 3 levels: about 0.1)."""
    rng = np.random.default_rng(1)
    bets = TailBets.fit(rng.random(200), delta=0.1)  # the bounds depend on n only
    cal = -np.sort(-rng.random((4000, 200)), axis=1)  # (draws, n) descending
    m = [math.floor(c * 201) - 1 for c in bets.levels]
    q = 1.0 - cal[:, m]  # (draws, L) P(s > tau_l | split) for uniform scores
    fail = (q > bets.upper).any(axis=1).mean()
    assert fail <= 0.1 + Z * math.sqrt(0.1 * 0.9 / 4000), fail
    assert fail >= 0.05  # and not vacuous: the bound is a quantile, not far beyond it


# ----------------------------------------------------------------------------- the statistic and the alarm
def test_cusum_is_the_best_product_since_any_start():
    """Without the cap, log C_t = max_j sum_{i=j..t} log e_i (the recursion max(C, 1) e against brute force)."""
    x = np.random.default_rng(2).normal(-0.1, 0.8, size=(3, 200))
    log_c, _ = alarm_paths(x, log_a=1e9, log_cap=1e9)
    brute = np.array([[max(x[s, j : t + 1].sum() for j in range(t + 1)) for t in range(200)] for s in range(3)])
    np.testing.assert_allclose(log_c, brute, atol=1e-9)


def test_alarm_goes_on_at_a_and_off_below_one_with_the_cap_in_between():
    x = np.array([[2.0, 2.0, 2.0, 5.0, 5.0, -3.0, -3.0, -3.0, -3.0, -1.0, 1.0]])
    log_c, on = alarm_paths(x, log_a=5.5, log_cap=9.0)
    np.testing.assert_allclose(log_c[0], [2, 4, 6, 9, 9, 6, 3, 0, -3, -1, 1])  # capped at 9; restarts from 0
    assert on[0].tolist() == [False, False, True, True, True, True, True, True, False, False, False]


def test_monitor_follows_the_simulated_paths_and_records_episodes():
    """The monitor, fed in uneven batches, has the statistic and alarm of alarm_paths on the same stream; each episode
    starts where the path reaches A and clears where it falls below 1."""
    rng = np.random.default_rng(3)
    cal = rng.random(1000)
    foreign = lambda n: 0.999 + 0.001 * rng.random(n)  # noqa: E731
    stream = np.concatenate([rng.random(500), foreign(40), rng.random(600), foreign(40), rng.random(600)])
    mon = DriftMonitor(cal, delta=0.01)
    log_c, on = alarm_paths(
        mon.bets.log_e(stream)[None, :], math.log(mon.arl), math.log(mon.arl) + CAP_DECADES * LN10, mon.bets.log_weights
    )
    seen = []
    for lo in range(0, stream.size, 37):
        mon.update(stream[lo : lo + 37])
        seen.append((mon.count, mon.log10_statistic, mon.alarm))
    for count, stat, alarm in seen:
        assert stat == pytest.approx(log_c[0, count - 1] / LN10, abs=1e-9) and alarm == on[0, count - 1]
    starts = np.flatnonzero(on[0] & ~np.r_[False, on[0, :-1]]) + 1
    ends = np.flatnonzero(~on[0] & np.r_[False, on[0, :-1]]) + 1
    eps = mon.episodes
    assert [e.started_at for e in eps] == starts.tolist() and len(eps) == 2 == mon.episodes_total
    assert [e.cleared_at for e in eps] == ends.tolist() and all(e.cleared_by == "traffic" for e in eps)
    assert 500 < eps[0].started_at <= 540 and 1140 < eps[1].started_at <= 1180  # during each run of foreign inputs
    for e in eps:  # 40 extreme inputs: far past A, up to the cap
        assert e.peak_log10 == pytest.approx(log_c[0, e.started_at - 1 : e.cleared_at].max() / LN10, abs=1e-9)
        assert e.peak_log10 == pytest.approx(math.log10(mon.arl) + CAP_DECADES)
    assert not mon.alarm and mon.state()["history"][0] == eps[0].as_dict()


def test_a_burst_of_five_extreme_inputs_does_not_fire_it():
    """Five inputs above every calibration score lift the mixture by at most MAX_PAYOFF^5 (10^4 of the 10^5 to A),
    wherever the stream stood: from its floor they never fire it. Inside ID traffic the statistic sits a little above
    its floor at times (its 99th percentile: 1 decade), so a burst there fires it rarely (measured: 9 of 1,000
    positions); 1,000 ID inputs later it is back at its floor."""
    rng = np.random.default_rng(4)
    runs, fired = 200, 0
    cal = rng.random(1000)
    bets = TailBets.fit(cal, delta=0.01)
    assert BURST * bets.max_log_e.max() / LN10 <= BURST * math.log10(MAX_PAYOFF) + 1e-12 < 5
    stream = np.concatenate([rng.random((runs, 2000)), np.full((runs, 5), 2.0), rng.random((runs, 1000))], axis=1)
    a = math.log(HORIZON / 0.01)
    log_c, on = alarm_paths(bets.log_e(stream), a, a + CAP_DECADES * LN10, bets.log_weights)
    fired = on.any(axis=1).sum()
    assert fired <= 4, fired  # 2 % of 200 (measured 0.9 %)
    assert (log_c[:, 2004] - np.maximum(log_c[:, 1999], 0) <= 5 * bets.max_log_e.max() + 1e-12).all()
    _, on = alarm_paths(bets.log_e(np.full((1, 5), 2.0)), a, a + CAP_DECADES * LN10, bets.log_weights)
    assert not on.any()  # from the floor: never
    assert not on[:, -1].any() and np.median(log_c[:, -1]) < 0.5


def test_a_sustained_excess_of_small_p_values_fires_it_within_300_inputs():
    """After 10,000 ID inputs, 30 % of the inputs drawn above the calibration 95th percentile (uniform between it and
    the top of the ID range: the weakest such shift) and 70 % ID: the alarm fires within 300 inputs in every run
    (measured: median 49, largest 139 of 200); once on it stays on while the drift lasts, and it clears within 1,000
    ID inputs after the traffic is back (measured: median 104, largest 191)."""
    rng = np.random.default_rng(5)
    runs, a = 200, math.log(HORIZON / 0.01)
    cal = rng.random(1000)
    bets = TailBets.fit(cal, delta=0.01)
    q95 = np.quantile(cal, 0.95)
    drift = np.where(
        rng.random((runs, 1000)) < 0.3, q95 + (1 - q95) * rng.random((runs, 1000)), rng.random((runs, 1000))
    )
    stream = np.concatenate([rng.random((runs, 10_000)), drift, rng.random((runs, 1000))], axis=1)
    _, on = alarm_paths(bets.log_e(stream), a, a + CAP_DECADES * LN10, bets.log_weights)
    assert not on[:, :10_000].any()
    during = on[:, 10_000:11_000]
    delay = np.where(during.any(axis=1), during.argmax(axis=1) + 1, 10**9)
    assert delay.max() <= 300 and np.median(delay) <= 120, (np.median(delay), delay.max())
    stays = np.array([during[r, delay[r] - 1 :].all() for r in range(runs)])
    assert stays.all()  # once on, it stays on while the drift lasts
    assert not on[:, -1].any()  # back to normal: cleared


# ----------------------------------------------------------------------------- the guarantees
@pytest.mark.parametrize("arl", [10.0, 40.0])
def test_mean_run_length_is_at_least_a_with_fair_bets(arl):
    """Bets at exactly fair odds (the tightest case the guarantee allows): E[run length] >= A and
    P(alarm within m inputs) <= m / A (measured: 11 A and 14 A, and 2 % within A / 2 inputs, not 50 %)."""
    rng = np.random.default_rng(int(arl))
    runs, steps = 1000, int(60 * arl)
    log_c, on = alarm_paths(
        _fair_bets().log_e(rng.random((runs, steps))), math.log(arl), math.log(arl) + CAP_DECADES * LN10
    )
    tau = np.where(on.any(axis=1), on.argmax(axis=1) + 1, steps)  # censored at `steps`: a lower bound of the mean
    assert tau.mean() - Z * tau.std() / math.sqrt(runs) >= arl, tau.mean()
    m = int(arl // 2)
    early = (tau <= m).mean()
    assert early <= m / arl + Z * math.sqrt(0.5 * 0.5 / runs), early


def test_false_alarms_end_to_end_at_the_defaults():
    """The null exactly: calibration split and traffic i.i.d. uniform, a fresh split per run; 200 streams of 10,000
    inputs at delta = 0.01 (A = 10^5): the bound is delta + 10^4 / A = 11 % of the streams; none alarmed."""
    rng = np.random.default_rng(6)
    runs, steps = 200, 10_000
    mon = DriftMonitor(rng.random(1000), delta=0.01)
    assert mon.arl == HORIZON / 0.01 and mon.log10_threshold == pytest.approx(5.0)
    splits = -np.sort(-rng.random((runs, 1000)), axis=1)  # (runs, n) descending: a fresh split per run
    m = [math.floor(c * 1001) - 1 for c in mon.bets.levels]
    stream = rng.random((runs, steps))
    log_e = np.stack([dataclasses.replace(mon.bets, thresholds=splits[r, m]).log_e(stream[r]) for r in range(runs)])
    a = math.log(mon.arl)
    _, on = alarm_paths(log_e, a, a + CAP_DECADES * LN10, mon.bets.log_weights)
    alarms = int(on.any(axis=1).sum())
    assert alarms / runs <= 0.01 + 0.1, alarms
    assert alarms <= 2, alarms  # measured 0: the bound is loose (fair bets, above, run about 12 A)
    one = DriftMonitor(splits[0], delta=0.01)  # the monitor itself on the first run: the same path
    one.update(stream[0])
    assert one.episodes_total == int(on[0].any()) and one.bets.upper.tolist() == mon.bets.upper.tolist()


# ----------------------------------------------------------------------------- reset, history, concurrency, errors
def test_reset_restarts_the_statistic_and_keeps_the_count_and_history():
    rng = np.random.default_rng(8)
    mon = DriftMonitor(rng.random(2000), delta=0.01)
    mon.update(np.full(60, 5.0))  # far out: on
    assert mon.alarm and mon.alarm_at is not None and mon.alarm_at <= 15
    mon.reset()
    state = mon.state()
    assert (state["alarm"], state["alarm_at"], state["log10_statistic"], state["inputs"]) == (False, None, 0.0, 60)
    assert state["history"][-1]["cleared_at"] == 60 and state["history"][-1]["cleared_by"] == "reset"
    assert state["episodes"] == 1 and state["arl"] == 1e5 and state["delta"] == 0.01
    mon.update(rng.random(1000))
    assert not mon.alarm and mon.count == 1060 and mon.episodes_total == 1


def test_history_is_bounded():
    mon = DriftMonitor(np.random.default_rng(9).random(1000), delta=0.01, history=3)
    for _ in range(5):
        mon.update(np.full(60, 5.0))
        mon.update(np.full(400, 0.5))  # ID-like: cleared
    assert mon.episodes_total == 5 and len(mon.episodes) == 3 and not mon.alarm
    assert [e.cleared_by for e in mon.episodes] == ["traffic"] * 3
    assert mon.episodes[0].started_at > 2 * 460  # the oldest two were dropped


def test_concurrent_updates_are_serialised():
    rng = np.random.default_rng(10)
    mon = DriftMonitor(rng.random(2000))
    batches = [rng.random(32) for _ in range(200)]

    def feed(part: list[np.ndarray]) -> None:
        for b in part:
            mon.update(b)

    threads = [threading.Thread(target=feed, args=(batches[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mon.count == 6400


def test_invalid_inputs_are_rejected():
    cal = np.linspace(0, 1, 100)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        DriftMonitor(cal, delta=1.0)
    with pytest.raises(ValueError, match="calibration_scores must be finite"):
        DriftMonitor(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(ValueError, match=r"levels must be .* in \(0, 1\)"):
        DriftMonitor(cal, components=[((0.0, 0.1), 0.25)])
    with pytest.raises(ValueError, match=r"stake must be in \(0, 1\)"):
        DriftMonitor(cal, components=[((0.1,), 1.0)])
    with pytest.raises(ValueError, match="components must not be empty"):
        DriftMonitor(cal, components=[])
    with pytest.raises(ValueError, match="arl must be"):
        DriftMonitor(cal, arl=1.0)
    with pytest.raises(ValueError, match="history must be"):
        DriftMonitor(cal, history=0)
    with pytest.raises(ValueError, match="0 <= k < n"):
        clopper_pearson_upper(5, 5, 0.1)
    mon = DriftMonitor(cal)
    with pytest.raises(ValueError, match="must not be NaN"):
        mon.update([0.1, float("nan")])
    assert mon.count == 0  # a rejected batch changes nothing


# ----------------------------------------------------------------------------- the server's feed
def test_drift_feed_gives_the_statistic_of_feeding_every_score_at_once(monkeypatch):
    """Buffered in chunks (by count, by time, on flush) the monitor sees the same scores in the same order: the same
    statistic, alarm and episodes as one monitor fed the whole stream."""
    rng = np.random.default_rng(3)
    cal = rng.normal(size=2000)
    stream = np.concatenate([rng.normal(size=700), rng.normal(3.0, 1.0, size=300)])  # drifts at input 701
    reference = DriftMonitor(cal, delta=0.01)
    reference.update(stream)
    clock = [0.0]
    monkeypatch.setattr("service.core.drift.time.monotonic", lambda: clock[0])
    updates: list[int] = []
    feed = DriftFeed(
        DriftMonitor(cal, delta=0.01), every=64, max_delay_s=1.0, on_update=lambda m: updates.append(m.count)
    )
    i, quiet = 0, False
    for size in rng.integers(1, 9, size=10_000):
        if i >= stream.size:
            break
        feed.add(stream[i : i + size])
        i += int(size)
        clock[0] += 0.001
        if i >= 40 and not quiet:  # a quiet second: the next add advances the monitor with fewer than 64 waiting
            clock[0] += 1.5
            quiet = True
    mon = feed.flush()
    assert feed.waiting == 0 and mon.count == stream.size
    assert mon.log10_statistic == pytest.approx(reference.log10_statistic, rel=1e-12, abs=1e-12)
    assert mon.state()["history"] == reference.state()["history"] and reference.alarm_at is not None
    assert reference.alarm_at > 700
    steps = np.diff([0, *updates])
    assert updates[-1] == stream.size and max(steps) < 64 + 8  # at most every + one batch behind
    assert any(s < 64 for s in steps[:-1])  # the time rule advanced it once with fewer than 64 waiting


def test_drift_feed_reset_takes_the_buffer_in_then_restarts_the_statistic():
    seen: list[int] = []
    feed = DriftFeed(
        DriftMonitor(np.arange(100.0)), every=64, max_delay_s=60.0, on_update=lambda m: seen.append(m.count)
    )
    feed.add(np.full(30, 1e6))
    assert feed.waiting == 30 and feed.monitor.count == 0  # buffered, not yet in
    feed.reset()
    assert feed.waiting == 0 and feed.monitor.count == 30 and seen == [30, 30]
    assert feed.monitor.statistic == 1.0 and not feed.monitor.alarm
    assert feed.monitor.episodes[-1].cleared_by == "reset"  # 30 extreme inputs had fired it
    with pytest.raises(ValueError, match="NaN"):
        feed.add(np.array([np.nan]))
    with pytest.raises(ValueError, match="every"):
        DriftFeed(feed.monitor, every=0)


# ----------------------------------------------------------------------------- the mixture
def _fair_mixture() -> TailBets:
    """A mixture of single-level and multi-level bets at exactly fair odds on uniform scores (u_l = c_l), stakes up
    to 0.9: the tightest case the guarantee allows, for the mixture."""
    c = (0.02, 0.05, 0.1, 0.2)
    members = ((1, 2, 3), (0,), (0,), (1,), (1,), (3,), (3,))
    stakes = (0.25, 0.5, 0.9, 0.5, 0.9, 0.5, 0.9)
    weights = (0.3,) + (0.7 / 6,) * 6
    return TailBets(
        levels=c, thresholds=1.0 - np.array(c), upper=np.array(c), stakes=stakes, members=members, weights=weights
    )


def test_the_mixture_is_the_weighted_mean_of_each_components_best_product_since_any_start():
    """Without the cap, log C_t = log sum_j w_j max_s prod_{i=s..t} e_j(x_i) (brute force over the starts)."""
    bets = _fair_mixture()
    x = bets.log_e(np.random.default_rng(11).random((2, 120)))  # (S, T, J)
    log_c, _ = alarm_paths(x, log_a=1e9, log_cap=1e9, log_weights=bets.log_weights)
    for s in range(2):
        for t in range(120):
            best = [max(x[s, i : t + 1, j].sum() for i in range(t + 1)) for j in range(x.shape[2])]
            want = math.log(sum(w * math.exp(b) for w, b in zip(bets.weights, best, strict=True)))
            assert log_c[s, t] == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("arl", [10.0, 40.0])
def test_the_mixtures_mean_run_length_is_at_least_a_with_fair_bets(arl):
    """The mixture at exactly fair odds: E[run length] >= A and P(alarm within m inputs) <= (m + 1) / A."""
    rng = np.random.default_rng(int(arl) + 100)
    bets = _fair_mixture()
    runs, steps = 1000, int(60 * arl)
    _, on = alarm_paths(
        bets.log_e(rng.random((runs, steps))), math.log(arl), math.log(arl) + CAP_DECADES * LN10, bets.log_weights
    )
    tau = np.where(on.any(axis=1), on.argmax(axis=1) + 1, steps)
    assert tau.mean() - Z * tau.std() / math.sqrt(runs) >= arl, tau.mean()
    m = int(arl // 2)
    early = (tau <= m).mean()
    assert early <= (m + 1) / arl + Z * math.sqrt(0.5 * 0.5 / runs), early


def test_a_stake_is_cut_so_that_no_input_pays_more_than_the_cap():
    bets = TailBets.fit(np.random.default_rng(12).random(2000), 0.01)
    assert np.exp(bets.max_log_e).max() <= MAX_PAYOFF + 1e-9
    assert sum(bets.weights) == pytest.approx(1.0) and len(bets.stakes) == len(bets.members) == len(bets.weights)
    cut = TailBets.fit(np.arange(2000.0), 0.01, [((0.02,), 0.9), ((0.02,), 0.5)])  # both cut to the same stake
    assert len(cut.stakes) == 1 and cut.weights == (1.0,)  # merged, weights summed
    assert math.exp(cut.max_log_e[0]) == pytest.approx(MAX_PAYOFF)
    with pytest.raises(ValueError, match="max_payoff"):
        TailBets.fit(np.arange(100.0), 0.01, max_payoff=1.0)
    with pytest.raises(ValueError, match="weights must be finite"):
        TailBets.fit(np.arange(100.0), 0.01, [((0.1,), 0.5, 0.0)])


def test_the_change_point_is_where_the_shift_began():
    """After 1,000 ID inputs the scores move above the calibration 95th percentile in 60 % of the inputs: the episode's
    ``changed_at`` lies within 10 inputs of the true start in at least 80 % of 100 runs, and never after the alarm."""
    rng = np.random.default_rng(13)
    cal = rng.random(2000)
    close, runs = 0, 100
    for _ in range(runs):
        mon = DriftMonitor(cal, delta=0.01)
        shift = np.where(rng.random(300) < 0.6, 0.95 + 0.05 * rng.random(300), rng.random(300))
        stream = np.concatenate([rng.random(1000), shift])
        for lo in range(0, stream.size, 16):
            mon.update(stream[lo : lo + 16])
        ep = mon.episodes[0]
        assert ep.changed_at is not None and ep.changed_at <= ep.started_at
        close += abs(ep.changed_at - 1001) <= 10
    assert close >= 0.8 * runs, close
