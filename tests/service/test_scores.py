"""The OOD score registry (``service/core/scores.py``): every entry is complete (its direction, inputs and function
exist and compute it), every registered score is served through HTTP by a tiny artifact as the builder computes
it, and a made-up score added as one entry and its function is computed by the ensemble's dispatch."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from offline.method.ood_fit import scores_np
from service.core import ood, scores
from service.core.artifact import load_manifest
from service.core.registry import load_model
from service.core.uncertainty import ood_flag, summarize
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import b64, noise_images, png, settings_for


@pytest.fixture(scope="module")
def layers_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT with every statistic a score can read (its layer features too)."""
    return make_tiny_artifact(
        tmp_path_factory.mktemp("scores") / "vit", "vit", ood=True, ood_score="mahalanobis_layers", exports=()
    )


def _outputs(root: Path, n: int = 6) -> tuple[tuple[torch.Tensor, ...], ood.OODStats, float]:
    m = load_manifest(root)
    model = load_model(root / m.model.weights, m.model.config)
    model.with_features = model.with_layer_features = True
    with torch.inference_mode():
        outs = model(torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(3)))
    return outs, ood.ood_from_tensors(load_file(str(root / m.ood.file))), m.uncertainty.temperature


def test_every_entry_is_computed_by_the_path_it_names(layers_artifact):
    (logits, features, layers), stats, T = _outputs(layers_artifact)
    summary_fields = set(summarize(logits, T))
    per_member = ood.member_scores(logits, features, stats.gaussians, T)
    everything = ood.ensemble_scores(logits, features, stats, T, layer_features=layers)
    assert list(everything) == [*scores.SUMMARY_SCORES, *scores.PER_MEMBER_SCORES, *ood.COMBINED]
    assert set(everything) == set(scores.SCORES)
    for s in scores.SCORES.values():
        assert isinstance(s.higher_is_id, bool) and s.needs
        assert set(s.members) <= set(per_member), s.name  # what it combines is computed per member
        paths = [s.name in summary_fields, s.name in scores.PER_MEMBER_SCORES, s.name in ood.COMBINED]
        assert sum(paths) == 1, (s.name, paths)  # exactly one function computes it
        alone = ood.ensemble_scores(logits, features, stats, T, layer_features=layers, only=s.name)
        torch.testing.assert_close(alone[s.name], everything[s.name])  # the per-request path: the same value
        if "layer_features" in s.needs:  # without what it needs it is left out, never made up
            assert s.name not in ood.ensemble_scores(logits, features, stats, T)
    assert scores.OOD_METRICS["msp"] is True and not any(v for k, v in scores.OOD_METRICS.items() if k != "msp")


@pytest.mark.parametrize("name", list(scores.SCORES))
def test_every_registered_score_is_served_as_the_builder_computes_it(name, tmp_path):
    root = make_tiny_artifact(tmp_path / name, "vit", ood=True, ood_score=name, ood_threshold=None, exports=())
    m = load_manifest(root)
    images = noise_images(4, seed=5)
    model = load_model(root / m.model.weights, m.model.config)
    model.with_features = True
    model.with_layer_features = "layer_features" in m.model.outputs
    with TestClient(create_app(settings_for(root))) as c:
        r = c.post("/predict", json={"images": [b64(png(a)) for a in images], "return_scores": True})
    assert r.status_code == 200, r.text
    from service.core.preprocess import ImagePreprocessor

    pre = ImagePreprocessor(m.preprocessing, 1 << 20)
    with torch.inference_mode():
        outs = model(torch.stack([pre(png(a)) for a in images]))
    stats = ood.ood_from_tensors(load_file(str(root / m.ood.file)))
    want = scores_np((*outs[:2], outs[2] if len(outs) > 2 else None), stats, m.uncertainty.temperature)[name]
    got = np.array([p["ood"]["score"] for p in r.json()["predictions"]])
    assert all(p["ood"]["metric"] == name for p in r.json()["predictions"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_made_up_score_is_one_entry_and_its_function(layers_artifact, monkeypatch):
    """A new score made of others: its registry entry names its function; the dispatch computes it, in the
    registry's order, alone and with every other."""

    def energy_minus_mi(out, per_member, stats, layers):
        return out["energy"] - out["mutual_information"] if "energy" in out else None

    entry = scores.Score("energy_minus_mi", False, ("logits",), 10, members=("energy",), combine="energy_minus_mi")
    monkeypatch.setitem(scores.SCORES, entry.name, entry)  # the one registry edit ...
    monkeypatch.setattr(ood, "energy_minus_mi", energy_minus_mi, raising=False)  # ... and its function
    monkeypatch.setattr(ood, "COMBINED", ood._combined())  # what importing ood derives from the registry
    (logits, features, layers), stats, T = _outputs(layers_artifact)
    every = ood.ensemble_scores(logits, features, stats, T, layer_features=layers)
    assert list(every)[-1] == "energy_minus_mi"
    torch.testing.assert_close(every["energy_minus_mi"], every["energy"] - every["mutual_information"])
    alone = ood.ensemble_scores(logits, features, stats, T, only="energy_minus_mi")
    torch.testing.assert_close(alone["energy_minus_mi"], every["energy_minus_mi"])
    broken = scores.Score("broken", False, ("logits",), 11, combine="no_such_function")
    monkeypatch.setitem(scores.SCORES, broken.name, broken)
    with pytest.raises(ImportError, match="score 'broken' names combine 'no_such_function'"):
        ood._combined()


def test_a_scores_direction_has_one_owner():
    """Only ``service/core/scores.py`` reads which way a score points (``outlier_sign``, ``flag_side``): no other
    module of the server, the builder or the benchmarks indexes ``OOD_METRICS`` or reads ``higher_is_id``; and the
    oriented score flags exactly where the raw comparison the other way round does."""
    root = Path(__file__).resolve().parents[2]
    reads = re.compile(r"OOD_METRICS\s*(\[|\.get\(|\.items\(|\.values\()|\.higher_is_id")
    found = [
        str(p.relative_to(root))
        for pkg in ("service", "offline", "benchmarks")
        for p in (root / pkg).rglob("*.py")
        if p.name != "scores.py" and reads.search(p.read_text())
    ]
    assert found == []
    assert [scores.outlier_sign(n) for n in ("msp", "entropy")] == [-1.0, 1.0]
    assert (scores.flag_side("msp"), scores.flag_side("energy")) == ("below", "above")
    with pytest.raises(ValueError, match="unknown OOD score 'nope'"):
        scores.outlier_sign("nope")
    x = torch.tensor([0.1, 0.5, 0.50000006, 0.9])
    for name in ("msp", "energy"):
        want = x < 0.5 if name == "msp" else x > 0.5
        assert torch.equal(ood_flag(x, name, 0.5), want)
