"""Temperature fitting recovers a known temperature; thresholds pass exactly the asked share of ID inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from offline.method.calibration import T_MAX, calibrate_threshold, ensemble_nll, fit_temperature
from service.core.uncertainty import OOD_METRICS, ood_flag


def _passed(scores: np.ndarray, metric: str, threshold: float) -> int:
    """Inputs NOT flagged by the server's own rule, on float32 scores as the server computes them."""
    return int((~ood_flag(torch.as_tensor(scores, dtype=torch.float32), metric, threshold)).sum())


# ----------------------------------------------------------------------------- threshold
@pytest.mark.parametrize("metric", sorted(OOD_METRICS))
@pytest.mark.parametrize("n", [100, 1000])
def test_threshold_passes_exactly_95_percent_of_distinct_scores(metric, n):
    rng = np.random.default_rng(n)
    scores = rng.permutation(np.linspace(0.01, 0.99, n)).astype(np.float32)
    thr = calibrate_threshold(scores, metric, tpr=0.95)
    assert _passed(scores, metric, thr) == round(0.95 * n)
    # the flagged inputs are the least in-distribution ones
    flagged = scores[ood_flag(torch.as_tensor(scores), metric, thr).numpy()]
    kept = scores[~ood_flag(torch.as_tensor(scores), metric, thr).numpy()]
    if OOD_METRICS[metric]:  # msp: low scores are flagged
        assert flagged.max() < kept.min()
    else:
        assert flagged.min() > kept.max()


@pytest.mark.parametrize("metric", sorted(OOD_METRICS))
def test_threshold_other_rates_and_round_up(metric):
    scores = np.arange(1, 41, dtype=np.float32) / 41  # 40 distinct scores
    assert _passed(scores, metric, calibrate_threshold(scores, metric, tpr=0.9)) == 36
    # 0.93 · 40 = 37.2: at least the asked share passes, so 38
    assert _passed(scores, metric, calibrate_threshold(scores, metric, tpr=0.93)) == 38
    assert _passed(scores, metric, calibrate_threshold(scores, metric, tpr=1.0)) == 40


@pytest.mark.parametrize("metric", sorted(OOD_METRICS))
def test_threshold_with_ties_passes_the_smallest_share_at_least_tpr(metric):
    rng = np.random.default_rng(0)
    scores = np.round(rng.uniform(0, 1, 500), 1).astype(np.float32)  # 11 distinct values, many ties
    thr = calibrate_threshold(scores, metric, tpr=0.95)
    passed = _passed(scores, metric, thr)
    assert passed >= 0.95 * len(scores)
    # any stricter threshold (the next distinct value towards ID) would pass fewer than 95%
    values = np.unique(scores)
    if OOD_METRICS[metric]:
        stricter = values[values > thr]
    else:
        stricter = values[values < thr]
    assert len(stricter) > 0
    nxt = float(stricter.min() if OOD_METRICS[metric] else stricter.max())
    assert _passed(scores, metric, nxt) < 0.95 * len(scores)


def test_threshold_adjacent_float32_scores():
    # the k-th and (k+1)-th scores are adjacent float32 values: the midpoint must not swallow the next one
    base = np.nextafter(np.float32(0.5), np.float32(1))
    nxt = np.float32(0.5)
    assert np.float32((np.float64(base) + np.float64(nxt)) / 2) == nxt  # the float32 midpoint IS the next score
    scores = np.r_[
        np.full(95, base, np.float32) + np.arange(95, dtype=np.float32) * 1e-3,
        [nxt],
        np.linspace(0.1, 0.2, 4, dtype=np.float32),
    ]
    thr = calibrate_threshold(scores, "msp", tpr=0.95)
    assert _passed(scores, "msp", thr) == 95


def test_threshold_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown OOD score"):
        calibrate_threshold(np.ones(10), "nope")
    with pytest.raises(ValueError, match="NaN"):
        calibrate_threshold(np.array([0.5, np.nan]), "msp")
    with pytest.raises(ValueError, match="tpr"):
        calibrate_threshold(np.ones(10), "msp", tpr=0.0)
    with pytest.raises(ValueError, match="no ID scores"):
        calibrate_threshold(np.array([]), "msp")


def test_threshold_of_an_outlier_score_flags_above_it():
    """Energy, Mahalanobis & co. are outlier scores (higher = OOD): 95 % of the ID inputs stay at or below."""
    scores = np.arange(100, dtype=np.float64)  # 0..99
    t = calibrate_threshold(scores, "mahalanobis", tpr=0.95)
    assert 94 < t < 95  # halfway between the 95th and 96th smallest
    assert int((scores > t).sum()) == 5


# ----------------------------------------------------------------------------- temperature
def _synthetic(k: float, n: int = 4000, c: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``true · k`` with labels drawn from softmax(true): the NLL-optimal temperature is ``k``."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(n, c, generator=g) * 2.5
    labels = torch.multinomial(torch.softmax(true, -1), 1, generator=g).squeeze(1)
    return true * k, labels


@pytest.mark.parametrize("k", [0.5, 2.0, 4.0])
def test_fit_temperature_recovers_known_temperature(k):
    logits, labels = _synthetic(k)
    t = fit_temperature(logits.unsqueeze(1), labels)  # single model, M = 1
    assert t == pytest.approx(k, rel=0.08)
    # three identical members: the ensemble mean is the member, same temperature
    t3 = fit_temperature(logits.unsqueeze(1).expand(-1, 3, -1), labels)
    assert t3 == pytest.approx(t, rel=1e-4)
    # it is a minimum of the ensemble NLL
    nll = lambda T: ensemble_nll(logits.unsqueeze(1), labels, T)
    assert nll(t) <= min(nll(t * 0.9), nll(t * 1.1))


def test_fit_temperature_ensemble_differs_from_members():
    # two overconfident members that disagree: averaging already softens, so the ensemble needs less heating
    logits, labels = _synthetic(3.0, seed=1)
    g = torch.Generator().manual_seed(2)
    members = torch.stack([logits + torch.randn(logits.shape, generator=g) * 3 for _ in range(2)], 1)  # (N, 2, C)
    t_ens = fit_temperature(members, labels)
    t_single = fit_temperature(members[:, :1], labels)
    assert 0.05 <= t_ens < t_single
    nll = lambda T: ensemble_nll(members, labels, T)
    assert nll(t_ens) <= min(nll(t_ens * 0.95), nll(t_ens * 1.05))


def test_fit_temperature_stays_in_range():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 2, 4, generator=g) * 10  # labels unrelated to logits: best is "as flat as allowed"
    labels = torch.randint(0, 4, (500,), generator=g)
    t = fit_temperature(logits, labels)
    assert T_MAX * 0.99 <= t <= T_MAX
    assert math.isfinite(t)
    with pytest.raises(ValueError, match=r"\(N, M, C\)"):
        fit_temperature(logits[:, 0], labels)
    with pytest.raises(ValueError, match="NaN"):
        fit_temperature(torch.full((3, 1, 2), float("nan")), torch.zeros(3, dtype=torch.long))
