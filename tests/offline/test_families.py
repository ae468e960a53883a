"""Every registered model family (``offline/families`` ``ADAPTERS``) is whole: the builder's config and the manifest
accept its name, it has a base loader and a build pipeline, a fused module the server loads by name, and a tiny
artifact of it serves and exports (its fixture), so that a family half added fails here."""

from __future__ import annotations

import typing

import pytest
import torch

from offline import build as build_mod
from offline.config import ConfigError, families, load_config
from offline.data import ROOT
from offline.families import ADAPTERS, get_adapter
from offline.families.vit import ViTAdapter
from offline.models.export import export_onnx, export_torchscript
from offline.pipelines import bases
from offline.pipelines import classifier_build as pipeline
from offline.pipelines import zeroshot_build as pipeline_clip
from service.core.fused import tiny_config
from service.core.manifest import Manifest
from service.core.registry import ARCHS, build_model
from tests.fixtures.tiny_artifact import example_inputs, tiny_clip_config

TINY = {"vit": lambda: tiny_config("vit"), "bert": lambda: tiny_config("bert"), "clip": tiny_clip_config}


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_family_is_registered_everywhere(family):
    assert family in families()  # the config's names are the registry's
    assert family in typing.get_args(Manifest.model_fields["family"].annotation)
    assert family in ARCHS  # the server builds its fused model by name
    adapter = get_adapter(family)
    assert adapter.name == family
    assert build_mod.pipeline_of(family) is adapter.build_step("pipeline")  # the build runs the pipeline it names
    assert callable(adapter.build_step("base_loader")), f"{family}: no base loader"
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


def test_the_registered_loaders_are_the_builders_own():
    assert get_adapter("vit").build_step("base_loader") is bases.vit_base
    assert get_adapter("bert").build_step("base_loader") is bases.bert_base
    assert get_adapter("clip").build_step("base_loader") is pipeline_clip.load_base_clip
    assert get_adapter("vit").build_step("pipeline") is pipeline.build


class _MadeUp(ViTAdapter):
    """A made-up classifier family: the ViT layout under another name, with its own base loader."""

    name = "made-up"
    base_loader = "tests.offline.test_families:_made_up_base"


def _made_up_base(cfg, data, ckpt):
    return ("made-up base", cfg.family, data, ckpt)


def test_a_made_up_family_is_one_entry_in_one_registry(tmp_path, monkeypatch):
    """Registering an adapter is the whole builder-side edit: the config accepts the family, load_base runs the
    loader it names with the base's checkpoint folder, and the build would run the classifier pipeline."""
    monkeypatch.setitem(ADAPTERS, "made-up", _MadeUp)
    cfg = load_config(None, {"family": "made-up", "data.setting": "fashion-mnist", "hydra.prune_per_layer": 1})
    assert cfg.family == "made-up" and "made-up" in families()
    got = pipeline.load_base(cfg, "data", tmp_path)  # type: ignore[arg-type]
    assert got == ("made-up base", "made-up", "data", tmp_path / ".checkpoints" / "base")
    assert get_adapter("made-up").build_step("pipeline") is pipeline.build
    assert build_mod.pipeline_of("made-up") is pipeline.build  # read from the registry when the build runs


def test_a_family_whose_build_is_not_a_classifiers_is_refused_in_one_line(tmp_path):
    cfg = load_config(ROOT / "offline" / "configs" / "zeroshot-fast.yaml")
    with pytest.raises(ConfigError, match=r"family 'clip' is not a classifier family \(vit, bert\)"):
        pipeline.load_base(cfg, None, tmp_path)  # type: ignore[arg-type]


def test_a_family_naming_no_loader_fails_naming_what_is_missing(monkeypatch):
    class Half(ViTAdapter):
        name = "half"
        base_loader = ""

    class Wrong(ViTAdapter):
        name = "wrong"
        base_loader = "offline.pipelines.bases:no_such_loader"

    with pytest.raises(LookupError, match=r"family 'half' names no base loader"):
        Half().build_step("base_loader")
    with pytest.raises(
        LookupError, match=r"family 'wrong': base loader 'offline.pipelines.bases:no_such_loader' is not a"
    ):
        Wrong().build_step("base_loader")
    with pytest.raises(ConfigError, match=r"family must be one of \('vit', 'bert', 'clip'\), got 'half'"):
        load_config(None, {"family": "half", "data.setting": "fashion-mnist", "hydra.prune_per_layer": 1})
