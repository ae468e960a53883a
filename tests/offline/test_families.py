"""Every registered model family (``offline/families`` ``ADAPTERS``) is whole: the builder's config and the manifest
accept its name, it has a base loader and a build pipeline, a fused module the server loads by name, and a tiny
artifact of it serves and exports (its fixture), so that a family half added fails here."""

from __future__ import annotations

import typing

import pytest
import torch

from offline import build as build_mod
from offline import pipeline, pipeline_clip
from offline.config import FAMILIES
from offline.export import export_onnx, export_torchscript
from offline.families import ADAPTERS, get_adapter
from service.core.fused import tiny_config
from service.core.manifest import Manifest
from service.core.registry import ARCHS, build_model
from tests.fixtures.tiny_artifact import example_inputs, tiny_clip_config

TINY = {"vit": lambda: tiny_config("vit"), "bert": lambda: tiny_config("bert"), "clip": tiny_clip_config}


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_family_is_registered_everywhere(family):
    assert family in FAMILIES  # the config's names are the registry's
    assert family in typing.get_args(Manifest.model_fields["family"].annotation)
    assert family in ARCHS  # the server builds its fused model by name
    assert family in build_mod.PIPELINES
    loader = pipeline.BASE_LOADERS.get(family) or (family == "clip" and pipeline_clip.load_base_clip)
    assert callable(loader), f"{family}: no base loader"
    assert get_adapter(family).name == family
    assert family in TINY, f"{family}: no tiny config for the test fixtures"


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_every_classifier_family_builds_and_exports_its_tiny_model(family, tmp_path):
    model = build_model(TINY[family]()).eval()
    inputs = example_inputs(family, cfg=model.cfg)
    with torch.inference_mode():
        out = model(*inputs.values())
    assert out.shape[1] == model.members
    export_torchscript(model, inputs, tmp_path / "model.ts")
    export_onnx(model, inputs, tmp_path / "model.onnx", ["logits"])
    assert (tmp_path / "model.ts").stat().st_size > 0 and (tmp_path / "model.onnx").stat().st_size > 0


def test_the_zero_shot_family_builds_its_tiny_model():
    model = build_model(TINY["clip"]()).eval()
    assert type(model) is ARCHS["clip"]


def test_a_family_without_a_base_loader_is_refused_in_one_line(tmp_path, monkeypatch):
    from offline.config import ConfigError, load_config

    monkeypatch.delitem(pipeline.BASE_LOADERS, "bert")
    cfg = load_config(None, {"family": "bert", "data.setting": "tweets", "hydra.prune_per_layer": 1})
    with pytest.raises(ConfigError, match=r"family 'bert' is not a classifier family \(vit\)"):
        pipeline.load_base(cfg, None, tmp_path)  # type: ignore[arg-type]
