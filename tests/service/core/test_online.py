"""Online statistics (service/core/online.py): known answers, cross-checks against maintained libraries (scipy's
Wilson and Clopper-Pearson intervals, MAPIE 1.6's ACI update and risk monitor), the guarantees on adversarial
sequences, and simulations on the default artifacts' real outputs (``tests/fixtures/outputs``, as in
``tests/service/test_guarantees_simulation.py``).

The streams: the calibration split and the ID test split of a fixture are pooled (ID inputs no fitting touched), and
each run draws 1,000 of them as its calibration split and resamples its stream from the rest, as a deployment would
fall. The shift: a harder class mix, each answer drawn from the class the model gets wrong most often (Shirt for the
image model, positive for the text one) with probability ``w`` and from the whole pool otherwise, ``w`` set so that
the expected accuracy is 10 points below the run's calibration split's (real inputs with their real labels: the
labels stay inside the model's, so the sets can cover them). Simulations are seeded: the same numbers every run.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict

import numpy as np
import pytest
from mapie.exchangeability_testing import RiskMonitoring
from mapie.regression import TimeSeriesRegressor
from scipy.stats import beta, binomtest
from sklearn.linear_model import LinearRegression

from service.core.conformal import SetCalibrator
from service.core.online import (
    AdaptiveConformal,
    Counts,
    HarmfulShiftAlarm,
    QualityWindow,
    clopper_pearson_upper,
    estimate_figure,
    quality,
    raw_misses,
    shift_log_statistic,
    wilson_interval,
)
from tests.fixtures.cached_outputs import OUTPUT_IDS, OUTPUTS, load_outputs

N_CAL = 1000  # calibration labels per run


@pytest.fixture(params=OUTPUTS, ids=OUTPUT_IDS, scope="module")
def pool(request: pytest.FixtureRequest) -> tuple[np.ndarray, np.ndarray]:
    """``(probs (N, C) float64, labels (N,))``: the calibration and ID test splits together."""
    o = load_outputs(request.param)
    cal, test = o["calibration"], o["test"]
    return np.concatenate([cal["probs"], test["probs"]]).astype(np.float64), np.concatenate(
        [cal["labels"], test["labels"]]
    )


def _split(n: int, seed: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    return rng, perm[:N_CAL], perm[N_CAL:]


def _harder_mix(correct, labels, rest, target, size, rng) -> np.ndarray:
    """``size`` answers from ``rest``: the class with the lowest accuracy with probability ``w``, else the whole of
    ``rest``, ``w`` such that the expected accuracy is ``target``."""
    acc = np.array([correct[rest][labels[rest] == c].mean() for c in np.unique(labels)])
    hard = rest[labels[rest] == acc.argmin()]
    w = (correct[rest].mean() - target) / (correct[rest].mean() - acc.min())
    assert 0 < w < 1, w
    return np.where(rng.random(size) < w, rng.choice(hard, size), rng.choice(rest, size))


# ----------------------------------------------------------------------------- intervals
def test_wilson_known_answers_and_scipy():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    # 5 of 10 at 95 %: centre 0.5, half-width 1.96 / 1.38416 * sqrt(0.025 + 0.009604) = 0.26341
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.23659, abs=1e-5) and hi == pytest.approx(0.76341, abs=1e-5)
    for n in (1, 7, 50, 1000):
        for k in sorted({0, 1, n // 3, n - 1, n}):
            for level in (0.9, 0.95, 0.99):
                ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
                np.testing.assert_allclose(wilson_interval(k, n, level), (ci.low, ci.high), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(3, 2)


def test_clopper_pearson_upper_matches_scipy():
    for n in (1, 10, 200, 1000):
        for k in sorted({0, n // 5, n - 1}):
            for delta in (0.005, 0.025, 0.1):
                ours = clopper_pearson_upper(k, n, delta)
                assert ours == pytest.approx(beta.ppf(1 - delta, k + 1, n - k), abs=1e-9)
                # the upper end of scipy's exact two-sided interval at 1 - 2 delta is the same bound
                assert ours == pytest.approx(binomtest(k, n).proportion_ci(1 - 2 * delta, "exact").high, abs=1e-9)
    assert clopper_pearson_upper(0, 10, 0.05) == pytest.approx(1 - 0.05**0.1, abs=1e-9)  # (1 - U)^n = delta
    assert clopper_pearson_upper(7, 7, 0.05) == 1.0


# ----------------------------------------------------------------------------- adaptive conformal inference
def test_aci_known_answers():
    aci = AdaptiveConformal(0.1, gamma=0.05)
    assert aci.alpha_t == 0.1 and aci.miscoverage is None and aci.bound() == math.inf
    aci.update([True, False, False])
    assert aci.alpha_t == pytest.approx(0.1 + 0.05 * (0.1 - 1) + 2 * 0.05 * 0.1)  # 0.065
    assert aci.miscoverage == pytest.approx(1 / 3)
    assert aci.bound() == pytest.approx((0.9 + 0.05) / (0.05 * 3)) and aci.bound(4) == pytest.approx(1.1 / 0.15)
    np.testing.assert_array_equal(raw_misses([True, True, False], [False, True, False]), [False, True, True])
    back = AdaptiveConformal.from_state(json.loads(json.dumps(aci.to_state())))
    assert back == aci and back.alpha_t == aci.alpha_t


def test_aci_levels_give_the_split_conformal_sets():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(4), 300)
    cal = SetCalibrator.fit(probs[:200], rng.integers(0, 4, 200), "lac")
    test = probs[200:]
    aci = AdaptiveConformal(0.2)
    sets, filled, a = aci.sets(cal, test)
    raw = cal.sets(test, 0.2)
    assert a == 0.2 and np.array_equal(filled, ~raw.any(1))
    assert np.array_equal(sets[~filled], raw[~filled]) and np.all(sets[filled].sum(1) == 1)
    per_class, filled_m, _ = aci.sets(cal, test, mondrian=True)
    raw_m = cal.sets(test, 0.2, mondrian=True)
    assert np.array_equal(filled_m, ~raw_m.any(1)) and np.array_equal(per_class[~filled_m], raw_m[~filled_m])
    low = AdaptiveConformal(0.2, gamma=0.5, labelled=2, misses=2)  # alpha_t = 0.2 + 0.5 (0.4 - 2) < 0
    assert low.alpha_t < 0 and low.sets(cal, test)[0].all() and not low.sets(cal, test)[1].any()
    high = AdaptiveConformal(0.2, gamma=0.5, labelled=2, misses=0)  # alpha_t = 0.4; and after 8 more: 1.2 >= 1
    high.update([0] * 8)
    sets, filled, a = high.sets(cal, test)
    assert a >= 1 and filled.all() and np.array_equal(sets.argmax(1), test.argmax(1)) and np.all(sets.sum(1) == 1)
    assert np.all(np.isinf(high.qhat(cal, mondrian=True))) and high.qhat(cal) == -math.inf


def _mapie_aci(gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """MAPIE 1.6's ACI on a regression stream that turns noisier: ``(err_t (T,), its alpha_t after each (T,))``."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 1))
    y = 2 * x[:, 0] + rng.normal(size=500) * np.where(np.arange(500) < 300, 1.0, 2.5)
    mapie = TimeSeriesRegressor(LinearRegression().fit(x[:100], y[:100]), method="aci", cv="prefit")
    mapie.fit(x[100:200], y[100:200])
    errs, alphas = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(200, 500):
            _, pis = mapie.predict(x[i : i + 1], confidence_level=0.9, allow_infinite_bounds=True)
            errs.append(not (pis[0, 0, 0] < y[i] < pis[0, 1, 0]))  # MAPIE's own test: strictly inside
            mapie.adapt_conformal_inference(x[i : i + 1], y[i : i + 1], gamma=gamma, confidence_level=0.9)
            alphas.append(mapie.current_alpha[0.1])
    return np.array(errs), np.array(alphas)


