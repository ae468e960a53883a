"""Conformal sets, OOD p-values and selective risk control (service/core/conformal.py).

Known answers, the same scores, quantiles and sets as MAPIE on the same probabilities, and the guarantees checked by
simulation. The simulations are seeded (the same numbers every run); each compares a Monte-Carlo mean with its bound
within 4 standard errors (estimated from the runs), so a correct implementation fails with probability ~3e-5 per
check while an off-by-one rank or a wrong p-value moves the mean by many standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mapie.classification import SplitConformalClassifier
from mapie.conformity_scores import APSConformityScore, RAPSConformityScore
from mapie.risk_control.methods import compute_hoeffding_bentkus_p_value
from safetensors.torch import load_file, save_file
from scipy.stats import beta, binom
from sklearn.base import BaseEstimator, ClassifierMixin

from service.core.conformal import (
    SCORES,
    SetCalibrator,
    binomial_cdf,
    binomial_p_value,
    conformal_quantile,
    hb_p_value,
    label_scores,
    min_accepted,
    min_alpha,
    ood_p_values,
    pac_rank,
    quantile_rank,
    selective_thresholds,
    true_label_scores,
)

Z = 4.0  # Monte-Carlo tolerance in standard errors (module docstring)


def _softmax_data(n: int, classes: int, seed: int, scale: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    """``n`` exchangeable (probs, label) pairs: softmax of Gaussian logits, the label drawn from those probs
    (a calibrated model), so every probability is well above 1e-8 and no two are equal."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, classes)) * scale
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    labels = (rng.random(n)[:, None] > np.cumsum(probs, 1)).sum(1).clip(max=classes - 1)
    return probs, labels


# ----------------------------------------------------------------------------- the quantile
def test_quantile_rank_known_answers():
    # n = 1: alpha = 1/2 is the smallest level with a finite qhat (the one score); below it, none
    assert quantile_rank(1, 0.5) == 1 and quantile_rank(1, 0.4999) == 2
    assert min_alpha(1) == 0.5 and min_alpha(9) == 0.1 and min_alpha(19) == 0.05
    # n = 2: ceil(3 (1 - alpha))
    assert [quantile_rank(2, a) for a in (1 / 3, 2 / 3, 0.3, 0.9)] == [2, 1, 3, 1]
    # n = 9: 0.1 = 1/10 is exactly the boundary (the max), 0.3 gives the 7th however 0.3 rounds in binary
    assert [quantile_rank(9, a) for a in (0.1, 0.2, 0.3, 0.5, 0.05, 0.95, 0.999)] == [9, 8, 7, 5, 10, 1, 1]
    # n = 19 and every alpha = k / 20: rank 20 - k, vectorised
    k = np.arange(1, 20)
    assert quantile_rank(19, k / 20).tolist() == (20 - k).tolist()
    assert quantile_rank(19, 0.04) == 20  # just below 1/20: no finite qhat
    # dyadic boundaries (exact in binary) and alpha next to 0 and 1
    assert [quantile_rank(3, a) for a in (0.25, 0.5, 0.75)] == [3, 2, 1]
    assert quantile_rank(1000, 1e-12) == 1001 and quantile_rank(1000, 1 - 1e-12) == 1
    # vectorised over n as well (the Mondrian case): ranks per class
    assert quantile_rank(np.array([0, 1, 2, 9]), 0.5).tolist() == [1, 1, 2, 5]


def test_conformal_quantile_known_answers():
    s = np.arange(1.0, 10.0)  # n = 9
    assert conformal_quantile(s, 0.1) == 9.0
    assert math.isinf(conformal_quantile(s, 0.09))  # alpha < 1/(n+1): every label
    assert conformal_quantile(s, 0.5) == 5.0 and conformal_quantile(s, 0.95) == 1.0
    np.testing.assert_array_equal(conformal_quantile(s, np.array([0.1, 0.2, 0.05])), [9.0, 8.0, np.inf])
    ties = np.array([1.0, 2.0, 2.0, 2.0, 5.0])  # n = 5: ranks 2..4 all give 2
    assert [conformal_quantile(ties, a) for a in (0.6, 0.5, 0.34, 1 / 6)] == [2.0, 2.0, 2.0, 5.0]
    assert conformal_quantile(np.array([3.0]), 0.5) == 3.0 and math.isinf(conformal_quantile(np.array([3.0]), 0.4))
    assert math.isinf(conformal_quantile(np.zeros(0), 0.5))  # no calibration point: no finite threshold


