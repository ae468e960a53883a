"""The guarantees checked by simulation on real model outputs: the default artifacts' probabilities and served OOD
scores on their own data splits (cached by ``benchmarks/cache_outputs.py`` in ``tests/fixtures/outputs``), split
at random into calibration and test again and again, as the draw of a calibration split would fall.

Each check states its Monte-Carlo tolerance: ``TOL`` standard errors of the simulated mean (the guarantees are
about means over the draw; a finite simulation estimates them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from offline.guarantees import drift_edges, grid_of, target_grid
from service.core.conformal import SetCalibrator, ood_p_values, selective_thresholds
from service.core.drift import DriftMonitor
from service.core.guarantees import outlier_oriented

OUTPUTS = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "outputs").glob("*.npz"))
TOL = 4.0  # standard errors of a simulated mean
SPLITS = 300  # random calibration / test splits per check


def _load(path: Path) -> dict:
    z = np.load(path)
    out = {"meta": json.loads(str(z["meta"]))}
    for key in z.files:
        if key != "meta":
            name, field = key.split("/")
            out.setdefault(name, {})[field] = z[key]
    return out


@pytest.fixture(params=OUTPUTS, ids=[p.stem for p in OUTPUTS], scope="module")
def outputs(request: pytest.FixtureRequest) -> dict:
    return _load(request.param)


def _pool(o: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ID inputs no fitting touched, exchangeable: the calibration split and ID test together."""
    cal, test = o["calibration"], o["test"]
    return (
        np.concatenate([cal["probs"], test["probs"]]).astype(np.float64),
        np.concatenate([cal["labels"], test["labels"]]),
        np.concatenate([cal["score"], test["score"]]),
    )


def _splits(n_total: int, n_cal: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(SPLITS):
        perm = rng.permutation(n_total)
        yield perm[:n_cal], perm[n_cal:]


def test_cached_outputs_exist():
    assert OUTPUTS, "tests/fixtures/outputs/*.npz: run benchmarks/cache_outputs.py on the default artifacts"


@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_marginal_coverage_over_calibration_draws(outputs, alpha):
    """Mean coverage over random splits lies in [1 - alpha, 1 - alpha + 1/(n + 1)], within Monte-Carlo error."""
    probs, y, _ = _pool(outputs)
    n = len(outputs["calibration"]["labels"]) // 2
    cov = []
    for cal, test in _splits(len(y), n):
        sets = SetCalibrator.fit(probs[cal], y[cal], "lac").sets(probs[test], alpha)
        cov.append(sets[np.arange(len(test)), y[test]].mean())
    mean, se = float(np.mean(cov)), float(np.std(cov) / np.sqrt(SPLITS))
    assert 1 - alpha - TOL * se <= mean <= 1 - alpha + 1 / (n + 1) + TOL * se, (mean, se)


def test_mondrian_coverage_per_class(outputs):
    probs, y, _ = _pool(outputs)
    n, alpha = len(outputs["calibration"]["labels"]) // 2, 0.1
    per_class = {c: [] for c in np.unique(y)}
    for cal, test in _splits(len(y), n, seed=1):
        sets = SetCalibrator.fit(probs[cal], y[cal], "aps").sets(probs[test], alpha, mondrian=True)
        hit = sets[np.arange(len(test)), y[test]]
        for c in per_class:
            per_class[c].append(hit[y[test] == c].mean())
    for c, cov in per_class.items():
        mean, se = float(np.mean(cov)), float(np.std(cov) / np.sqrt(SPLITS))
        assert mean >= 1 - alpha - TOL * se, (c, mean, se)


@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.1])
def test_ood_p_value_false_alarms(outputs, alpha):
    """The flag p_value <= alpha fires on at most alpha of in-distribution inputs (and not far below it)."""
    _, y, score = _pool(outputs)
    metric = outputs["meta"]["metric"]
    n = len(outputs["calibration"]["labels"]) // 2
    fa = []
    for cal, test in _splits(len(y), n, seed=2):
        p = ood_p_values(outlier_oriented(score[test], metric), np.sort(outlier_oriented(score[cal], metric)))
        fa.append((p <= alpha).mean())
    mean, se = float(np.mean(fa)), float(np.std(fa) / np.sqrt(SPLITS))
    assert alpha - 1 / (n + 1) - TOL * se <= mean <= alpha + TOL * se, (mean, se)


