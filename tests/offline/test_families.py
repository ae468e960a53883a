"""Every registered model family (``offline/families`` ``ADAPTERS``) is whole: the builder's config and the manifest
accept its name, its row says its task, modality and arch, its base loader and pipeline are known, the server builds
its fused module by name, and a tiny model of it exports, so that a family half added fails here. A made-up family,
declared in this file alone (its adapter and its fused module), builds, serves and answers: a new family is its
adapter, its fused module and its tests, and nothing else of the tree names the families."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
from fastapi.testclient import TestClient

from offline import build as build_mod
from offline import families as families_mod
from offline.build import PIPELINES, build
from offline.config import ConfigError, families, load_config
from offline.data import ROOT
from offline.families import ADAPTERS, get_adapter
from offline.families.bert import BertAdapter
from offline.families.vit import ViTAdapter
from offline.models.export import export_onnx, export_torchscript
from offline.pipelines import bases, zeroshot_build
from offline.pipelines import classifier_build as pipeline
from service.core import families as family_table
from service.core import registry
from service.core.artifact import load_manifest
from service.core.families import FAMILIES, Family, register_family
from service.core.fused import FusedBert, tiny_config
from service.core.registry import ARCHS, build_model
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import example_inputs, tiny_clip_config
from tests.service.helpers import settings_for

from .conftest import LABELS, ticket_config

TINY = {"vit": lambda: tiny_config("vit"), "bert": lambda: tiny_config("bert"), "clip": tiny_clip_config}


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_family_is_registered_everywhere(family):
    adapter = get_adapter(family)
    row = FAMILIES[family]
    assert adapter.row is row and adapter.name == family
    assert family in families()  # the config's names are the registry's
    assert row.arch in ARCHS  # the server builds its fused model by name
    assert build_mod.pipeline_of(family) is PIPELINES[row.task]
    assert adapter.base_loader in bases.BASE_LOADERS, f"{family}: base loader {adapter.base_loader!r} unknown"
    assert family in TINY, f"{family}: no tiny config for the test fixtures"
    if row.baselines:
        assert re.compile(adapter.lora_targets) and adapter.lora_targets  # the LoRA baseline's targets


def test_the_tables_hold_the_families_in_one_order():
    assert list(ADAPTERS) == list(FAMILIES) == ["vit", "bert", "clip"]
    assert set(PIPELINES) == set(family_table.TASKS)


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
    assert bases.base_loader("vit") is bases.vit_base
    assert bases.base_loader("bert") is bases.bert_base
    assert bases.base_loader("clip") is bases.load_base_clip
    assert build_mod.pipeline_of("vit") is pipeline.build
    assert build_mod.pipeline_of("clip") is zeroshot_build.build_zero_shot


def test_a_family_whose_build_is_not_a_classifiers_is_refused_in_one_line(tmp_path):
    cfg = load_config(ROOT / "offline" / "configs" / "zeroshot-fast.yaml")
    with pytest.raises(ConfigError, match=r"family 'clip' is not a classifier family \(vit, bert\); it is a zero-shot"):
        pipeline.load_base(cfg, None, tmp_path)  # type: ignore[arg-type]


def test_a_family_naming_an_unknown_loader_or_an_unknown_name_fails_in_one_line(monkeypatch):
    class Wrong(ViTAdapter):
        base_loader = "no-such-loader"

    monkeypatch.setitem(ADAPTERS, "vit", Wrong)
    with pytest.raises(ConfigError, match=r"family 'vit' names base loader 'no-such-loader'; known: timm, hug"):
        bases.base_loader("vit")
    with pytest.raises(ConfigError, match=r"family must be one of \('vit', 'bert', 'clip'\), got 'half'"):
        load_config(None, {"family": "half", "data.setting": "fashion-mnist", "hydra.prune_per_layer": 1})
    with pytest.raises(ValueError, match=r"family 'vit' is registered already"):
        register_family(Family("vit", task="classification", modality="text", arch="bert"))
    with pytest.raises(ValueError, match=r"task must be one of"):
        Family("x", task="detection", modality="image", arch="x")


def test_the_config_checks_read_the_row():
    with pytest.raises(ConfigError, match=r"family bert needs text data, but data.setting is fashion-mnist"):
        load_config(None, {"family": "bert", "data.setting": "fashion-mnist", "hydra.prune_per_layer": 1})
    with pytest.raises(ConfigError, match=r"shared trunk is for the vit and bert families, not clip"):
        load_config(ROOT / "offline" / "configs" / "zeroshot-fast.yaml", {"hydra.shared_blocks": 1})


def test_no_file_outside_a_familys_own_lists_the_families():
    """The family names are written as a list in the family table alone: no tuple or Literal of them elsewhere."""
    files = subprocess.run(["git", "ls-files", "service", "offline"], cwd=ROOT, capture_output=True, text=True)
    pattern = re.compile(r"""["']vit["'],\s*["']bert["']|["']bert["'],\s*["']clip["']|["']vit["'],\s*["']clip["']""")
    listed = [f for f in files.stdout.split() if f.endswith(".py") and pattern.search((ROOT / f).read_text())]
    assert listed == []


# ----------------------------------------------------------------------------- a made-up family, in this file alone
MADE_UP = Family("made-up", task="classification", modality="text", arch="made-up-bert")


class FusedMadeUp(FusedBert):
    """The made-up family's fused module: BERT's layout under an arch name of its own."""

    ARCH = "made-up-bert"


class MadeUpAdapter(BertAdapter):
    """The made-up family's adapter: everything about it, declared here."""

    row = MADE_UP
    base_loader = "huggingface"


@pytest.fixture
def made_up(monkeypatch):
    """The made-up family registered the way a family's two files register it, and removed afterwards."""
    monkeypatch.setitem(FAMILIES, MADE_UP.name, MADE_UP)
    monkeypatch.setitem(ARCHS, FusedMadeUp.ARCH, FusedMadeUp)
    monkeypatch.setitem(ADAPTERS, MADE_UP.name, MadeUpAdapter)
    assert registry.register_arch(FusedMadeUp) is FusedMadeUp and families_mod.register(MadeUpAdapter)
    return MADE_UP


def test_a_made_up_family_builds_serves_and_answers(made_up, user_files, tmp_path):
    ckpt, data = user_files
    cfg = ticket_config(ckpt, data, family="made-up")
    assert cfg.family == "made-up" and "made-up" in families()
    assert pipeline.heads_of_base(cfg) == [4, 4]  # counted by the adapter from the checkpoint's config.json
    out = build(cfg, tmp_path / "artifact")
    m = load_manifest(out)
    assert (m.family, m.task, m.model.config["arch"]) == ("made-up", "classification", "made-up-bert")
    with TestClient(create_app(settings_for(out))) as c:
        r = c.post("/predict", json={"texts": ["where is my parcel"], "top_k": 3})
        info = c.get("/v1/models").json()
    assert r.status_code == 200, r.text
    assert {t["label"] for t in r.json()["predictions"][0]["top_k"]} == set(LABELS)
    assert any(d.get("family") == "made-up" for d in info["models"]) or "made-up" in str(info)


def test_a_made_up_family_of_the_wrong_modality_is_refused(made_up, user_files):
    ckpt, data = user_files
    with pytest.raises(ConfigError, match=r"family made-up needs text data, but data.setting is fashion-mnist"):
        load_config(None, {"family": "made-up", "data.setting": "fashion-mnist", "hydra.prune_per_layer": 1})