# ----------------------------------------------------------------------------- scores and sets
def test_scores_known_answers():
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    np.testing.assert_allclose(label_scores(p, "lac"), [[0.5, 0.7, 0.85, 0.95]])
    np.testing.assert_allclose(label_scores(p, "aps"), [[0.5, 0.8, 0.95, 1.0]])
    # RAPS, k_reg = 1, lam = 0.1: + 0.1 per rank beyond the first
    np.testing.assert_allclose(label_scores(p, "raps", k_reg=1, lam=0.1), [[0.5, 0.9, 1.15, 1.3]])
    np.testing.assert_allclose(label_scores(p, "raps", k_reg=3, lam=0.1), [[0.5, 0.8, 0.95, 1.1]])
    np.testing.assert_array_equal(label_scores(p, "raps", lam=0.0), label_scores(p, "aps"))
    # ties count together: the three 0.2s share the mass and the rank of the whole run (4), whatever their order
    t = np.array([[0.4, 0.2, 0.2, 0.2, 0.0]])
    np.testing.assert_allclose(label_scores(t, "aps"), [[0.4, 1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(label_scores(t, "raps", k_reg=1, lam=0.1), [[0.4, 1.3, 1.3, 1.3, 1.4]])
    np.testing.assert_array_equal(true_label_scores(t, np.array([2]), "aps"), [1.0])
    # torch input is accepted
    np.testing.assert_array_equal(label_scores(torch.tensor(p), "aps"), label_scores(p, "aps"))


# four calibration points: true-label scores lac [0.3, 0.7, 0.7, 0.6], aps [0.7, 0.9, 0.8, 0.8] (0.4 and 0.4 tie),
# raps (k_reg = 1, lam = 0.5) [0.7, 1.4, 1.3, 1.3]
CAL_P = np.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.4, 0.4, 0.2]])
CAL_Y = np.array([0, 1, 2, 0])
TEST_P = np.array([[0.55, 0.35, 0.10], [0.10, 0.85, 0.05]])


@pytest.mark.parametrize(
    ("method", "qhat", "sets"),
    [
        # alpha = 0.4, n = 4: rank ceil(5 * 0.6) = 3
        ("lac", 0.7, [[1, 1, 0], [0, 1, 0]]),  # scores [0.45 0.65 0.9], [0.9 0.15 0.95]
        ("aps", 0.8, [[1, 0, 0], [0, 0, 0]]),  # [0.55 0.9 1.0], [0.95 0.85 1.0]: the second set is empty
        ("raps", 1.3, [[1, 0, 0], [0, 1, 0]]),  # [0.55 1.4 2.0], [1.45 0.85 2.0]
    ],
)
def test_sets_known_answers(method: str, qhat: float, sets: list[list[int]]):
    cal = SetCalibrator.fit(CAL_P, CAL_Y, method, k_reg=1, lam=0.5)
    assert cal.qhat(0.4) == pytest.approx(qhat)
    np.testing.assert_array_equal(cal.sets(TEST_P, 0.4), np.array(sets, dtype=bool))
    assert cal.sets(TEST_P, 0.1).all()  # alpha < 1/5: qhat = inf, every label


def test_mondrian_known_answers():
    cal = SetCalibrator.fit(CAL_P, CAL_Y, "lac")
    np.testing.assert_array_equal(cal.class_counts, [2, 1, 1])
    np.testing.assert_allclose(cal.min_alpha(mondrian=True), [1 / 3, 1 / 2, 1 / 2])
    # alpha = 0.5: class 0 (scores 0.3, 0.6) rank ceil(3 * 0.5) = 2 -> 0.6; classes 1, 2 (one score each) rank 1
    np.testing.assert_allclose(cal.qhat(0.5, mondrian=True), [0.6, 0.7, 0.7])
    # alpha = 0.4: classes 1 and 2 need rank ceil(2 * 0.6) = 2 of 1 score: no finite threshold
    np.testing.assert_allclose(cal.qhat(0.4, mondrian=True), [0.6, np.inf, np.inf])
    # label j in iff its score <= qhat_j: [0.45 <= 0.6, 0.65 <= 0.7, 0.9 > 0.7]
    np.testing.assert_array_equal(cal.sets(TEST_P[:1], 0.5, mondrian=True), [[True, True, False]])


