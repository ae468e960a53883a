"""The online accept rule (service/core/online_risk.py): its scale against scipy's percentile ranks, its start equal
to the certified rule, its closed form against the update written out, the deterministic bound on adversarial
streams, and on shifted streams of the default models' real outputs the error among accepted answers back at the
target where the certified rule misses it. The step ``GAMMA`` is chosen here on shifts made from the calibration and
validation splits; the test split and the OOD sets only check it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from service.core.online_risk import GAMMA, ConfidenceRanks, OnlineRisk
from service.core.selective import selective_thresholds
from tests.fixtures.cached_outputs import OUTPUT_IDS, OUTPUTS, load_outputs

RISK = 0.05


def test_ranks_are_scipys_weak_percentiles_and_the_threshold_is_the_same_rule():
    rng = np.random.default_rng(0)
    cal = np.sort(np.round(rng.random(300), 2))  # ties, as real confidences have after rounding
    ranks = ConfidenceRanks(cal)
    c = np.concatenate([rng.random(500), cal[:50], [0.0, 1.0]])
    want = np.array([stats.percentileofscore(cal, x, kind="weak") for x in c]) / 100 * 300 / 301
    np.testing.assert_allclose(ranks.rank(c), want, rtol=0, atol=1e-12)
    for level in np.concatenate([rng.random(200), [-0.1, 0.0, 299 / 301, 300 / 301, 1.0, 1.2]]):
        t = ranks.threshold(float(level))
        got = ranks.rank(c) >= level
        expected = np.zeros(c.shape, bool) if t is None else c >= t
        np.testing.assert_array_equal(got, expected, err_msg=f"level {level}")
    with pytest.raises(ValueError, match="ascending"):
        ConfidenceRanks(np.array([0.5, 0.4]))


@pytest.mark.parametrize("path", OUTPUTS, ids=OUTPUT_IDS)
def test_the_rule_starts_as_the_certified_rule(path):
    d = load_outputs(path)["calibration"]
    conf = d["probs"].max(1)
    ranks = ConfidenceRanks(np.sort(conf))
    for rule in selective_thresholds(conf, d["probs"].argmax(1) == d["labels"], [0.02, 0.05, 0.1], 0.1):
        online = OnlineRisk.starting_at(rule.eps, rule.threshold, ranks)
        want = conf >= rule.threshold if rule.threshold is not None else np.zeros(conf.shape, bool)
        np.testing.assert_array_equal(online.accepts(ranks.rank(conf)), want)


def _by_hand(u1: float, gamma: float, r: float, q: np.ndarray, wrong: np.ndarray) -> tuple[float, np.ndarray]:
    """The update written out: ``u <- u + gamma (wrong - r)`` after each accepted answer."""
    u, acc = u1, []
    for qi, wi in zip(q, wrong, strict=True):
        acc.append(qi >= u)
        if acc[-1]:
            u += gamma * (float(wi) - r)
    return u, np.array(acc)


def test_the_two_counts_are_the_update_written_out_whatever_the_batches():
    rng = np.random.default_rng(1)
    q, wrong = rng.random(3000), rng.random(3000) < 0.2
    u, acc = _by_hand(0.4, 0.1, RISK, q, wrong)
    rule = OnlineRisk(RISK, 0.4, 0.1)
    got = np.concatenate([rule.update(q[a:b], wrong[a:b]) for a, b in [(0, 1), (1, 700), (700, 2999), (2999, 3000)]])
    np.testing.assert_array_equal(got, acc)
    assert rule.level == pytest.approx(u, abs=1e-9) and rule.labelled == 3000
    assert (rule.accepted, rule.errors) == (int(acc.sum()), int(wrong[acc].sum()))
    back = OnlineRisk.from_state(rule.to_state())
    assert back == rule and back.level == rule.level


def _adversary(rule: OnlineRisk, steps: int, rng: np.random.Generator, mode: str) -> list[tuple[int, int, float]]:
    """Streams built against the rule: each next answer chosen from the rule's level now. ``greedy``: an answer just
    at the level, wrong whenever accepted; ``edge``: answers at the level, wrong at random 60 %; ``top``: answers at
    the top rank, wrong until the rule climbs above them, then one just below the level, right (to bring it back)."""
    out = []
    for _ in range(steps):
        u = rule.level
        if mode == "greedy":
            q, w = min(u, 0.999), True
        elif mode == "edge":
            q, w = min(max(u, 0.0), 0.999), bool(rng.random() < 0.6)
        else:
            q, w = (0.999, True) if u <= 0.999 else (0.999, False)
        rule.update([q], [w])
        out.append((rule.accepted, rule.errors, rule.bound(1)))
    return out


@pytest.mark.parametrize("mode", ["greedy", "edge", "top"])
@pytest.mark.parametrize("gamma", [0.02, GAMMA, 0.5])
def test_the_deterministic_bound_holds_against_adversaries(mode, gamma):
    rule = OnlineRisk(RISK, 0.3, gamma)
    trace = _adversary(rule, 5000, np.random.default_rng(2), mode)
    for n, k, bound in trace:
        if n:
            assert k / n - RISK <= bound + 1e-12
    assert rule.level <= 1 + gamma * (1 - RISK) + 1e-12  # the level never climbs past one step above the top


def test_the_bound_holds_on_random_streams_of_any_make_up():
    rng = np.random.default_rng(3)
    for s in range(200):
        rule = OnlineRisk(RISK, float(rng.random()), float(rng.choice([0.01, 0.1, 0.3])))
        t = int(rng.integers(1, 2000))
        p_wrong = rng.random(t) ** rng.uniform(0.2, 3)  # anything from mostly right to mostly wrong
        rule.update(rng.random(t) ** rng.uniform(0.2, 3), rng.random(t) < p_wrong, rng.random(t) < 0.9)
        if rule.accepted:
            assert rule.error_rate - RISK <= rule.bound(1) + 1e-12, s


def _streams(
    path, splits: tuple[str, ...], shift: str, n: int, streams: int, seed: int
) -> tuple[ConfidenceRanks, float, list[tuple[np.ndarray, np.ndarray]]]:
    """Shifted streams of ``n`` answers drawn from ``splits`` of a default model's cached outputs: ``(ranks of the
    calibration confidences, the certified threshold at RISK, [(confidences, wrong, eligible)])``, ``eligible``: the
    served OOD score within the rule's cut (as the build: 95 % of the validation split let through). ``hard``: 80 %
    of the answers from the third of the classes the model errs on most; ``errors4``: wrong answers four times as likely
    to be drawn; ``none``: as they are; ``ood:<set>``: 30 % of the answers from that OOD set (foreign: wrong)."""
    d = load_outputs(path)
    cal = d["calibration"]
    cal_conf = cal["probs"].max(1)
    cut = np.quantile(d["val"]["score"], 0.95)  # the scores are outlier-oriented (Mahalanobis)
    ok = cal["score"] <= cut
    (rule,) = selective_thresholds(cal_conf, cal["probs"].argmax(1) == cal["labels"], RISK, 0.1, eligible=ok)
    pool = {k: np.concatenate([d[s][k] for s in splits]) for k in ("probs", "labels", "score")}
    conf, wrong, elig = pool["probs"].max(1), pool["probs"].argmax(1) != pool["labels"], pool["score"] <= cut
    rng = np.random.default_rng(seed)
    if shift.startswith("ood:"):
        far, far_elig = d[shift]["probs"].max(1), d[shift]["score"] <= cut
        out = []
        for _ in range(streams):
            k = rng.random(n) < 0.3
            i, j = rng.integers(0, conf.size, n), rng.integers(0, far.size, n)
            out.append((np.where(k, far[j], conf[i]), np.where(k, True, wrong[i]), np.where(k, far_elig[j], elig[i])))
        return ConfidenceRanks(np.sort(cal_conf)), float(rule.threshold), out
    if shift == "hard":
        c = pool["probs"].shape[1]
        err = np.array([wrong[pool["labels"] == k].mean() for k in range(c)])
        hard = np.isin(pool["labels"], np.argsort(-err)[: max(1, c // 3)])
        w = np.where(hard, 0.8 / hard.sum(), 0.2 / max((~hard).sum(), 1))
    elif shift == "errors4":
        w = np.where(wrong, 4.0, 1.0)
    else:
        w = np.ones(conf.size)
    w = w / w.sum()
    out = [(conf[i], wrong[i], elig[i]) for i in (rng.choice(conf.size, n, p=w) for _ in range(streams))]
    return ConfidenceRanks(np.sort(cal_conf)), float(rule.threshold), out


def _run(ranks: ConfidenceRanks, lam: float, streams, gamma: float) -> dict[str, float]:
    online_err, online_acc, late_acc, fixed_err, fixed_acc = [], [], [], [], []
    for conf, wrong, eligible in streams:
        rule = OnlineRisk.starting_at(RISK, lam, ranks, gamma)
        acc = rule.update(ranks.rank(conf), wrong, eligible)
        online_err.append(rule.error_rate if rule.accepted else 0.0)
        online_acc.append(acc.mean())
        late_acc.append(acc[acc.size // 2 :].mean())
        fixed = (conf >= lam) & eligible
        fixed_err.append(wrong[fixed].mean())
        fixed_acc.append(fixed.mean())
    return {
        "online_error": float(np.mean(online_err)),
        "online_error_max": float(np.max(online_err)),
        "online_accept": float(np.mean(online_acc)),
        "online_accept_second_half": float(np.mean(late_acc)),
        "fixed_error": float(np.mean(fixed_err)),
        "fixed_accept": float(np.mean(fixed_acc)),
    }


@pytest.mark.parametrize("path", OUTPUTS, ids=OUTPUT_IDS)
def test_the_step_is_chosen_on_calibration_and_validation_shifts(path):
    """On shifts made from the calibration and validation outputs, 30 streams of 2,000 labels each: the default step
    brings the error among accepted answers within 2 points of the target on average, and to at most a third of the
    certified rule's excess (it misses by 5-8 points), without losing more than 5 points of accepts on unshifted
    streams; a step of a quarter of it leaves more excess, and one five times larger accepts fewer. (The excess left
    is the distance the level climbed over ``gamma N``: largest where few answers are accepted, as on the sentiment
    model's hardest class, 6 % of 2,000.)"""
    splits = ("calibration", "val")
    figures = {}
    for shift in ("hard", "errors4", "none"):
        ranks, lam, streams = _streams(path, splits, shift, 2000, 30, seed=4)
        figures[shift] = {g: _run(ranks, lam, streams, g) for g in (GAMMA / 4, GAMMA, GAMMA * 5)}
    for shift in ("hard", "errors4"):
        f = figures[shift][GAMMA]
        assert f["online_error"] <= RISK + 0.02, (shift, f)
        assert f["online_error"] - RISK <= (f["fixed_error"] - RISK) / 3, (shift, f)
        assert figures[shift][GAMMA / 4]["online_error"] >= f["online_error"] - 0.002
    assert figures["errors4"][GAMMA]["fixed_error"] > RISK + 0.04  # where the certified rule fails
    none = figures["none"][GAMMA]
    assert none["online_accept"] >= none["fixed_accept"] - 0.05 and none["online_error"] <= RISK + 0.005
    assert figures["errors4"][GAMMA * 5]["online_accept"] < figures["errors4"][GAMMA]["online_accept"]


@pytest.mark.parametrize("path", OUTPUTS, ids=OUTPUT_IDS)
def test_on_the_test_split_with_foreign_inputs_the_online_rule_holds_or_stops_accepting(path):
    """The check on data the step was not chosen on: the test split with 30 % of an OOD set's inputs (each foreign,
    so wrong), 20 streams of 2,000 labels, the rule's OOD cut applied. Where some confidence keeps the error among
    accepted answers within the target, the online rule's is within 1 point of it on average (2.5 in every stream)
    while the certified rule's is above it. Where none does (neutral tweets, which the sentiment model answers with its
    highest confidences), the rule climbs above every confidence and stops accepting: the error it made on the way up
    stays within its deterministic bound, and in the second half of each stream it accepts almost nothing."""
    d = load_outputs(path)
    held = 0
    for name in [k for k in d if k.startswith("ood:")]:
        ranks, lam, streams = _streams(path, ("test",), name, 2000, 20, seed=5)
        f = _run(ranks, lam, streams, GAMMA)
        if f["online_accept_second_half"] <= 0.005:  # it stopped
            assert f["online_accept"] > 0 and f["online_error_max"] < 0.5, (name, f)
            continue
        held += 1
        assert f["online_error"] <= RISK + 0.01 and f["online_error_max"] <= RISK + 0.025, (name, f)
    assert held >= 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="risk"):
        OnlineRisk(0.0, 0.5)
    with pytest.raises(ValueError, match="gamma"):
        OnlineRisk(RISK, 0.5, 0.0)
    with pytest.raises(ValueError, match="start"):
        OnlineRisk(RISK, 1.5)
    with pytest.raises(ValueError, match="errors <= accepted"):
        OnlineRisk(RISK, 0.5, labelled=3, accepted=1, errors=2)
    with pytest.raises(ValueError, match="lacks"):
        OnlineRisk.from_state({"risk": 0.05})
    with pytest.raises(ValueError, match="alike"):
        OnlineRisk(RISK, 0.5).update([0.5, 0.6], [True])
    assert OnlineRisk(RISK, 0.5).bound() == math.inf
    assert OnlineRisk.starting_at(RISK, None, ConfidenceRanks(np.array([0.5, 0.9]))).accepts([0.99]).tolist() == [False]