def test_aci_update_rule_matches_mapie():
    """Fed MAPIE's own misses, our alpha_t is MAPIE's after every step; MAPIE clips alpha_t to [0, 1], we do not
    (the clip breaks the telescoping sum the bound rests on), so with a large step the two part at the first clip."""
    errs, theirs = _mapie_aci(0.01)
    ours = []
    aci = AdaptiveConformal(0.1, gamma=0.01)
    for e in errs:
        aci.update([e])
        ours.append(aci.alpha_t)
    assert 0 < theirs.min() and theirs.max() < 1 and errs.mean() > 0.1  # no clip; the shift made it miss more
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    errs, theirs = _mapie_aci(0.2)
    aci, ours = AdaptiveConformal(0.1, gamma=0.2), []
    for e in errs:
        aci.update([e])
        ours.append(aci.alpha_t)
    clip = int(np.flatnonzero((theirs == 0) | (theirs == 1))[0])
    np.testing.assert_allclose(ours[:clip], theirs[:clip], rtol=0, atol=1e-12)
    assert ours[clip] < 0 and ours[clip] == pytest.approx(theirs[clip - 1] + 0.2 * (0.1 - errs[clip]))
    # ours telescopes exactly: alpha_{T+1} - alpha_1 = gamma sum_t (alpha - err_t)
    assert ours[-1] - 0.1 == pytest.approx(0.2 * (0.1 * len(errs) - errs.sum()), abs=1e-9)