def test_calibrator_round_trip(tmp_path):
    probs, labels = _softmax_data(300, 7, seed=1)
    labels[labels == 5] = 4  # class 5 gets no calibration point: an empty segment
    for method in SCORES:
        cal = SetCalibrator.fit(probs, labels, method, k_reg=2, lam=0.05)
        assert cal.class_counts[5] == 0 and cal.class_counts.sum() == 300
        save_file(cal.to_tensors(), tmp_path / f"{method}.safetensors")
        back = SetCalibrator.from_tensors(load_file(tmp_path / f"{method}.safetensors"))
        assert (back.method, back.k_reg, back.lam) == (method, 2, 0.05)
        for alpha in (0.05, 0.1, 0.3):
            assert back.qhat(alpha) == cal.qhat(alpha)
            np.testing.assert_array_equal(back.qhat(alpha, mondrian=True), cal.qhat(alpha, mondrian=True))
            np.testing.assert_array_equal(back.sets(probs, alpha, mondrian=True), cal.sets(probs, alpha, True))
        assert math.isinf(cal.qhat(0.3, mondrian=True)[5])  # no point of class 5: its label is in every set
    tensors = cal.to_tensors()
    with pytest.raises(ValueError, match="lacks"):
        SetCalibrator.from_tensors({k: v for k, v in tensors.items() if not k.endswith("class_offsets")})
    bad = dict(tensors, **{"conformal.class_offsets": torch.tensor([0, 10, 5, 300])})
    with pytest.raises(ValueError, match="class_offsets must be"):
        SetCalibrator.from_tensors(bad)
    bad = dict(tensors, **{"conformal.scores": tensors["conformal.scores"].flip(0)})
    with pytest.raises(ValueError, match="sorted ascending"):
        SetCalibrator.from_tensors(bad)
    bad = dict(tensors, **{"conformal.class_scores": tensors["conformal.class_scores"][:-1]})
    with pytest.raises(ValueError, match="must both be"):
        SetCalibrator.from_tensors(bad)
    bad = dict(tensors, **{"conformal.method": torch.tensor(list(b"thr"), dtype=torch.uint8)})
    with pytest.raises(ValueError, match="unknown conformal score 'thr'"):
        SetCalibrator.from_tensors(bad)


# ----------------------------------------------------------------------------- the same numbers as MAPIE
class _Fixed(ClassifierMixin, BaseEstimator):
    """A prefit classifier whose predict_proba of input ``[i]`` is row ``i`` of fixed probabilities."""

    def __init__(self, probs: np.ndarray | None = None):
        self.probs = probs

    def fit(self, x, y):
        return self

    def predict_proba(self, x):
        return self.probs[np.asarray(x)[:, 0].astype(int)]

    def predict(self, x):
        return self.predict_proba(x).argmax(1)


def test_same_quantile_as_mapie():
    rng = np.random.default_rng(3)
    for n in (1, 2, 9, 19, 50, 997):
        scores = rng.random(n)[:, None]
        alphas = rng.uniform(min_alpha(n) + 1e-6, 0.999, size=20)  # random, so never on a rank boundary
        ref = APSConformityScore().get_conformity_score_quantiles(scores, alphas, cv="prefit")
        np.testing.assert_array_equal(conformal_quantile(np.sort(scores[:, 0]), alphas), ref)


def test_same_lac_sets_as_mapie():
    probs, y = _softmax_data(900, 6, seed=0)
    est = _Fixed(probs)
    est.classes_, est.n_features_in_ = np.arange(6), 1
    x = np.arange(900)[:, None]
    for alpha in (0.05, 0.1, 0.2):
        ref = SplitConformalClassifier(est, confidence_level=1 - alpha, conformity_score="lac", prefit=True)
        ref.conformalize(x[:500], y[:500])
        ours = SetCalibrator.fit(probs[:500], y[:500], "lac")
        np.testing.assert_array_equal(ref.conformity_scores.ravel(), true_label_scores(probs[:500], y[:500], "lac"))
        np.testing.assert_array_equal(ref.predict_set(x[500:])[1][:, :, 0], ours.sets(probs[500:], alpha))


