"""Known answers for offline.method.ensemble_metrics, and agreement with scikit-learn and service.core.uncertainty."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from offline.method import ensemble_metrics as M
from service.core.uncertainty import summarize
from tests.offline.metric_keys import EVAL_OOD_SET_KEYS, EVAL_SCALAR_KEYS


def _two_class(conf: list[float], correct: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Probs (N, 1, 2) predicting class 0 with the given confidences; label 0 if correct else 1."""
    c = np.asarray(conf)
    probs = np.stack([c, 1 - c], axis=-1)[:, None, :]
    return probs, np.where(correct, 0, 1)


# ----------------------------------------------------------------------------- classification and calibration
def test_brier_scores_the_mean_prediction_not_the_members():
    # members [1, 0, 0] and [0.4, 0.4, 0.2]: mean prediction [0.7, 0.2, 0.1]
    probs = np.array([[[1.0, 0.0, 0.0], [0.4, 0.4, 0.2]]] * 2)  # (2, 2, 3)
    labels = np.array([0, 2])
    # label 0: 0.3² + 0.2² + 0.1² = 0.14; label 2: 0.7² + 0.2² + 0.9² = 1.34
    assert M.brier(probs, labels) == pytest.approx((0.14 + 1.34) / 2)
    # the members' mean Brier on the first input would be (0 + 0.36 + 0.16 + 0.04) / 2 = 0.28, not 0.14
    assert M.brier(probs[:1], labels[:1]) == pytest.approx(0.14)


def test_nll_and_accuracy_known_answers():
    probs = np.array([[[1.0, 0.0, 0.0], [0.4, 0.4, 0.2]]] * 2)  # mean [0.7, 0.2, 0.1]
    labels = np.array([0, 2])
    assert M.nll(probs, labels) == pytest.approx(-(math.log(0.7) + math.log(0.1)) / 2)
    assert M.accuracy(probs, labels) == 0.5
    # a zero probability on the true class is floored, not infinite
    assert math.isfinite(M.nll(np.array([[[1.0, 0.0]]]), np.array([1])))


def test_ece_zero_when_perfectly_calibrated():
    # 10 inputs at confidence 0.8 with 8 correct, 10 at 0.6 with 6 correct
    probs_a, y_a = _two_class([0.8] * 10, [True] * 8 + [False] * 2)
    probs_b, y_b = _two_class([0.62] * 10, [True] * 6 + [False] * 4)
    probs, labels = np.concatenate([probs_a, probs_b]), np.concatenate([y_a, y_b])
    assert M.ece(probs, labels) == pytest.approx(0.01, abs=1e-12)  # 0.5 · |0.6 − 0.62|
    probs_b, y_b = _two_class([0.7] * 10, [True] * 7 + [False] * 3)
    probs, labels = np.concatenate([probs_a, probs_b]), np.concatenate([y_a, y_b])
    assert M.ece(probs, labels) == pytest.approx(0.0, abs=1e-12)


def test_ece_and_aece_miscalibrated_known_answers():
    # 15 inputs at confidence 0.62, all correct; 15 at 0.9, all wrong.
    # Members (0.72, 0.52) average to 0.62 and (0.95, 0.85) to 0.9: scores use the mean prediction.
    conf = np.r_[np.full(15, 0.62), np.full(15, 0.9)]
    spread = np.r_[np.full(15, 0.1), np.full(15, 0.05)]
    members = np.stack([conf + spread, conf - spread], axis=1)  # (30, 2) confidence in class 0
    probs = np.stack([members, 1 - members], axis=-1)  # (30, 2, 2)
    labels = np.r_[np.zeros(15, int), np.ones(15, int)]
    # equal width: two filled bins of 15: |1 − 0.62| and |0 − 0.9|
    assert M.ece(probs, labels) == pytest.approx(0.5 * 0.38 + 0.5 * 0.9)
    # equal mass, 15 bins of 2: 7 bins (0.62, correct), 1 mixed bin (conf 0.76, acc 0.5), 7 bins (0.9, wrong)
    assert M.aece(probs, labels) == pytest.approx((14 * 0.38 + 2 * 0.26 + 14 * 0.9) / 30)


def test_calibration_bins_counts_and_edges():
    probs, labels = _two_class([0.55, 0.99, 1.0, 0.7], [True, True, False, True])
    b = M.calibration_bins(probs, labels)
    assert b["count"].sum() == 4 and len(b["count"]) == M.N_BINS
    assert b["count"][-1] == 2  # 0.99 and 1.0 fall in the last bin (14/15, 1]
    assert b["accuracy"][-1] == 0.5


