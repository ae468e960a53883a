"""Fitting the OOD statistics (offline/method/ood_fit.py): shrinkage, known Gaussians recovered, round trip to disk."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sklearn.covariance import LedoitWolf

from offline.method.ood_fit import fit_gaussians
from service.core.ood import mahalanobis, stats_from_tensors, stats_tensors


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
    from offline.method.ood_fit import select_score

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
    from offline.method.ood_fit import detection

    id_scores = {"msp": np.array([0.9, 0.8, 0.95]), "energy": np.array([-3.0, -2.0, -2.5])}
    ood = {
        "far": {"msp": np.array([0.2, 0.3]), "energy": np.array([1.0, 2.0])},  # perfectly separated
        "same": {"msp": np.array([0.9, 0.8, 0.95]), "energy": np.array([-3.0, -2.0, -2.5])},  # indistinguishable
    }
    d = detection(id_scores, ood)
    for name in ("msp", "energy"):  # MSP is oriented (higher = ID) before scoring
        assert d[name]["ood"]["far"]["auroc"] == pytest.approx(1.0)
        assert d[name]["ood"]["same"]["auroc"] == pytest.approx(0.5)
        assert d[name]["avg"]["auroc"] == pytest.approx(0.75)


def test_fit_ood_stats_norms_standardise_the_validation_scores():
    from offline.method.ood_fit import fit_ood_stats, scores_np

    z, y, _ = _data(n=600, members=3)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(600, 3, 3, generator=g)
    stats = fit_ood_stats(z, y, 3, logits, z, temperature=1.0)
    s = scores_np((logits, z, None), stats, 1.0)
    # each per-member score standardised on these very inputs: the member mean of z-scores has mean 0
    for name in ("energy", "max_logit", "mahalanobis", "relative_mahalanobis"):
        assert abs(s[name].mean()) < 1e-9, name
    mi = s["mutual_information"]
    mi_z = (mi - mi.mean()) / mi.std(ddof=1)
    np.testing.assert_allclose(s["mahalanobis_mi"], s["mahalanobis"] + mi_z, atol=1e-9)
    np.testing.assert_allclose(s["mahalanobis_energy"], s["mahalanobis"] + s["energy"], atol=1e-12)


# ----------------------------------------------------------------------------- relative Mahalanobis's background
def test_relative_mahalanobis_cancels_outside_the_class_means_with_few_inputs_per_dimension():
    """Known answer: the background Gaussian is the class mixture's (within-class covariance plus the between-class
    scatter), so along any direction orthogonal to the class means (in the within-class metric) the two Gaussians
    agree and an input moved along it keeps its relative score while its Mahalanobis distance grows. The old fit
    shrank the background covariance on its own: with about as many inputs as dimensions the two shrinkage
    intensities differed, far inputs got relative scores far *below* ID ones (AUROC 14-16 % on the text artifact),
    and this test failed."""
    from service.core.ood import relative_mahalanobis

    g = torch.Generator().manual_seed(3)
    n, dim = 64, 48  # about as many inputs as dimensions, as 400 texts of 384 dimensions
    y = torch.arange(n) % 2
    centres = torch.zeros(2, dim)
    centres[1, 0] = 4.0  # the class means differ along axis 0 only
    scales = torch.linspace(0.5, 2.0, dim)  # anisotropic, so that shrinkage matters
    z = (centres[y] + torch.randn(n, dim, generator=g) * scales).unsqueeze(1)  # (N, 1, D)
    stats = fit_gaussians(z, y, classes=2)
    v = stats.means[0, 1] - stats.means[0, 0]  # the class means' span (two classes: one direction)
    pw = stats.precision[0]
    u = torch.randn(dim, generator=g, dtype=torch.float64)
    u -= (v @ pw @ u) / (v @ pw @ v) * v  # orthogonal to it in the within-class metric: vᵀ P u = 0
    u /= u.norm()
    base = stats.background_mean[0] + 0.3 * v
    points = torch.stack([base + t * u for t in (0.0, 5.0, 50.0)]).unsqueeze(1)  # (3, 1, D)
    rel = relative_mahalanobis(points, stats)[:, 0]
    md = mahalanobis(points, stats)[:, 0]
    assert md[2] > 100 * md[0]  # far away for the class Gaussians ...
    torch.testing.assert_close(rel, rel[:1].expand(3), rtol=0, atol=1e-6 * float(md[2]))  # ... not for the relative


def test_relative_mahalanobis_ranks_far_inputs_above_id_ones():
    """Inputs scaled away from the data in every direction score higher than held-out ID inputs (AUROC above
    chance), with as many fit inputs as dimensions: the regression test of the inverted score."""
    from sklearn.metrics import roc_auc_score

    from service.core.ood import relative_mahalanobis

    g = torch.Generator().manual_seed(4)
    n, dim = 96, 64
    y = torch.arange(n) % 3
    centres = torch.randn(3, dim, generator=g) * 2
    z = (centres[y] + torch.randn(n, dim, generator=g)).unsqueeze(1)
    stats = fit_gaussians(z, y, classes=3)
    yt = torch.arange(200) % 3
    test = (centres[yt] + torch.randn(200, dim, generator=g)).unsqueeze(1)
    far = (centres[yt] + 4 * torch.randn(200, dim, generator=g)).unsqueeze(1)
    s_id, s_far = relative_mahalanobis(test, stats)[:, 0].numpy(), relative_mahalanobis(far, stats)[:, 0].numpy()
    assert roc_auc_score(np.r_[np.zeros(200), np.ones(200)], np.r_[s_id, s_far]) > 0.6


# ----------------------------------------------------------------------------- the multi-layer score
def _layer_data(n: int = 240, members: int = 2, layers: int = 3, dim: int = 6, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    centres = torch.randn(3, members, layers, dim, generator=g) * 3
    z = centres[y] + torch.randn(n, members, layers, dim, generator=g)
    feats = torch.randn(n, members, 4, generator=g) + torch.randn(3, members, 4, generator=g)[y] * 3
    logits = torch.randn(n, members, 3, generator=g)
    return logits, feats, z, y


def _fitted_layer_data() -> tuple[Any, ...]:
    """:func:`_layer_data` split into fit, validation and new inputs, with the last feature's statistics fitted and
    its Mahalanobis score on validation: ``(logits, feats, layers, y, (fit, val, new), stats, val_md)``."""
    from offline.method.ood_fit import fit_ood_stats, scores_np

    logits, feats, layers, y = _layer_data()
    fit, val, new = slice(0, 120), slice(120, 180), slice(180, 240)
    stats = fit_ood_stats(feats[fit], y[fit], 3, logits[val], feats[val], 1.0)
    val_md = torch.from_numpy(scores_np((logits[val], feats[val], None), stats, 1.0)["mahalanobis"])
    return logits, feats, layers, y, (fit, val, new), stats, val_md


def test_layer_candidates_equal_the_served_score_on_their_restricted_statistics():
    """What selection computes for a layer set (layer_columns + candidate_scores, once for all sets) is exactly what
    the server computes with the statistics restricted to that set (ensemble_scores), on other inputs too."""
    from offline.method.ood_fit import (
        candidate_scores,
        fit_layer_stats,
        layer_candidates,
        layer_columns,
        restrict_layers,
        scores_np,
        with_layers,
    )

    logits, feats, layers, y, (fit, val, new), stats, val_md = _fitted_layer_data()
    full = fit_layer_stats(layers[fit], y[fit], 3, layers[val], val_md)
    assert layer_candidates(3) == [(0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]
    run = (logits[new], feats[new], layers[new])
    cols = layer_columns(run, stats, full, 1.0)
    for ids in layer_candidates(3):
        for reduce in ("max", "mean", "members"):
            restricted = with_layers(stats, restrict_layers(full, ids, reduce))
            served = scores_np(run, restricted, 1.0)["mahalanobis_layers"]
            np.testing.assert_allclose(candidate_scores(cols, full, ids, reduce), served, rtol=0, atol=1e-12)
    # a layer set fitted on its own equals the restriction of the full fit
    alone = fit_layer_stats(layers[fit], y[fit], 3, layers[val], val_md, ids=(0, 2))
    again = restrict_layers(full, (0, 2))
    for a, b in (
        (alone.gaussians.means, again.gaussians.means),
        (alone.pair_norms[1], again.pair_norms[1]),
        (alone.column_norms[0], again.column_norms[0]),
    ):
        torch.testing.assert_close(a, b)


def test_layers_score_is_the_largest_standardised_column():
    from service.core.ood import layers_max

    last = torch.tensor([1.0, 0.0])
    layers = torch.tensor([[0.0, 3.0], [10.0, 2.0]])
    norms = (torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64))
    # columns standardised: [1, -0.5, 2] and [0, 4.5, 0]
    assert layers_max(last, layers, norms).tolist() == [2.0, 4.5]


def test_layer_reductions_known_answers():
    """Columns (B=1, M=2, K+1=3), member-standardised: ``max`` / ``mean`` standardise the members' mean per column by
    the column norms, then take the largest / the mean; ``members`` averages each member's largest column."""
    from service.core.ood import layers_max, reduce_layers

    cols = torch.tensor([[[1.0, 0.0, 4.0], [3.0, 2.0, -2.0]]], dtype=torch.float64)  # member means: [2, 1, 1]
    norms = (torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64))
    # standardised member means: [2, 0, 2]
    assert reduce_layers(cols, norms, "max").tolist() == [2.0]
    assert reduce_layers(cols, norms, "mean").tolist() == [4.0 / 3.0]
    assert reduce_layers(cols, norms, "members").tolist() == [3.5]  # members' largest: 4 and 3
    means = cols.mean(dim=1)
    assert reduce_layers(cols, norms, "max").tolist() == layers_max(means[:, 0], means[:, 1:], norms).tolist()
    with pytest.raises(ValueError, match="unknown layer reduction"):
        reduce_layers(cols, norms, "median")


