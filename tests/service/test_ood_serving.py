"""Serving the feature-space OOD scores: the server computes, from the fused pass's features and the artifact's
statistics, exactly what the builder's code computes for the same input, in every backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from offline.method.ood_fit import scores_np
from service.core.artifact import OOD_SCORES, ArtifactError, load_manifest, parse_manifest
from service.core.ood import ood_from_tensors
from service.core.preprocess import ImagePreprocessor, make_preprocessor
from service.core.registry import load_model
from service.core.uncertainty import OOD_METRICS
from service.entrypoints.app import create_app
from service.runtime.interface import load_ood_stats
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import assert_error, b64, noise_images, png, settings_for


@pytest.fixture(scope="module")
def ood_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT whose served score is the members' Mahalanobis distance (threshold at 95 % of random inputs)."""
    return make_tiny_artifact(
        tmp_path_factory.mktemp("ood") / "vit",
        "vit",
        name="tiny-ood",
        ood=True,
        ood_score="mahalanobis",
        ood_threshold=None,
    )


@pytest.fixture(scope="module", params=[("vit", "max"), ("bert", "max"), ("vit", "members"), ("bert", "mean")])
def layers_artifact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose served score is mahalanobis_layers (its layer features exported too), its columns
    combined by each reduction the builder may choose."""
    family, reduce = request.param
    return make_tiny_artifact(
        tmp_path_factory.mktemp("layers") / f"{family}-{reduce}",
        family,
        name=f"tiny-layers-{family}",
        ood=True,
        ood_score="mahalanobis_layers",
        ood_threshold=None,
        layers_reduce=reduce,
    )


def builder_scores(root: Path, images: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The builder's scores (offline.method.ood_fit.scores_np) of ``images`` through the eager model and the
    artifact."""
    m = load_manifest(root)
    model = load_model(root / m.model.weights, m.model.config)
    model.with_features = True
    model.with_layer_features = "layer_features" in m.model.outputs
    pre = ImagePreprocessor(m.preprocessing, 1 << 20)
    x = torch.stack([pre(png(a)) for a in images])
    with torch.inference_mode():
        outs = model(x)
    stats = ood_from_tensors(load_file(str(root / m.ood.file)))
    return scores_np((*outs[:2], outs[2] if len(outs) > 2 else None), stats, m.uncertainty.temperature)


def test_the_artifact_lists_the_scores_and_the_features_output(ood_artifact):
    m = load_manifest(ood_artifact)
    assert m.model.outputs == ["logits", "features"]
    assert m.ood.selected == m.uncertainty.ood_score == "mahalanobis"
    assert sorted(OOD_SCORES) == sorted(OOD_METRICS)
    # every score but the multi-layer one, whose layer statistics an artifact carries only when it serves it
    assert sorted(m.ood.scores) == sorted(set(OOD_SCORES) - {"mahalanobis_layers"})
    assert m.ood.file == "ood.safetensors" and m.ood.file in m.files


@pytest.mark.parametrize("backend", ["torch", "torchscript", "onnx"])
def test_served_scores_equal_the_builders_in_every_backend(ood_artifact, backend):
    images = noise_images(5, seed=3)
    want = builder_scores(ood_artifact, images)
    app = create_app(settings_for(ood_artifact, backend=backend))
    with TestClient(app) as c:
        r = c.post("/predict", json={"images": [b64(png(a)) for a in images], "return_scores": True})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    threshold = load_manifest(ood_artifact).uncertainty.ood_threshold
    for i, p in enumerate(preds):
        assert p["ood"]["metric"] == "mahalanobis"
        assert set(p["ood"]["scores"]) == set(OOD_SCORES) - {"mahalanobis_layers"}
        for name, value in p["ood"]["scores"].items():
            assert value == pytest.approx(float(want[name][i]), rel=1e-4, abs=1e-4), (name, i)
        assert p["ood"]["score"] == pytest.approx(float(want["mahalanobis"][i]), rel=1e-4, abs=1e-4)
        assert p["ood"]["score"] == p["ood"]["scores"]["mahalanobis"]  # the served value is the listed one, exactly
        assert p["ood"]["flag"] == (float(want["mahalanobis"][i]) > threshold)