@pytest.mark.parametrize(("method", "k_reg", "lam"), [("aps", 1, 0.0), ("raps", 2, 0.05), ("raps", 1, 0.3)])
def test_same_aps_raps_sets_as_mapie(method: str, k_reg: int, lam: float):
    """MAPIE's non-randomised APS/RAPS: its cumulated scores (``get_true_label_cumsum_proba``, regularised for
    RAPS with fixed ``k_star``, ``lambda_star``), its quantile, and its sets with ``include_last_label=False``.
    MAPIE never returns an empty set (it adds the most probable label); ours may be empty, and otherwise equal."""
    probs, y = _softmax_data(900, 6, seed=0)
    cal, test = slice(0, 500), slice(500, 900)
    top = np.arange(6) == probs[test].argmax(1)[:, None]
    for alpha in (0.05, 0.1, 0.2):
        cumsum, rank = APSConformityScore.get_true_label_cumsum_proba(y[cal], probs[cal], np.arange(6))
        if method == "aps":
            ref, ref_scores = APSConformityScore(), cumsum
        else:
            ref = RAPSConformityScore()
            ref_scores = RAPSConformityScore._regularize_conformity_score(np.array([k_reg]), lam, cumsum, rank)[:, :, 0]
            ref.k_star, ref.lambda_star = np.array([k_reg]), lam
        ref.classes = np.arange(6)
        # MAPIE's RAPS would re-fit k_star and lambda_star on a split of its own here; its quantile is APS's
        ref.quantiles_ = APSConformityScore().get_conformity_score_quantiles(ref_scores, np.array([alpha]), cv="prefit")
        ref_sets = ref.get_prediction_sets(
            probs[test][:, :, None], ref_scores, np.array([alpha]), cv="prefit", include_last_label=False
        )[:, :, 0]
        ours = SetCalibrator.fit(probs[cal], y[cal], method, k_reg=k_reg, lam=lam)
        np.testing.assert_array_equal(ref_scores.ravel(), true_label_scores(probs[cal], y[cal], method, k_reg, lam))
        assert ours.qhat(alpha) == ref.quantiles_[0]
        mine = ours.sets(probs[test], alpha)
        empty = ~mine.any(1)
        np.testing.assert_array_equal(mine[~empty], ref_sets[~empty])
        np.testing.assert_array_equal(ref_sets[empty], top[empty])


# ----------------------------------------------------------------------------- coverage by simulation
def _split_coverages(scores: np.ndarray, n_cal: int, alpha: float, splits: int, seed: int) -> np.ndarray:
    """Per random calibration/test split of a pool of true-label scores, the test coverage ``mean(s <= qhat)``."""
    rng = np.random.default_rng(seed)
    out = np.empty(splits)
    for i in range(splits):
        perm = rng.permutation(scores.shape[0])
        q = conformal_quantile(np.sort(scores[perm[:n_cal]]), alpha)
        out[i] = np.mean(scores[perm[n_cal:]] <= q)
    return out


@pytest.mark.parametrize("method", SCORES)
def test_marginal_coverage_by_simulation(method: str):
    """Over random splits of one pool the mean coverage lies in [1 - alpha, 1 - alpha + 1/(n + 1)] (exactly, given
    the pool: a random split is exchangeable), up to the Monte-Carlo error of the mean over splits."""
    probs, y = _softmax_data(1500, 8, seed=11)
    scores = true_label_scores(probs, y, method, k_reg=2, lam=0.05)
    cal = SetCalibrator.fit(probs[:500], y[:500], method, k_reg=2, lam=0.05)
    # y in C(x) iff s(x, y) <= qhat: the simulation below may use the true-label scores alone
    np.testing.assert_array_equal(cal.sets(probs[500:], 0.1)[np.arange(1000), y[500:]], scores[500:] <= cal.qhat(0.1))
    n = 500
    for alpha in (0.05, 0.1, 0.2):
        cov = _split_coverages(scores, n, alpha, splits=1000, seed=12)
        se = cov.std(ddof=1) / math.sqrt(cov.size)
        assert 1 - alpha - Z * se <= cov.mean() <= 1 - alpha + 1 / (n + 1) + Z * se, (alpha, cov.mean(), se)


def test_mondrian_class_coverage_by_simulation():
    probs, y = _softmax_data(1500, 4, seed=21)
    rng = np.random.default_rng(22)
    alpha, splits = 0.1, 300
    cov = np.full((splits, 4), np.nan)
    for i in range(splits):
        perm = rng.permutation(1500)
        cal, test = perm[:500], perm[500:]
        sets = SetCalibrator.fit(probs[cal], y[cal], "aps").sets(probs[test], alpha, mondrian=True)
        hit = sets[np.arange(test.size), y[test]]
        for j in range(4):
            cov[i, j] = hit[y[test] == j].mean()
    mean, se = cov.mean(0), cov.std(0, ddof=1) / math.sqrt(splits)
    assert np.all(mean >= 1 - alpha - Z * se), (mean, se)