def test_layer_candidate_names_round_trip():
    from offline.method.ood_fit import LayerChoice, layer_candidate_name, parse_layer_candidate

    assert layer_candidate_name((0, 2)) == "mahalanobis_layers@0,2"  # the largest column: the name older reports use
    assert layer_candidate_name((1,), "members") == "mahalanobis_layers@1:members"
    for ids, reduce in (((0, 2), "max"), ((3,), "mean"), ((0, 1, 2), "members")):
        assert parse_layer_candidate(layer_candidate_name(ids, reduce)) == LayerChoice(ids, reduce)
        for free in (False, True):
            name = layer_candidate_name(ids, reduce, free)
            assert parse_layer_candidate(name) == LayerChoice(ids, reduce, free)
    assert layer_candidate_name((0, 2), "max", True) == "mahalanobis_layers@0,2:max:free"


def test_label_free_layer_statistics_are_one_gaussian_of_every_fit_input():
    """``label_free``: each (member, layer) Gaussian is that of all fit inputs, whatever their class (the mean is
    their mean); its candidates equal the server's score on the restricted statistics, as the per-class ones do."""
    from offline.method.ood_fit import (
        candidate_scores,
        fit_layer_stats,
        layer_columns,
        restrict_layers,
        scores_np,
        with_layers,
    )

    logits, feats, layers, y, (fit, val, new), stats, val_md = _fitted_layer_data()
    free = fit_layer_stats(layers[fit], y[fit], 3, layers[val], val_md, label_free=True)
    n, m, k, d = layers[fit].shape
    assert free.gaussians.means.shape == (m * k, 1, d)
    torch.testing.assert_close(
        free.gaussians.means[:, 0].to(torch.float64),
        layers[fit].to(torch.float64).mean(0).reshape(m * k, d),
        rtol=1e-5,
        atol=1e-5,
    )
    same = fit_layer_stats(layers[fit], torch.zeros_like(y[fit]), 1, layers[val], val_md)
    torch.testing.assert_close(free.gaussians.precision, same.gaussians.precision)
    run = (logits[new], feats[new], layers[new])
    cols = layer_columns(run, stats, free, 1.0)
    served = scores_np(run, with_layers(stats, restrict_layers(free, (0, 2), "mean")), 1.0)["mahalanobis_layers"]
    np.testing.assert_allclose(candidate_scores(cols, free, (0, 2), "mean"), served, rtol=0, atol=1e-12)