@pytest.mark.parametrize("delay", [1, 25])
def test_aci_bound_holds_on_adversarial_sequences(pool, delay):
    """An adversary picks each true label after seeing the set: outside it whenever it can, then inside it whenever
    it can, in alternating stretches of 400; the labels reach the tracker ``delay`` answers late. At every T the miss
    rate is within the stated bound of alpha, and alpha_t within the range the proof gives; late labels do push
    alpha_t past the range without delay (so the bound needs its delay term)."""
    probs, labels = pool
    rng, cal, rest = _split(len(labels), 0)
    calib = SetCalibrator.fit(probs[cal], labels[cal], "lac")
    alpha, gamma = 0.1, 0.02
    aci = AdaptiveConformal(alpha, gamma=gamma)
    waiting: list[bool] = []
    rates, bounds, levels = [], [], []
    for t, i in enumerate(rng.choice(rest, 3000)):
        sets, filled, level = aci.sets(calib, probs[i : i + 1])
        levels.append(level)
        raw = sets[0] & ~filled[0]
        attack = (t // 400) % 2 == 0  # it cannot miss a set of every label, nor hit an empty one
        waiting.append(not raw.all() if attack else not raw.any())
        if len(waiting) == delay:
            aci.update([waiting.pop(0)])
            rates.append(aci.miscoverage)
            bounds.append(aci.bound(delay))
    dev = np.abs(np.array(rates) - alpha)
    assert np.all(dev <= np.array(bounds) + 1e-12), float((dev - np.array(bounds)).max())
    assert -gamma * delay * (1 - alpha) - 1e-12 <= min(levels) and max(levels) <= 1 + gamma * delay * alpha + 1e-12
    assert (min(levels) < -gamma * (1 - alpha)) == (delay > 1), min(levels)


@pytest.fixture(scope="module")
def aci_runs(pool):
    """Three runs per fixture: 1,000 ID answers, then 5,000 of the harder class mix, each answer served a static
    split-conformal set at alpha = 0.1 and an adaptive one (default gamma), its label applied at once."""
    probs, labels = pool
    correct = probs.argmax(1) == labels
    runs = []
    for seed in range(3):
        rng, cal, rest = _split(len(labels), seed)
        calib = SetCalibrator.fit(probs[cal], labels[cal], "lac")
        target = correct[cal].mean() - 0.10
        idx = np.concatenate([rng.choice(rest, 1000), _harder_mix(correct, labels, rest, target, 5000, rng)])
        static = ~calib.sets(probs[idx], 0.1)[np.arange(len(idx)), labels[idx]]
        aci, adaptive = AdaptiveConformal(0.1), []
        for i in idx:
            sets, filled, _ = aci.sets(calib, probs[i : i + 1])
            miss = raw_misses(sets[:, labels[i]], filled)
            aci.update(miss)
            adaptive.append(bool(miss[0]))
        runs.append((static, np.array(adaptive), aci))
    return runs


def test_static_sets_under_cover_after_the_shift(aci_runs):
    for static, _, _ in aci_runs:
        assert abs(static[:1000].mean() - 0.1) < 0.035  # ID: about alpha (1,000 answers: 1 se = 0.95 points)
        assert static[1000:].mean() > 0.14  # measured 0.165 to 0.19


def test_adaptive_sets_keep_long_run_miscoverage_within_the_bound(aci_runs):
    for _, adaptive, aci in aci_runs:
        assert aci.labelled == 6000 and aci.miscoverage == pytest.approx(adaptive.mean())
        assert abs(adaptive.mean() - 0.1) <= aci.bound()  # (0.9 + 0.01) / (0.01 * 6000) = 0.0152: deterministic
        assert abs(adaptive[1000:].mean() - 0.1) < 0.015 and abs(adaptive[-2000:].mean() - 0.1) < 0.015


# ----------------------------------------------------------------------------- the harmful-shift alarm
def test_alarm_known_answer():
    g = lambda b: 1 / math.log(b + math.e - 1)  # the reserve before block b joins
    alarm = HarmfulShiftAlarm(0.5, tolerance=0.0, delta_test=0.01, bets=1, block=1)  # theta 0.5, lambda 1
    assert alarm.threshold == 0.5 and alarm.lambdas.tolist() == [1.0]
    alarm.update([1.0, 1.0])  # each loss of 1 multiplies a bet by 1 + 1 (1 - 0.5) = 1.5
    a1 = (g(1) - g(2)) * 1.5
    a2 = (a1 + g(2) - g(3)) * 1.5
    assert alarm.log_statistic == pytest.approx(math.log(a2 + g(3)), abs=1e-12)
    blocks = HarmfulShiftAlarm(0.5, tolerance=0.0, bets=1, block=2)  # block 2 joins at label 3 only
    blocks.update([1.0, 0.0, 1.0])  # 1.5, 0.5, 1.5
    b = (g(1) - g(2)) * 1.5 * 0.5
    b = (b + g(2) - g(3)) * 1.5
    assert blocks.log_statistic == pytest.approx(math.log(b + g(3)), abs=1e-12)
    assert alarm.risk == 1.0 and not alarm.alarm and alarm.labelled == 2


def test_alarm_batches_state_and_one_pass_agree():
    rng = np.random.default_rng(0)
    losses = (rng.random(3000) < np.where(np.arange(3000) < 1000, 0.15, 0.35)).astype(float)
    one = HarmfulShiftAlarm.from_errors(150, 1000)
    one.update(losses)
    many = HarmfulShiftAlarm.from_errors(150, 1000)
    for lo in range(0, 3000, 137):
        many.update(losses[lo : lo + 137])
        many = HarmfulShiftAlarm.from_state(json.loads(json.dumps(many.to_state(), allow_nan=False)))
    assert one.alarm and 1000 < one.alarm_at < 3000 and many.alarm_at == one.alarm_at
    assert many.log_statistic == pytest.approx(one.log_statistic, abs=1e-9)
    assert many.log_statistic_max == pytest.approx(one.log_statistic_max, abs=1e-9)
    one.reset()
    assert one.labelled == 0 and not one.alarm and one.log_statistic == 0.0


def test_alarm_statistic_is_a_test_martingale_at_theta():
    """Losses i.i.d. Bernoulli(theta), the boundary of the null: the statistic is a fair game, its mean exactly 1
    (over all 2^10 loss sequences, with blocks of 3 so that three blocks join), and it crosses 1 / delta on at most
    delta of 2,000 streams of 1,000 labels (Ville)."""
    theta, delta = 0.2, 0.05
    lam = 0.5 / theta * 2.0 ** -np.arange(6)
    every = ((np.arange(1024)[:, None] >> np.arange(10)) & 1).astype(float)  # (1024, 10): every 0/1 sequence
    log_m, _ = shift_log_statistic(every, theta, lam, np.full((1024, 6), -np.inf), 0, 3)
    prob = theta ** every.sum(1) * (1 - theta) ** (10 - every.sum(1))
    np.testing.assert_allclose(prob @ np.exp(log_m), np.ones(10), rtol=1e-12)
    rng = np.random.default_rng(1)
    losses = (rng.random((2000, 1000)) < theta).astype(float)
    log_m, _ = shift_log_statistic(losses, theta, lam, np.full((2000, 6), -np.inf), 0, 50)
    crossed = (log_m.max(axis=1) >= math.log(1 / delta)).mean()
    assert crossed <= delta + 4 * math.sqrt(delta * (1 - delta) / 2000), crossed


def test_alarm_false_alarms_on_id_streams(pool):
    """100 runs, each its own calibration split and 5,000 ID labels: the alarm fires on at most delta = 5 % of them
    (the guarantee; measured: none for the text model, 1 for the image model)."""
    probs, labels = pool
    correct = probs.argmax(1) == labels
    alarms = 0
    for seed in range(100):
        rng, cal, rest = _split(len(labels), seed)
        alarm = HarmfulShiftAlarm.from_errors(int((~correct[cal]).sum()), N_CAL)
        alarm.update(~correct[rng.choice(rest, 5000)])
        alarms += alarm.alarm
    assert alarms <= 5, alarms


@pytest.mark.parametrize("before", [1000, 10_000])
def test_alarm_fires_soon_after_accuracy_drops_ten_points(pool, before):
    """After ``before`` ID labels the accuracy drops 10 points below the calibration split's: the alarm fires within
    3,000 labels after 1,000 ID labels and 4,000 after 10,000 (20 runs each; measured over 40, at most 2,400 and
    3,400), never before the drop."""
    probs, labels = pool
    correct = probs.argmax(1) == labels
    delays = []
    for seed in range(20):
        rng, cal, rest = _split(len(labels), 100 + seed)
        alarm = HarmfulShiftAlarm.from_errors(int((~correct[cal]).sum()), N_CAL)
        alarm.update(~correct[rng.choice(rest, before)])
        assert not alarm.alarm
        alarm.update(~correct[_harder_mix(correct, labels, rest, correct[cal].mean() - 0.10, 5000, rng)])
        delays.append(alarm.alarm_at - before if alarm.alarm else math.inf)
    assert max(delays) <= (3000 if before == 1000 else 4000), sorted(delays)


def test_alarm_against_mapie_risk_monitoring(pool):
    """MAPIE 1.6's RiskMonitoring tests the same null at the same threshold (reference upper bound + absolute
    tolerance, delta in halves) with a lower confidence bound on the mean risk since the first label. Its Hoeffding
    reference bound is looser than the exact Clopper-Pearson one; on the same labels neither fires on ID traffic,
    and after the drop ours fires first (a bound on the mean since the first label dilutes a late change)."""
    probs, labels = pool
    correct = probs.argmax(1) == labels
    for seed in range(3):
        rng, cal, rest = _split(len(labels), 200 + seed)
        errors = int((~correct[cal]).sum())
        ours = HarmfulShiftAlarm.from_errors(errors, N_CAL, tolerance=0.02, delta=0.05)
        ref = RiskMonitoring("accuracy", test_level=0.05, tolerance=0.02, warn=False)
        ref.compute_threshold(labels[cal], probs[cal].argmax(1))
        assert errors / N_CAL < ours.source_upper < ref.reference_risk_upper_bound
        theirs = RiskMonitoring("accuracy", test_level=0.05, threshold=ours.threshold, warn=False)
        target = correct[cal].mean() - 0.10
        idx = np.concatenate([rng.choice(rest, 1000), _harder_mix(correct, labels, rest, target, 3000, rng)])
        ours.update(~correct[idx])
        theirs.update(labels[idx], probs[idx].argmax(1))
        lower = theirs.online_risk_lower_bound_sequence_history
        assert not (lower[:1000] > ours.threshold).any() and ours.alarm and ours.alarm_at > 1000
        crossed = np.flatnonzero(lower > ours.threshold)
        assert not crossed.size or crossed[0] + 1 > ours.alarm_at, (crossed[:1], ours.alarm_at)


# ----------------------------------------------------------------------------- quality figures
def test_quality_known_answers():
    w = QualityWindow(window=10)
    w.served([0.9, 0.6, 0.8, 0.5])
    # answers: right+covered+accepted, wrong+covered, wrong foreign flagged, right flagged (not foreign), wrong+accepted
    w.labelled(
        correct=[1, 0, 0, 1, 0],
        confidence=[0.9, 0.6, 0.8, 0.7, 0.5],
        flagged=[0, 0, 1, 1, 0],
        foreign=[0, 0, 1, 0, 0],
        covered=[1, 1, 0, 1, 0],
        accepted=[1, 0, 0, 0, 1],
    )
    q = w.overall()
    assert q == w.window() and q.labelled == 5 and q.served == 4
    assert (q.accuracy.value, q.accuracy.n) == (0.4, 5) and (q.accuracy.low, q.accuracy.high) == wilson_interval(2, 5)
    assert (q.coverage.value, q.accepted_error.value, q.accepted_error.n) == (0.6, 0.5, 2)
    assert (q.ood_precision.value, q.ood_precision.n, q.ood_recall.value, q.ood_recall.n) == (0.5, 2, 1.0, 1)
    assert q.estimated_accuracy.value == pytest.approx(0.7)
    half = 1.959964 * math.sqrt(0.09 + 0.24 + 0.16 + 0.25) / 4  # z sqrt(sum p (1 - p)) / n
    assert q.estimated_accuracy.value - q.estimated_accuracy.low == pytest.approx(half, abs=1e-6)
    assert q.estimated_accuracy.high == 1.0  # clipped
    assert q.estimated_on_labelled.value == pytest.approx(0.7) and q.estimate_error.value == pytest.approx(0.3)
    half = 1.959964 * math.sqrt(0.09 + 0.24 + 0.16 + 0.21 + 0.25) / 5
    assert q.estimate_error.high - q.estimate_error.value == pytest.approx(half, abs=1e-6)
    empty = QualityWindow().overall()
    assert empty.accuracy.value is None and empty.estimate_error.n == 0 and asdict(empty)["coverage"]["n"] == 0


def test_quality_window_holds_the_last_answers_and_round_trips():
    w = QualityWindow(window=3)
    w.served(np.linspace(0.5, 1.0, 7))
    w.labelled([1, 1, 0, 0, 0], [0.9] * 5, [0] * 5, [0] * 5)  # no sets served: no coverage
    assert w.window().accuracy.value == 0.0 and w.overall().accuracy.value == 0.4
    assert w.window().served == 3 and w.window().estimated_accuracy.value == pytest.approx(
        np.linspace(0.5, 1, 7)[-3:].mean()
    )
    assert w.overall().coverage.n == 0
    back = QualityWindow.from_state(json.loads(json.dumps(w.to_state(), allow_nan=False)))
    assert back.window() == w.window() and back.overall() == w.overall()
    for t in (w, back):
        t.labelled([1], [0.8], [1], [1], covered=[0])  # a foreign input flagged; inconsistent on purpose: counted as is
    assert back.window() == w.window() and back.overall() == w.overall()
    assert quality(Counts(labelled=1, correct=1, conf_sum=1.0)).estimate_error.value == 0.0
    assert estimate_figure(0.0, 0.0, 0).value is None


def test_label_free_estimate_on_id_streams(pool):
    """100 streams of 5,000 ID answers: the estimate (mean top-label probability) is within 3 points of the realised
    accuracy on every one (measured: at most 2.4 points for the image model, whose probabilities on this pool are
    1.1 points above its accuracy, the test file's part of it being a slightly different distribution; 1.8 for
    text), where the shifts below move it by 5 to 23. Its interval is for the sampling noise of calibrated
    probabilities: with outcomes drawn as Bernoulli(p) it holds the realised accuracy on about 95 % of streams;
    with the real labels, less often (the models' own miscalibration is wider than the interval's half-width at
    5,000 answers)."""
    probs, labels = pool
    correct = probs.argmax(1) == labels
    conf = probs.max(1)
    rng = np.random.default_rng(5)
    gaps, inside = [], 0
    for _ in range(100):
        idx = rng.choice(len(labels), 5000)
        est = estimate_figure(float(conf[idx].sum()), float((conf[idx] * (1 - conf[idx])).sum()), 5000)
        gaps.append(abs(est.value - correct[idx].mean()))
        inside += est.low <= (rng.random(5000) < conf[idx]).mean() <= est.high
    assert max(gaps) <= 0.03, max(gaps)
    assert inside >= 95 - 4 * math.sqrt(0.95 * 0.05 * 100), inside


def test_validation():
    with pytest.raises(ValueError, match="alpha"):
        AdaptiveConformal(0.0)
    with pytest.raises(ValueError, match="gamma"):
        AdaptiveConformal(0.1, gamma=1.0)
    with pytest.raises(ValueError, match="misses"):
        AdaptiveConformal(0.1).update([0, 2])
    with pytest.raises(ValueError, match="lacks"):
        AdaptiveConformal.from_state({"alpha": 0.1})
    with pytest.raises(ValueError, match="losses"):
        HarmfulShiftAlarm(0.2).update([0.5, float("nan")])
    with pytest.raises(ValueError, match="log capitals"):
        HarmfulShiftAlarm.from_state({**HarmfulShiftAlarm(0.2).to_state(), "log_capital": [0.0]})
    with pytest.raises(ValueError, match="window"):
        QualityWindow(window=0)
    with pytest.raises(ValueError, match="flagged"):
        QualityWindow().labelled([1], [0.5], [1, 0], [0])
    with pytest.raises(ValueError, match="confidence"):
        QualityWindow().served([1.5])