# ----------------------------------------------------------------------------- training-conditional (PAC) sets
@pytest.mark.parametrize("alpha, delta", [(0.1, 0.1), (0.05, 0.1), (0.2, 0.05), (0.01, 0.5), (0.3, 0.01)])
def test_pac_rank_is_one_above_scipys_binomial_quantile(alpha: float, delta: float):
    """``pac_rank(n) = 1 + binom.ppf(1 - delta, n, 1 - alpha)`` (scipy's quantile), ``n + 1`` where even the
    largest score fails; and the rank where the order statistic's coverage ``Beta(k, n + 1 - k)`` (scipy) first
    has at most ``delta`` of its mass below ``1 - alpha``."""
    ns = np.array([1, 2, 5, 10, 22, 59, 100, 333, 1000, 2000])
    got = np.asarray(pac_rank(ns, alpha, delta))
    want = np.minimum(binom.ppf(1 - delta, ns, 1 - alpha).astype(np.int64) + 1, ns + 1)
    np.testing.assert_array_equal(got, want)
    for n, k in zip(ns.tolist(), got.tolist(), strict=True):
        if k <= n:
            assert beta.cdf(1 - alpha, k, n + 1 - k) <= delta + 1e-12
        if 1 < k <= n + 1:  # one rank lower is not enough
            assert beta.cdf(1 - alpha, k - 1, n + 2 - k) > delta - 1e-12
        assert k >= quantile_rank(n, alpha) or delta >= 0.5  # never below the marginal rank at delta < 1/2
    assert pac_rank(2000, 0.1, 0.1) == 1818 and quantile_rank(2000, 0.1) == 1801  # docs/api.md's example
    # docs/api.md: with the marginal rank one calibration draw in ten covers 89.1 % or less (n 2000, alpha 0.1)
    assert beta.ppf(0.1, 1801, 2001 - 1801) == pytest.approx(0.891, abs=5e-4)
    assert pac_rank(0, 0.1, 0.1) == 1  # no scores: no finite threshold


def test_pac_min_alpha_is_where_the_rank_first_fits():
    """``min_alpha`` with ``delta`` is ``1 - delta^(1/n)``: just above it the rank is at most ``n``, just below
    it ``n + 1`` (every label)."""
    for n in (1, 7, 60, 300, 2000):
        cal = SetCalibrator("lac", 1, 0.01, np.linspace(0, 1, n), np.linspace(0, 1, n), np.array([0, n]), 0.1)
        m = float(cal.min_alpha())
        assert m == pytest.approx(1 - 0.1 ** (1 / n))
        assert pac_rank(n, m * 1.001, 0.1) <= n and pac_rank(n, m * 0.999, 0.1) == n + 1
        assert math.isfinite(cal.qhat(m * 1.001)) and cal.qhat(m * 0.999) == math.inf
        assert cal.min_alpha(mondrian=True) == pytest.approx([m])


def test_training_conditional_coverage_by_simulation():
    """The PAC guarantee, over many calibration draws: with continuous scores ``U(0, 1)`` the coverage of the sets
    given the split is ``qhat`` itself, so each draw's coverage is exact. With ``delta = 0.1`` at most 10 % of
    draws cover less than ``1 - alpha`` (up to Monte-Carlo error); with the marginal rank about half of them do,
    which is what the training-conditional rank is for. Mondrian sets hold it for each class."""
    rng = np.random.default_rng(31)
    n, alpha, delta, draws = 500, 0.1, 0.1, 4000
    u = np.sort(rng.random((draws, n)), axis=1)
    short_pac = np.empty(draws, dtype=bool)
    short_marginal = np.empty(draws, dtype=bool)
    for i in range(draws):
        cal = SetCalibrator("lac", 1, 0.01, u[i], u[i], np.array([0, n]), delta)
        short_pac[i] = cal.qhat(alpha) < 1 - alpha
        short_marginal[i] = cal.qhat(alpha, marginal=True) < 1 - alpha
    se = math.sqrt(delta * (1 - delta) / draws)
    assert short_pac.mean() <= delta + Z * se, short_pac.mean()
    assert short_pac.mean() >= delta - 0.05  # not needlessly conservative: the rank is the smallest that holds
    assert short_marginal.mean() > 0.4, short_marginal.mean()
    # Mondrian: two classes of 300 and 200 scores, each at level delta
    offsets = np.array([0, 300, 500])
    short = np.zeros(2)
    for _ in range(1000):
        a, b = np.sort(rng.random(300)), np.sort(rng.random(200))
        cal = SetCalibrator("lac", 1, 0.01, np.sort(np.r_[a, b]), np.r_[a, b], offsets, delta)
        short += np.asarray(cal.qhat(alpha, mondrian=True)) < 1 - alpha
    assert np.all(short / 1000 <= delta + Z * math.sqrt(delta * (1 - delta) / 1000)), short / 1000