def test_every_layer_reduction_is_a_candidate_and_members_needs_several():
    from offline.method.ood_fit import fit_layer_stats, fit_ood_stats, layer_candidate_scores, layer_columns, scores_np

    logits, feats, layers, y = _layer_data()
    fit, val = slice(0, 120), slice(120, 240)
    for m in (2, 1):
        stats = fit_ood_stats(feats[fit, :m], y[fit], 3, logits[val, :m], feats[val, :m], 1.0)
        md = torch.from_numpy(scores_np((logits[val, :m], feats[val, :m], None), stats, 1.0)["mahalanobis"])
        full = fit_layer_stats(layers[fit, :m], y[fit], 3, layers[val, :m], md)
        run = (logits[val, :m], feats[val, :m], layers[val, :m])
        names = set(layer_candidate_scores(layer_columns(run, stats, full, 1.0), full))
        reductions = {n.partition(":")[2] or "max" for n in names}
        assert reductions == ({"max", "mean", "members"} if m == 2 else {"max", "mean"})
        assert len(names) == 7 * len(reductions)


def test_layer_statistics_round_trip_and_shapes_are_checked(tmp_path):
    from offline.method.ood_fit import fit_layer_stats
    from service.core.ood import LayerStats, layer_scores, layer_tensors, layers_from_tensors

    _, _, layers, y = _layer_data()
    st = fit_layer_stats(layers[:120], y[:120], 3, layers[120:], torch.zeros(120), ids=(1, 2))
    save_file(layer_tensors(st), str(tmp_path / "l.safetensors"))
    back = layers_from_tensors(load_file(str(tmp_path / "l.safetensors")))
    assert back is not None and back.ids == (1, 2)
    torch.testing.assert_close(layer_scores(layers[:7], back), layer_scores(layers[:7], st), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not fit statistics"):
        layer_scores(layers[:7, :1], st)  # one member, statistics of two
    with pytest.raises(ValueError, match="norms must be"):
        LayerStats((1, 2), st.gaussians, st.pair_norms, (torch.zeros(2), torch.ones(2)))
    with pytest.raises(ValueError, match="reduce must be one of"):
        LayerStats((1, 2), st.gaussians, st.pair_norms, st.column_norms, "median")
    # the reduction travels with the statistics; files written before it was stored mean the largest column
    members = fit_layer_stats(layers[:120], y[:120], 3, layers[120:], torch.zeros(120), ids=(1, 2), reduce="members")
    tensors = layer_tensors(members)
    assert layers_from_tensors(tensors).reduce == "members"  # type: ignore[union-attr]
    assert layers_from_tensors({k: v for k, v in tensors.items() if k != "layers.reduce"}).reduce == "max"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown layer reduction"):
        layers_from_tensors({**tensors, "layers.reduce": torch.tensor([7])})
