"""Fitting the OOD statistics (offline/ood_fit.py): shrinkage, known Gaussians recovered, round trip to disk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sklearn.covariance import LedoitWolf

from offline.ood_fit import fit_gaussians
from service.ood import mahalanobis, stats_from_tensors, stats_tensors


def _data(n: int = 3000, members: int = 2, dim: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    centres = torch.tensor([[0.0] * dim, [5.0] + [0.0] * (dim - 1), [0.0, 5.0] + [0.0] * (dim - 2)])
    z = centres[y].unsqueeze(1) + torch.randn(n, members, dim, generator=g)  # identity covariance
    return z, y, centres


def test_recovers_class_means_and_identity_precision():
    z, y, centres = _data()
    stats = fit_gaussians(z, y, classes=3)
    assert stats.means.shape == (2, 3, 4) and stats.precision.shape == (2, 4, 4)
    torch.testing.assert_close(stats.means[0], centres.double(), atol=0.1, rtol=0)
    torch.testing.assert_close(stats.precision[1], torch.eye(4, dtype=torch.float64), atol=0.1, rtol=0)


def test_precision_is_ledoit_wolf_of_the_within_class_scatter():
    z, y, _ = _data(n=60, dim=8)
    stats = fit_gaussians(z, y, classes=3)
    f = z[:, 0].double().numpy()
    centred = f - np.stack([f[y.numpy() == k].mean(0) for k in range(3)])[y.numpy()]
    expected = LedoitWolf(assume_centered=True).fit(centred).precision_
    np.testing.assert_allclose(stats.precision[0].numpy(), expected, rtol=1e-10)


def test_empty_class_is_named():
    z, y, _ = _data(n=30)
    with pytest.raises(ValueError, match="class 3 has no input"):
        fit_gaussians(z, y, classes=4)


def test_statistics_round_trip_through_safetensors(tmp_path):
    z, y, _ = _data(n=90)
    stats = fit_gaussians(z, y, classes=3)
    save_file(stats_tensors(stats), str(tmp_path / "ood.safetensors"))
    back = stats_from_tensors(load_file(str(tmp_path / "ood.safetensors")))
    torch.testing.assert_close(mahalanobis(z[:5], back), mahalanobis(z[:5], stats), rtol=0, atol=0)