# ----------------------------------------------------------------------------- uncertainty
def test_agreeing_members_have_zero_mutual_information():
    p = np.array([[[0.7, 0.2, 0.1]] * 3, [[0.1, 0.1, 0.8]] * 3])  # (2, 3, 3)
    u = M.uncertainty(p)
    np.testing.assert_allclose(u["mutual_information"], 0.0, atol=1e-6)
    np.testing.assert_allclose(u["disagreement"], 0.0)


def test_two_confident_disagreeing_members_have_mi_ln2():
    p = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # (1, 2, 2)
    u = M.uncertainty(p)
    assert u["mutual_information"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert u["entropy"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert u["disagreement"][0] == 0.5


def test_uncertainty_matches_service_summarize_on_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 3, 5, generator=g) * 3
    s = summarize(logits)
    u = M.uncertainty(s["member_probs"].numpy())
    for k in ("msp", "entropy", "expected_entropy", "mutual_information", "disagreement"):
        np.testing.assert_allclose(u[k], s[k].numpy(), atol=1e-5)


# ----------------------------------------------------------------------------- OOD
def test_auroc_and_aupr_equal_sklearn():
    rng = np.random.default_rng(0)
    s_id = np.round(rng.normal(0, 1, 300), 1)  # rounded: ties between ID and OOD
    s_ood = np.round(rng.normal(1, 1, 200), 1)
    y = np.r_[np.zeros(300), np.ones(200)]
    s = np.r_[s_id, s_ood]
    assert M.auroc(s_id, s_ood) == pytest.approx(roc_auc_score(y, s))
    assert M.aupr_out(s_id, s_ood) == pytest.approx(average_precision_score(y, s))
    assert M.aupr_in(s_id, s_ood) == pytest.approx(average_precision_score(1 - y, -s))
    assert 0.5 < M.auroc(s_id, s_ood) < 1


def test_fpr95_constructed_case():
    # ID scores 0..99 (higher = more OOD). OOD: 90 scores far above every ID score, 10 inside the ID range
    # at 9.5, 19.5, ..., 99.5. Catching 95 of 100 OOD needs the threshold at 59.5 (90 high + 99.5..59.5),
    # where the ID scores 60..99 are flagged too: FPR95 = 40 / 100.
    s_id = np.arange(100, dtype=float)
    s_ood = np.r_[np.arange(1000, 1090, dtype=float), np.arange(9.5, 100, 10)]
    assert M.fpr95(s_id, s_ood) == pytest.approx(0.40)

    # brute force over thresholds: smallest ID false-alarm rate with >= 95% of OOD flagged (score >= t)
    def brute(a, b, tpr=0.95):
        return min(np.mean(a >= t) for t in np.r_[a, b] if np.mean(b >= t) >= tpr)

    rng = np.random.default_rng(1)
    for _ in range(5):
        a, b = rng.normal(0, 1, 137), rng.normal(1.5, 1, 91)
        assert M.fpr95(a, b) == pytest.approx(brute(a, b))
    # perfectly separated: no false alarms; fully reversed: every ID input flagged
    assert M.fpr95(np.zeros(10), np.ones(10)) == 0.0
    assert M.fpr95(np.ones(10), np.zeros(10)) == 1.0


def test_ood_scores_orientation():
    p = np.array([[[0.9, 0.1]], [[0.5, 0.5]]])  # confident, then uniform
    np.testing.assert_allclose(M.ood_scores(p, "msp"), [-0.9, -0.5])
    assert M.ood_scores(p, "entropy")[1] > M.ood_scores(p, "entropy")[0]
    np.testing.assert_allclose(M.ood_scores(p, "mi"), M.ood_scores(p, "mutual_information"))
    with pytest.raises(ValueError, match="unknown OOD score"):
        M.ood_scores(p, "energy")


# ----------------------------------------------------------------------------- evaluate_predictions
def _dirichlet(rng, n, m, c, alpha):
    return rng.dirichlet(np.full(c, alpha), size=(n, m))


def test_evaluate_predictions_keys_ranges_and_known_detection():
    rng = np.random.default_rng(0)
    n, m, c = 200, 3, 4
    labels = rng.integers(0, c, n)
    probs = np.full((n, m, c), 0.02 / (c - 1))
    probs[np.arange(n), :, labels] = 0.98  # confident and right: every ID MSP is 0.98
    ood = {"far": np.full((50, m, c), 1 / c), "near": _dirichlet(rng, 60, m, c, 1.0) * 0.5 + 0.5 / c}
    r = M.evaluate_predictions(probs, labels, ood, ood_score="msp")
    for k in EVAL_SCALAR_KEYS:
        assert isinstance(r[k], float), k
    assert r["acc"] == 1.0
    assert r["ece"] == pytest.approx(0.02)
    assert r["msp_id"] == pytest.approx(0.98)
    assert set(r["ood"]) == {"far", "near"}
    for o in r["ood"].values():
        assert set(o) == EVAL_OOD_SET_KEYS
        assert all(0.0 <= v <= 1.0 for k, v in o.items() if k != "mi")
    # uniform OOD is separated perfectly by MSP
    assert r["ood"]["far"] == pytest.approx(
        {"auroc": 1.0, "fpr95": 0.0, "aupr_in": 1.0, "aupr_out": 1.0, "mi": 0.0, "disagreement": 0.0}, abs=1e-6
    )
    assert r["ood_avg"]["auroc"] == pytest.approx(np.mean([o["auroc"] for o in r["ood"].values()]))
    # pooled OOD mean of MI
    mi = np.r_[M.uncertainty(ood["far"])["mutual_information"], M.uncertainty(ood["near"])["mutual_information"]]
    assert r["mi_ood"] == pytest.approx(mi.mean())


def test_evaluate_predictions_single_model_and_mi_score():
    rng = np.random.default_rng(1)
    probs = _dirichlet(rng, 100, 1, 5, 0.3)  # single model: M = 1
    labels = probs[:, 0].argmax(-1)
    ood = {"x": _dirichlet(rng, 40, 1, 5, 3.0)}
    r = M.evaluate_predictions(probs, labels, ood, ood_score="mutual_information")
    assert r["acc"] == 1.0 and r["mi_id"] == 0.0 and r["disagreement_id"] == 0.0
    # one member: MI is 0 everywhere, so it cannot separate anything
    assert r["ood"]["x"]["auroc"] == pytest.approx(0.5)
    assert r["ood"]["x"]["fpr95"] == 1.0
    r2 = M.evaluate_predictions(probs, labels, ood, ood_score="entropy")
    s_id, s_ood = M.ood_scores(probs, "entropy"), M.ood_scores(ood["x"], "entropy")
    assert r2["ood"]["x"]["auroc"] == pytest.approx(M.auroc(s_id, s_ood))
    with pytest.raises(ValueError, match=r"\(N, M, C\)"):
        M.evaluate_predictions(probs[:, 0], labels, ood)
    with pytest.raises(ValueError, match="do not match"):
        M.evaluate_predictions(probs, labels, {"x": _dirichlet(rng, 4, 2, 5, 1.0)})


# ----------------------------------------------------------------------------- risk-coverage
def _aurc_by_definition(confidence, correct):
    """Mean over k of the error rate among the k most confident (distinct confidences)."""
    order = sorted(range(len(confidence)), key=lambda i: -confidence[i])
    risks = [sum(1 - correct[i] for i in order[:k]) / k for k in range(1, len(order) + 1)]
    return sum(risks) / len(risks)


def test_aurc_known_answers():
    from offline.method.ensemble_metrics import aurc

    assert aurc([0.9, 0.8, 0.7, 0.6], [1, 1, 1, 0]) == pytest.approx(1 / 16)  # the error ranked last
    assert aurc([0.9, 0.8, 0.7, 0.6], [0, 1, 1, 1]) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)  # ranked first
    assert aurc([0.5] * 5, [1, 0, 1, 1, 0]) == pytest.approx(2 / 5)  # no information: the error rate
    assert aurc([0.9, 0.9, 0.1], [0, 1, 1]) == pytest.approx((2 * (1 / 2) + 1 / 3) / 3)  # a tie answered together


def test_aurc_matches_its_definition_and_rewards_a_better_ranking():
    from offline.method.ensemble_metrics import aurc

    rng = np.random.default_rng(0)
    conf = rng.random(300)
    correct = (rng.random(300) < conf).astype(int)  # confidence carries information
    assert aurc(conf, correct) == pytest.approx(_aurc_by_definition(list(conf), list(correct)))
    shuffled = rng.permutation(conf)
    assert aurc(conf, correct) < aurc(shuffled, correct)
    with pytest.raises(ValueError, match="same non-empty length"):
        aurc([0.1, 0.2], [1])


def test_evaluate_predictions_reports_aurc_of_the_mean_prediction():
    from offline.method.ensemble_metrics import aurc, evaluate_predictions

    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(3), size=(50, 2))
    labels = rng.integers(0, 3, 50)
    mean = probs.mean(axis=1)
    out = evaluate_predictions(probs, labels, {})
    assert out["aurc"] == pytest.approx(aurc(mean.max(-1), mean.argmax(-1) == labels))