def test_pac_sets_on_real_scores_cover_at_least_the_marginal_ones():
    """On a model's probabilities the PAC threshold is the ``pac_rank``-th smallest calibration score, so its sets
    contain the marginal ones; the calibrator fitted with ``delta`` and one rebuilt from its tensors (the delta
    from the manifest) give the same sets."""
    probs, y = _softmax_data(1500, 8, seed=41)
    pac = SetCalibrator.fit(probs[:1000], y[:1000], "aps", delta=0.1)
    marginal = SetCalibrator.fit(probs[:1000], y[:1000], "aps")
    assert pac.qhat(0.1) == pac.scores[pac_rank(1000, 0.1, 0.1) - 1] >= marginal.qhat(0.1)
    big, small = pac.sets(probs[1000:], 0.1), marginal.sets(probs[1000:], 0.1)
    assert np.all(big >= small) and big.sum() > small.sum()
    back = SetCalibrator.from_tensors(pac.to_tensors(), delta=0.1)
    np.testing.assert_array_equal(back.sets(probs[1000:], 0.1, mondrian=True), pac.sets(probs[1000:], 0.1, True))
    with pytest.raises(ValueError, match="delta"):
        SetCalibrator.fit(probs[:10], y[:10], "lac", delta=1.0)


# ----------------------------------------------------------------------------- OOD p-values
def test_ood_p_values_known_answers():
    cal = np.array([1.0, 2.0, 2.0, 3.0])  # n = 5 - 1
    p = ood_p_values(np.array([0.0, 1.0, 2.0, 2.5, 3.0, 4.0, np.nan]), cal)
    # (1 + #{cal >= s}) / 5: ties count as at least as extreme
    np.testing.assert_allclose(p[:-1], [1.0, 1.0, 0.8, 0.4, 0.4, 0.2])
    assert np.isnan(p[-1])
    np.testing.assert_array_equal(ood_p_values(np.array([-np.inf, np.inf]), cal), [1.0, 0.2])
    np.testing.assert_array_equal(ood_p_values(np.array([7.0]), np.zeros(0)), [1.0])


def test_ood_false_alarm_rate_by_simulation():
    """For continuous ID scores ``P(p <= a) = floor(a (n + 1)) / (n + 1)`` exactly: 0.05, 0.1, 0.2 at n = 99."""
    rng = np.random.default_rng(31)
    draws, tests, n = 2000, 50, 99
    flags = {a: np.empty(draws) for a in (0.05, 0.1, 0.2)}
    for i in range(draws):
        p = ood_p_values(rng.normal(size=tests), np.sort(rng.normal(size=n)))
        for a in flags:
            flags[a][i] = np.mean(p <= a)
    for a, f in flags.items():
        se = f.std(ddof=1) / math.sqrt(draws)
        assert abs(f.mean() - a) <= Z * se, (a, f.mean(), se)


# ----------------------------------------------------------------------------- binomial tails and LTT p-values
def test_binomial_cdf_matches_scipy():
    rng = np.random.default_rng(41)
    for n in (1, 2, 7, 50, 1000, 30000):
        k = np.arange(-1, n + 2) if n <= 1000 else rng.integers(0, n + 1, 500)
        for p in (0.01, 0.1, 0.5, 0.93):
            ref = binom.cdf(k, n, p)
            np.testing.assert_allclose(binomial_cdf(k, n, p), ref, rtol=1e-10, atol=1e-14)
    assert binomial_cdf(0, 0, 0.3) == 1.0  # n = 0: nothing can go wrong
    np.testing.assert_allclose(binomial_p_value([0, 3], [20, 20], 0.3), binom.cdf([0, 3], 20, 0.3), rtol=1e-12)


