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


# ----------------------------------------------------------------------------- selection and detection
def test_select_score_serves_the_best_mean_recall_and_honours_a_forced_score():
    from offline.ood_fit import select_score

    id_val = {"msp": np.linspace(0.6, 1.0, 100), "mahalanobis": np.linspace(0.0, 1.0, 100)}
    ood_val = {  # msp cannot tell this set apart; Mahalanobis flags every input of it
        "near": {"msp": np.linspace(0.6, 1.0, 50), "mahalanobis": np.full(50, 5.0)},
        "far": {"msp": np.full(50, 0.1), "mahalanobis": np.full(50, 5.0)},
    }
    selected, cands = select_score(id_val, ood_val, tpr=0.95)
    assert selected == "mahalanobis"
    assert cands["mahalanobis"]["val_recall"] == {"near": 1.0, "far": 1.0}
    assert cands["msp"]["val_recall"]["far"] == 1.0 and cands["msp"]["val_recall"]["near"] <= 0.1
    assert cands["msp"]["id_val_flag_rate"] == pytest.approx(0.05)
    forced, _ = select_score(id_val, ood_val, tpr=0.95, forced="msp")
    assert forced == "msp"
    with pytest.raises(ValueError, match="cannot be computed"):
        select_score(id_val, ood_val, tpr=0.95, forced="energy")
    # no OOD validation data: nothing to rank by; the Mahalanobis distance when the model has features, else MSP
    assert select_score(id_val, {}, tpr=0.95)[0] == "mahalanobis"
    assert select_score({"msp": id_val["msp"]}, {}, tpr=0.95)[0] == "msp"


def test_detection_known_answers():
    from offline.ood_fit import detection

    id_scores = {"msp": np.array([0.9, 0.8, 0.95]), "energy": np.array([-3.0, -2.0, -2.5])}
    ood = {"far": {"msp": np.array([0.2, 0.3]), "energy": np.array([1.0, 2.0])},  # perfectly separated
           "same": {"msp": np.array([0.9, 0.8, 0.95]), "energy": np.array([-3.0, -2.0, -2.5])}}  # indistinguishable
    d = detection(id_scores, ood)
    for name in ("msp", "energy"):  # MSP is oriented (higher = ID) before scoring
        assert d[name]["ood"]["far"]["auroc"] == pytest.approx(1.0)
        assert d[name]["ood"]["same"]["auroc"] == pytest.approx(0.5)
        assert d[name]["avg"]["auroc"] == pytest.approx(0.75)


def test_fit_ood_stats_norms_standardise_the_validation_scores():
    from offline.ood_fit import fit_ood_stats, scores_np

    z, y, _ = _data(n=600, members=3)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(600, 3, 3, generator=g)
    stats = fit_ood_stats(z, y, 3, logits, z, temperature=1.0)
    s = scores_np(logits, z, stats, 1.0)
    # each per-member score standardised on these very inputs: the member mean of z-scores has mean 0
    for name in ("energy", "max_logit", "mahalanobis", "relative_mahalanobis"):
        assert abs(s[name].mean()) < 1e-9, name
    mi = s["mutual_information"]
    mi_z = (mi - mi.mean()) / mi.std(ddof=1)
    np.testing.assert_allclose(s["mahalanobis_mi"], s["mahalanobis"] + mi_z, atol=1e-9)
    np.testing.assert_allclose(s["mahalanobis_energy"], s["mahalanobis"] + s["energy"], atol=1e-12)