@pytest.mark.parametrize("eps", [0.05, 0.1])
def test_risk_rule_fails_on_at_most_delta_of_calibration_draws(outputs, eps):
    """The share of calibration draws whose certified rule has a test risk above eps is at most delta (+ MC)."""
    probs, y, score = _pool(outputs)
    val, metric, delta = outputs["val"], outputs["meta"]["metric"], 0.1
    cut = np.quantile(outlier_oriented(val["score"], metric), 0.95)  # the OOD cut, fixed on validation
    val_ok = outlier_oriented(val["score"], metric) <= cut
    val_conf = val["probs"].max(1)[val_ok]
    val_correct = (val["probs"].argmax(1) == val["labels"])[val_ok]
    n = len(y) // 2  # half the pool calibrates, the other half stands for the population the guarantee is about
    grid = target_grid(grid_of(val_conf), val_conf, val_correct, len(val["labels"]), n, eps, delta)
    eligible = outlier_oriented(score, metric) <= cut
    conf, correct = probs.max(1), probs.argmax(1) == y
    failures = certified = 0
    for cal, test in _splits(len(y), n, seed=3):
        (rule,) = selective_thresholds(conf[cal], correct[cal], [eps], delta, eligible=eligible[cal], grid=grid)
        if rule.threshold is None:
            continue
        certified += 1
        acc = eligible[test] & (conf[test] >= rule.threshold)
        failures += bool(acc.any() and (~correct[test][acc]).mean() > eps)
    bound = delta + TOL * np.sqrt(delta * (1 - delta) / SPLITS)
    # the rule must be certified on enough draws for the check to say something (a quarter; a failure needs one)
    assert certified >= SPLITS // 4 and failures / SPLITS <= bound, (certified, failures)


def test_drift_alarm_false_alarms_and_detection(outputs):
    """100 streams of 10,000 inputs resampled from ID test and validation: the alarm fires on at most delta of
    them (1 %, + MC); after a switch to an OOD set its flag catches 30 % of, it fires within 300 inputs."""
    cal, metric = outputs["calibration"], outputs["meta"]["metric"]
    ref = np.sort(outlier_oriented(cal["score"], metric))
    edges = drift_edges(outlier_oriented(outputs["val"]["score"], metric), 2048)
    pool = outlier_oriented(np.concatenate([outputs["test"]["score"], outputs["val"]["score"]]), metric)
    rng = np.random.default_rng(4)
    alarms = 0
    for k in range(100):
        mon = DriftMonitor(ref, delta=0.01, edges=edges, seed=k)
        mon.update(rng.choice(pool, 10_000))
        alarms += mon.alarm
    assert alarms <= 3, alarms  # delta = 1 %: 1 expected at most; 4 or more has probability < 2 % at delta
    p_cut = np.quantile(ref, 0.95)
    sets = {k[4:]: v for k, v in outputs.items() if k.startswith("ood:")}
    tested = 0
    for name, o in sets.items():
        scores = outlier_oriented(o["score"], metric)
        if (scores > p_cut).mean() < 0.3:
            continue  # the target covers OOD sets whose flag recall is at least 30 %
        tested += 1
        delays = []
        for k in range(20):
            mon = DriftMonitor(ref, delta=0.01, edges=edges, seed=100 + k)
            mon.update(rng.choice(pool, 2000))
            if mon.alarm:  # a false alarm before the switch: counted with the others, no delay to measure
                alarms += 1
                continue
            for _ in range(60):  # 600 OOD inputs, 10 at a time
                mon.update(rng.choice(scores, 10))
                if mon.alarm:
                    break
            delays.append(mon.alarm_at - 2000 if mon.alarm else 10**9)
        assert max(delays) <= 300, (name, delays)
    assert tested >= 1
    # every ID stream, both kinds: at most delta of them alarmed (+ 4 binomial standard errors)
    streams = 100 + 20 * tested
    assert alarms <= 0.01 * streams + 4 * np.sqrt(0.01 * 0.99 * streams), (alarms, streams)