@pytest.mark.parametrize("backend", ["torch", "torchscript", "onnx"])
def test_layer_score_served_equals_the_builders_in_every_backend(layers_artifact, backend):
    """mahalanobis_layers from the exported layer features (eager, TorchScript, ONNX) is the builder's number."""
    m = load_manifest(layers_artifact)
    assert m.model.outputs == ["logits", "features", "layer_features"] and m.ood.layers == [0]
    assert "mahalanobis_layers" in m.ood.scores
    pre = make_preprocessor(m.preprocessing, layers_artifact, 1 << 20)
    if m.family == "vit":
        images = noise_images(5, seed=4)
        items, body = [pre(png(a)) for a in images], {"images": [b64(png(a)) for a in images]}
    else:
        texts = ["a short one", "quite a bit longer text than the first", "third", "x y z w", "the fifth text"]
        items, body = pre.encode(texts), {"texts": texts}
    model = load_model(layers_artifact / m.model.weights, m.model.config)
    model.with_features = model.with_layer_features = True
    with torch.inference_mode():
        outs = model(**pre.collate(items))
    stats = ood_from_tensors(load_file(str(layers_artifact / "ood.safetensors")))
    assert stats.layers is not None and stats.layers.reduce == (m.ood.layers_reduce or "max")
    want = scores_np(tuple(outs), stats, m.uncertainty.temperature)
    app = create_app(settings_for(layers_artifact, backend=backend))
    with TestClient(app) as c:
        r = c.post("/predict", json={**body, "return_scores": True})
    assert r.status_code == 200, r.text
    for i, p in enumerate(r.json()["predictions"]):
        assert p["ood"]["metric"] == "mahalanobis_layers"
        assert p["ood"]["scores"]["mahalanobis_layers"] == pytest.approx(
            float(want["mahalanobis_layers"][i]), rel=1e-4, abs=1e-4
        )
        assert p["ood"]["score"] == p["ood"]["scores"]["mahalanobis_layers"]
    doc = m.to_dict()
    bad = {**doc, "model": {**doc["model"], "outputs": ["logits", "features"]}}
    with pytest.raises(ArtifactError, match="layer_features"):
        parse_manifest(bad)


def test_scores_only_when_asked_for_and_in_multipart_forms(ood_artifact):
    app = create_app(settings_for(ood_artifact))
    with TestClient(app) as c:
        plain = c.post("/predict", json={"image": b64(png(7))}).json()["predictions"][0]
        form = c.post("/predict", files=[("file", ("a.png", png(7), "image/png"))], data={"return_scores": "true"})
        bad = c.post("/predict", json={"image": b64(png(7)), "return_scores": "yes"})
    assert "scores" not in plain["ood"] and plain["ood"]["metric"] == "mahalanobis"
    assert form.status_code == 200, form.text
    scores = form.json()["predictions"][0]["ood"]["scores"]
    assert scores["mahalanobis"] == pytest.approx(plain["ood"]["score"], rel=1e-6)
    assert_error(bad, 422, "invalid_input", "return_scores")


def test_an_artifact_without_statistics_answers_its_probability_scores(artifacts):
    """Older artifacts (no ood block) keep serving: return_scores gives the three probability scores."""
    app = create_app(settings_for(artifacts["vit"]))
    with TestClient(app) as c:
        p = c.post("/predict", json={"image": b64(png(9)), "return_scores": True}).json()["predictions"][0]
    assert set(p["ood"]["scores"]) == {"msp", "entropy", "mutual_information"}
    assert p["ood"]["scores"]["msp"] == pytest.approx(p["uncertainty"]["msp"])


def test_manifest_refuses_a_feature_score_without_statistics_or_features(ood_artifact):
    m = load_manifest(ood_artifact).to_dict()
    no_ood = {k: v for k, v in m.items() if k != "ood"}
    with pytest.raises(ArtifactError, match="needs an ood block"):
        parse_manifest(no_ood)
    no_features = {**m, "model": {**m["model"], "outputs": ["logits"]}}
    with pytest.raises(ArtifactError, match="no 'features'"):
        parse_manifest(no_features)
    other = {**m, "ood": {**m["ood"], "selected": "energy"}}
    with pytest.raises(ArtifactError, match="differs from uncertainty.ood_score"):
        parse_manifest(other)


def test_statistics_for_another_model_refuse_to_load(ood_artifact, tmp_path):
    """OOD statistics of a model with other classes: the server refuses the artifact at start-up, naming the file."""
    other = make_tiny_artifact(
        tmp_path / "other", "vit", labels=["a", "b"], ood=True, ood_score="mahalanobis", ood_threshold=None
    )
    (ood_artifact.parent / "mixed").mkdir(exist_ok=True)
    mixed = ood_artifact.parent / "mixed"
    for f in ood_artifact.iterdir():
        if f.is_file():
            (mixed / f.name).write_bytes(f.read_bytes())
    (mixed / "ood.safetensors").write_bytes((other / "ood.safetensors").read_bytes())
    with pytest.raises(ArtifactError, match="2 classes"):
        load_ood_stats(mixed, load_manifest(mixed))
