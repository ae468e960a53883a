"""OOD scores (service/core/ood.py): known answers, and the same numbers as pytorch-ood on the same features."""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_ood.detector import RMD, EnergyBased, Mahalanobis, MaxLogit

from service.core.ood import (
    GaussianStats,
    combine,
    energy,
    mahalanobis,
    max_logit,
    relative_mahalanobis,
    squared_distances,
    standardize,
)


def _identity_stats(means: torch.Tensor) -> GaussianStats:
    m, _, d = means.shape
    eye = torch.eye(d, dtype=torch.float64).expand(m, d, d)
    return GaussianStats(means.double(), eye, torch.zeros(m, d, dtype=torch.float64), eye)


def test_known_answers():
    # two classes at (0, 0) and (4, 0), identity covariance: a point at (1, 0) is 1 from class 0 (half: 0.5)
    stats = _identity_stats(torch.tensor([[[0.0, 0.0], [4.0, 0.0]]]))
    f = torch.tensor([[[1.0, 0.0]], [[4.0, 3.0]]])  # (B=2, M=1, D=2)
    assert mahalanobis(f, stats).squeeze(1).tolist() == [0.5, 4.5]
    # background at the origin: d_0² = 1 and 25, so the relative score is 1 - 1 = 0 and 9 - 25 = -16
    assert relative_mahalanobis(f, stats).squeeze(1).tolist() == [0.0, -16.0]
    # two equal logits: energy -log(2 e^0) = -ln 2; the max logit is negated
    assert energy(torch.zeros(1, 2)).item() == pytest.approx(-math.log(2))
    assert energy(torch.tensor([[0.0, 2.0]]), temperature=2.0).item() == pytest.approx(-2 * math.log(1 + math.e))
    assert max_logit(torch.tensor([[1.0, 3.0, -2.0]])).tolist() == [-3.0]


def test_standardised_combination():
    scores = torch.tensor([[1.0, 10.0], [3.0, 30.0]])  # member 1 on a 10x scale
    mean, std = torch.tensor([2.0, 20.0]), torch.tensor([1.0, 10.0])
    assert standardize(scores, mean, std).tolist() == [[-1.0, -1.0], [1.0, 1.0]]
    assert combine(scores, mean, std).tolist() == [-1.0, 1.0]


def test_shapes_are_checked():
    stats = _identity_stats(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match=r"features must be \(B, M=3, D=5\)"):
        mahalanobis(torch.zeros(2, 2, 5), stats)
    with pytest.raises(ValueError, match="background_mean has shape"):
        GaussianStats(stats.means, stats.precision, torch.zeros(3, 4), stats.background_precision)


def _fitted(z: torch.Tensor, y: torch.Tensor, members: int) -> tuple[list[RMD], GaussianStats]:
    """pytorch-ood's RMD (a Mahalanobis detector plus the background Gaussian) fitted per member, and the same
    statistics handed to ours."""
    detectors = [RMD(None).fit_features(z[:, m], y) for m in range(members)]
    stats = GaussianStats(
        means=torch.stack([d.mu for d in detectors]).double(),
        precision=torch.stack([d.precision for d in detectors]).double(),
        background_mean=torch.stack([d.background_mu for d in detectors]).double(),
        background_precision=torch.stack([d.background_precision for d in detectors]).double(),
    )
    return detectors, stats


def test_same_numbers_as_pytorch_ood():
    g = torch.Generator().manual_seed(0)
    members, classes, dim = 3, 4, 16
    y = torch.arange(200) % classes
    z = torch.randn(200, members, dim, generator=g) + 2.0 * torch.randn(classes, members, dim, generator=g)[y]
    detectors, stats = _fitted(z, y, members)
    test = torch.randn(50, members, dim, generator=g) * 3
    ours_md, ours_rmd = mahalanobis(test, stats), relative_mahalanobis(test, stats)
    for m, det in enumerate(detectors):
        ref_md = Mahalanobis(None).fit_features(z[:, m], y).predict_features(test[:, m])
        torch.testing.assert_close(ours_md[:, m].float(), ref_md, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_rmd[:, m].float(), det.predict_features(test[:, m]), rtol=1e-5, atol=1e-5)
    logits = torch.randn(50, 7, generator=g)
    torch.testing.assert_close(energy(logits, 1.5), EnergyBased.score(logits, 1.5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(max_logit(logits), MaxLogit.score(logits), rtol=1e-5, atol=1e-5)


def test_distances_keep_their_digits_in_float32_features():
    """fp32 features, a badly conditioned precision: the float64 path matches a float64 reference."""
    g = torch.Generator().manual_seed(1)
    d = 64
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    cov = a @ a.T + 1e-4 * torch.eye(d, dtype=torch.float64)
    prec = torch.linalg.inv(cov).unsqueeze(0)
    means = (torch.randn(1, 3, d, generator=g) * 10).double()
    f32 = (torch.randn(8, 1, d, generator=g) * 10).float()
    diff = f32.double().unsqueeze(2) - means.unsqueeze(0)
    ref = torch.einsum("bmkd,mde,bmke->bmk", diff, prec, diff)
    torch.testing.assert_close(squared_distances(f32, means, prec), ref, rtol=1e-9, atol=1e-9)


def test_ensemble_scores_without_statistics_are_the_probability_scores():
    from service.core.ood import ensemble_scores
    from service.core.uncertainty import summarize

    logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0]]])  # two members that disagree
    s = ensemble_scores(logits, None, None)
    assert set(s) == {"msp", "entropy", "mutual_information"}
    assert float(s["msp"]) == pytest.approx(0.5)
    assert float(s["mutual_information"]) == pytest.approx(float(summarize(logits)["mutual_information"]))


def test_ood_statistics_round_trip_and_combination():
    from service.core.ood import GaussianStats, OODStats, ensemble_scores, fit_norms, ood_from_tensors, ood_tensors

    M, C, D = 2, 3, 4
    g = GaussianStats(
        torch.zeros(M, C, D, dtype=torch.float64),
        torch.eye(D, dtype=torch.float64).repeat(M, 1, 1),
        torch.zeros(M, D, dtype=torch.float64),
        torch.eye(D, dtype=torch.float64).repeat(M, 1, 1),
    )
    id_scores = {"mahalanobis": torch.tensor([[1.0, 3.0], [3.0, 5.0]]), "mutual_information": torch.tensor([0.0, 2.0])}
    norms = fit_norms(id_scores)
    assert torch.equal(norms["mahalanobis"][0], torch.tensor([2.0, 4.0], dtype=torch.float64))
    back = ood_from_tensors(ood_tensors(OODStats(g, norms)))
    assert torch.equal(back.gaussians.means, g.means) and set(back.norms) == {"mahalanobis", "mutual_information"}
    feats = torch.full((1, M, D), 1.0)  # squared distance 4 to every (zero) mean: Mahalanobis 2 per member
    s = ensemble_scores(torch.zeros(1, M, C), feats, back)
    z = ((2.0 - 2.0) / math.sqrt(2.0) + (2.0 - 4.0) / math.sqrt(2.0)) / 2  # member means 2, 4; std sqrt(2)
    assert float(s["mahalanobis"]) == pytest.approx(z)
    assert float(s["mahalanobis_mi"]) == pytest.approx(z + (0.0 - 1.0) / math.sqrt(2.0))  # MI 0, norm (1, sqrt 2)
    assert "energy" not in s  # no norms fitted for it: not combined