def test_hb_p_value_matches_the_formula_and_mapie():
    for n, eps in ((20, 0.3), (50, 0.2), (400, 0.05)):
        k = np.arange(0, n + 1)
        r = k / n
        a = np.minimum(r, eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = np.where(a > 0, a * np.log(a / eps), 0.0) + (1 - a) * np.log((1 - a) / (1 - eps))
        direct = np.minimum(np.exp(-n * h), math.e * binom.cdf(k, n, eps))
        np.testing.assert_allclose(hb_p_value(k, n, eps), direct, rtol=1e-10, atol=1e-300)
        exact = np.ceil(n * r) == k  # where MAPIE's ceil(n * (k / n)) gives k back in floats
        mapie = compute_hoeffding_bentkus_p_value(r, n, eps)[:, 0]
        np.testing.assert_allclose(hb_p_value(k, n, eps)[exact], np.minimum(mapie[exact], 1.0), rtol=1e-10)
    assert hb_p_value(0, 0, 0.1) == 1.0
    # at k = 0 both p-values are (1 - eps)^n, so both reject from the same number of points on
    assert hb_p_value(0, 30, 0.1) == pytest.approx(0.9**30) and binomial_p_value(0, 30, 0.1) == pytest.approx(0.9**30)
    assert min_accepted(0.1, 0.1) == 22 and 0.9**22 <= 0.1 < 0.9**21
    assert min_accepted(0.35, 0.2) == 4 and min_accepted(0.05, 0.1) == 45


# ----------------------------------------------------------------------------- selective risk (LTT)
# 20 calibration points, confidences 1.00, 0.99, ..., 0.81, errors at ranks 7, 13, 16..20. Errors among the top j
# and the binomial p-values P(Binom(j, 0.35) <= k) (scipy):
#   j  4: 0 0.1785   5: 0 0.1160   6: 0 0.0754   7: 1 0.2338   8: 1 0.1691  ...  12: 1 0.0424
#   13: 2 0.1132    14: 2 0.0839  15: 2 0.0617  16: 3 0.1339  17: 4 0.2348   18: 5 0.3550
LTT_CONF = np.round(1.0 - 0.01 * np.arange(20), 2)
LTT_ERR = np.isin(np.arange(20), [6, 12, 15, 16, 17, 18, 19])


def test_ltt_known_answers():
    # delta = 0.2: min_accepted(0.35, 0.2) = 4; the top 4, 5, 6 are rejected, the top 7 (0.2338) ends the sequence,
    # although the top 8..15 would pass on their own: fixed-sequence testing never skips a failure
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, 0.35, delta=0.2)
    assert (r.threshold, r.n_accepted, r.accept_rate, r.risk, r.tested) == (0.95, 6, 0.3, 0.0, 4)
    assert r.p_value == pytest.approx(binom.cdf(0, 6, 0.35))
    # delta = 0.25: every top-j up to 17 passes (the worst, 0.2348), the top 18 (0.3550) ends it
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, [0.35], delta=0.25)
    assert (r.threshold, r.n_accepted, r.risk, r.tested) == (0.84, 17, 4 / 17, 15)
    assert r.p_value == pytest.approx(binom.cdf(4, 17, 0.35))
    # the same by an independent reading of the rule
    ks = np.cumsum(LTT_ERR)
    for eps, delta in ((0.35, 0.25), (0.3, 0.2), (0.5, 0.05), (0.2, 0.2)):
        start = min_accepted(eps, delta)
        j = start - 1
        while j < 20 and binom.cdf(ks[j], j + 1, eps) <= delta:
            j += 1
        (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, eps, delta=delta)
        assert r.n_accepted == (j if j >= start else 0), (eps, delta)
        assert r.threshold == (LTT_CONF[j - 1] if j >= start else None)
    # Hoeffding-Bentkus: more conservative for 0/1 losses; the same sequence with its p-values
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, 0.35, delta=0.25, p_value="hb")
    j = 3
    while j < 20 and hb_p_value(ks[j], j + 1, 0.35) <= 0.25:
        j += 1
    assert r.n_accepted == j and r.threshold == LTT_CONF[j - 1]


def test_ltt_no_threshold_grid_and_eligibility():
    # eps = 0.1 at delta = 0.2 needs 16 error-free points; the top 16 hold 3 errors
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, 0.1, delta=0.2)
    assert r.threshold is None and r.n_accepted == 0 and r.accept_rate == 0.0 and math.isnan(r.risk)
    # a fixed grid: 0.97 (4 accepted, 0 errors, p 0.1785), 0.95 (6, 0, 0.0754), 0.90 (11, 1, 0.0606),
    # 0.85 (16, 3, 0.1339) pass; 0.80 (all 20, 7 errors, 0.6010) fails
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, 0.35, delta=0.25, grid=[0.8, 0.85, 0.9, 0.95, 0.97])
    assert (r.threshold, r.n_accepted, r.tested) == (0.85, 16, 5)
    # a grid that starts where too few points are accepted ends at once (the price of the model-free guarantee)
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, 0.35, delta=0.25, grid=[0.99, 0.9])
    assert r.threshold is None and r.tested == 1
    # ineligible inputs are never accepted but count in the accept rate: drop the error at rank 7
    eligible = np.arange(20) != 6
    (r,) = selective_thresholds(LTT_CONF, ~LTT_ERR, 0.35, delta=0.2, eligible=eligible)
    ks = np.cumsum(LTT_ERR[eligible])
    j = 3
    while j < 19 and binom.cdf(ks[j], j + 1, 0.35) <= 0.2:
        j += 1
    assert r.n_accepted == j and r.accept_rate == j / 20 and r.threshold == LTT_CONF[eligible][j - 1]
    # several targets at once, one rule each, in order
    rules = selective_thresholds(LTT_CONF, ~LTT_ERR, [0.1, 0.35, 0.5], delta=0.25)
    assert [x.eps for x in rules] == [0.1, 0.35, 0.5] and rules[0].threshold is None and rules[2].n_accepted == 20


