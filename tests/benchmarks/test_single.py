"""The Single model of an artifact (benchmarks/single.py): the fused config as its unpruned base, one stream, written
as an artifact the server's backends load, for the server benchmark's served / raw Single ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.single import single_artifact, single_config
from service.core.artifact import load_manifest
from service.core.fused import tiny_config
from service.runtime.plan import Plan, load_backend
from tests.fixtures.tiny_artifact import make_tiny_artifact


def test_the_single_config_is_the_unpruned_base_with_one_stream():
    cfg = {**tiny_config("vit", members=3), "num_heads": [3, 2], "shared_blocks": 1}
    single = single_config(cfg)
    assert single["members"] == 1 and single["num_heads"] == [4, 4] and "shared_blocks" not in single
    assert cfg["members"] == 3 and cfg["shared_blocks"] == 1  # the artifact's config is left alone
    with pytest.raises(ValueError, match="cannot infer the base's heads"):
        single_config({**cfg, "head_dim": 7})


@pytest.mark.parametrize("trunk", [0, 1])
def test_the_single_artifact_loads_in_every_backend_and_answers_one_member(tmp_path: Path, trunk: int):
    """From an artifact with or without a shared trunk (the manifest says so at the top level and in its config):
    the Single has neither, and runs in eager, TorchScript and ONNX with the artifact's outputs."""
    art = make_tiny_artifact(tmp_path / "hydra", "vit", ood=True)
    if trunk:  # the Single is built from the config alone: a trunk in the manifest is what it must drop
        doc = json.loads((art / "manifest.json").read_text())
        doc["shared_blocks"] = doc["model"]["config"]["shared_blocks"] = trunk
        (art / "manifest.json").write_text(json.dumps(doc))
    example = {"pixel_values": torch.randn(2, 1, 16, 16)}
    single = single_artifact(art, tmp_path / "single", example)
    manifest = load_manifest(single)
    assert manifest.members == 1 and manifest.model.config["num_heads"] == [4, 4]
    assert manifest.shared_blocks is None and "shared_blocks" not in manifest.model.config
    for backend in ("torch", "torchscript", "onnx"):
        outs = load_backend(single, manifest, Plan(backend, "cpu", "fp32", "test")).outputs(example)
        assert outs[0].shape == (2, 1, 4) and outs[1].shape[:2] == (2, 1), backend  # logits and features


def test_a_text_artifacts_single_keeps_its_tokenizer(tmp_path: Path):
    from service.core.preprocess import make_preprocessor

    art = make_tiny_artifact(tmp_path / "bert", "bert", ood=True, exports=("onnx",))
    pre = make_preprocessor(load_manifest(art).preprocessing, art, 10**6)
    example = pre.collate(pre.encode(["a fine day", "meh"]))
    single = single_artifact(art, tmp_path / "single", example)
    manifest = load_manifest(single)
    pre = make_preprocessor(manifest.preprocessing, single, 10**6)  # reads the tokenizer from the Single's folder
    outs = load_backend(single, manifest, Plan("onnx", "cpu", "fp32", "test")).outputs(pre.collate(pre.encode(["x"])))
    assert outs[0].shape[:2] == (1, 1)