@pytest.mark.parametrize("kind", ["binomial", "hb"])
def test_ltt_risk_guarantee_by_simulation(kind: str):
    """Confidence ~ U(0, 1) and P(error | conf) = 0.4 (1 - conf): the selective risk of "conf >= lam" is
    R(lam) = 0.2 (1 - lam), within eps = 0.1 iff lam >= 0.5 (down-set, continuous: the default grid's conditions).
    Over calibration draws, P(R(lam_hat) > eps) <= delta = 0.1, for the data grid and for a fixed one."""
    rng = np.random.default_rng(51 if kind == "binomial" else 52)
    eps, delta, n, draws = 0.1, 0.1, 1000, 400
    grid = np.linspace(0.9, 0.3, 61)
    bad, bad_grid, accepted = np.zeros(draws), np.zeros(draws), np.zeros(draws)
    for i in range(draws):
        conf = rng.random(n)
        correct = rng.random(n) >= 0.4 * (1 - conf)
        (r,) = selective_thresholds(conf, correct, eps, delta, p_value=kind)
        (g,) = selective_thresholds(conf, correct, eps, delta, p_value=kind, grid=grid)
        bad[i] = r.threshold is not None and 0.2 * (1 - r.threshold) > eps
        bad_grid[i] = g.threshold is not None and 0.2 * (1 - g.threshold) > eps
        accepted[i] = r.accept_rate
    for b in (bad, bad_grid):
        assert b.mean() <= delta + Z * math.sqrt(delta * (1 - delta) / draws), b.mean()
    # and it has power: the oracle rule accepts 50 %, the certified ones about 29 % (binomial) at n = 1,000
    assert accepted.mean() > 0.2, accepted.mean()


# ----------------------------------------------------------------------------- validation
def test_invalid_inputs_are_rejected():
    probs, y = _softmax_data(20, 3, seed=0)
    cal = SetCalibrator.fit(probs, y, "aps")
    for alpha in (0.0, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
            cal.sets(probs, alpha)
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
            conformal_quantile(np.arange(3.0), alpha)
    with pytest.raises(ValueError, match="one number"):
        cal.qhat(np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="unknown conformal score 'thr'"):
        label_scores(probs, "thr")
    with pytest.raises(ValueError, match="k_reg must be"):
        label_scores(probs, "raps", k_reg=-1)
    with pytest.raises(ValueError, match="lam must be"):
        label_scores(probs, "raps", lam=-0.5)
    with pytest.raises(ValueError, match=r"labels must be \(N,\) = \(20,\)"):
        SetCalibrator.fit(probs, y[:-1])
    with pytest.raises(ValueError, match=r"labels must be integers in \[0, 3\)"):
        SetCalibrator.fit(probs, y + 1)
    with pytest.raises(ValueError, match=r"probs must be \(N, C\)"):
        label_scores(probs[0])
    with pytest.raises(ValueError, match="finite and non-negative"):
        label_scores(probs - 1.0)
    with pytest.raises(ValueError, match="probs have 4 classes, the calibrator 3"):
        cal.sets(np.full((2, 4), 0.25), 0.1)
    with pytest.raises(ValueError, match="at least one calibration point"):
        SetCalibrator.fit(np.zeros((0, 3)), np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match=r"scores \(B,\) and sorted_cal \(n,\)"):
        ood_p_values(np.zeros((2, 2)), np.zeros(3))
    conf, ok = LTT_CONF, ~LTT_ERR
    with pytest.raises(ValueError, match=r"eps must be in \(0, 1\)"):
        selective_thresholds(conf, ok, [0.1, 1.2])
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        selective_thresholds(conf, ok, 0.1, delta=0.0)
    with pytest.raises(ValueError, match="unknown p_value 'wsr'"):
        selective_thresholds(conf, ok, 0.1, p_value="wsr")
    with pytest.raises(ValueError, match="must both be"):
        selective_thresholds(conf, ok[:-1], 0.1)
    with pytest.raises(ValueError, match="correct must be bool"):
        selective_thresholds(conf, ok.astype(int), 0.1)
    with pytest.raises(ValueError, match="eligible must be a bool"):
        selective_thresholds(conf, ok, 0.1, eligible=np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="min_accept must be"):
        selective_thresholds(conf, ok, 0.1, min_accept=-2)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\)"):
        binomial_cdf(1, 5, 1.0)
