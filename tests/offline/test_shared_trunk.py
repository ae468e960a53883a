"""The shared trunk (``hydra.shared_blocks``): members that leave their first k blocks whole and untrained fuse into a
model that runs those blocks once. It equals the members run one by one, in eager, TorchScript and ONNX; its
builder refuses a trunk that does not fit in one line; its artifact says so, and a server that predates the field
refuses it instead of serving a model without the trunk."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError, create_model

from offline.build import build
from offline.config import ConfigError, check_budget, load_config
from offline.families import get_adapter
from offline.method.fusion import fuse
from offline.method.members import Budget, sample_members
from offline.models.export import check_parity, export_onnx, export_torchscript
from offline.pipelines.classifier_build import check_request
from offline.stages.finetune import member_train_config
from offline.train.parts import trainable_names
from service.core.artifact import load_manifest
from service.core.manifest import Manifest
from service.core.registry import load_model
from service.entrypoints.app import create_app
from tests.service.helpers import settings_for

from .conftest import LABELS, bert_batch, ticket_build, ticket_config, tiny_bert, tiny_vit

K = 2  # of the tiny models' 4 blocks: the trunk
# members prune only after the trunk: every head kept before it, unequal head counts after it
KEEPS = [
    [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [1, 3]],
    [[0, 1, 2, 3], [0, 1, 2, 3], [3], []],
    [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2], [1, 2, 3]],
]


def _vit_batch(n: int = 5, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))}


def _members(family: str, mlp: str = "per_member") -> tuple[list[torch.nn.Module], dict[str, torch.Tensor]]:
    """Three members pruned after the trunk, then each "fine-tuned" there alone: a different random change to every
    parameter the member trains with ``last_blocks = 4 - K`` (blocks from K on, the final norm, the head), their MLPs
    left alike for ``mlp="shared"`` (the shared MLP is the members' mean: equal to theirs only when they agree)."""
    base = tiny_vit(depth=4) if family == "vit" else tiny_bert(layers=4)
    adapter = get_adapter(family)
    members = [adapter.prune(base, k) for k in KEEPS]
    parts = "all" if mlp == "per_member" else "attention+norm+head"
    for i, m in enumerate(members):
        trained = set(trainable_names(m, parts, last_blocks=4 - K))
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name in trained:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return members, _vit_batch() if family == "vit" else bert_batch()


@pytest.mark.parametrize("family", ["vit", "bert"])
@pytest.mark.parametrize("mlp", ["shared", "per_member"])
def test_trunk_model_equals_members_and_runs_the_trunk_once(family, mlp):
    members, batch = _members(family, mlp)
    adapter = get_adapter(family)
    fused, cfg = fuse(adapter, members, mlp=mlp, shared_blocks=K)
    assert cfg["shared_blocks"] == K and fused.encoder.shared_blocks == K
    trunk = fused.encoder.blocks[0]
    assert trunk.attn.qkv.weight.shape[0] == 1 and fused.encoder.blocks[K].attn.qkv.weight.shape[0] == 3
    with torch.no_grad():
        out = fused(**batch)
        for m, member in enumerate(members):
            torch.testing.assert_close(out[:, m], adapter.forward(member, batch), atol=1e-5, rtol=0)
        # the features and the pooled layer features the OOD scores read: those of the model without a trunk
        plain, _ = fuse(adapter, members, mlp=mlp)
        for model in (fused, plain):
            model.with_features = model.with_layer_features = True
        for a, b in zip(fused(**batch), plain(**batch), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the trunk holds one stream's weights: fewer parameters than the same members fused without it
    assert sum(p.numel() for p in fused.parameters()) < sum(p.numel() for p in plain.parameters())


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_trunk_model_exports_to_torchscript_and_onnx(family, tmp_path):
    members, batch = _members(family)
    fused, _ = fuse(get_adapter(family), members, shared_blocks=K)
    fused.with_features = fused.with_layer_features = True
    checks = [_vit_batch(b, 10 + b) for b in (1, 4)] if family == "vit" else [bert_batch(b, 7, b) for b in (2, 5)]
    export_torchscript(fused, batch, tmp_path / "model.ts")
    assert check_parity(fused, tmp_path / "model.ts", "torchscript", checks, 1e-4) <= 1e-4
    names = ["logits", "features", "layer_features"]
    export_onnx(fused, batch, tmp_path / "model.onnx", names)
    assert check_parity(fused, tmp_path / "model.onnx", "onnx", checks, 1e-4) <= 1e-4


def test_fusion_refuses_members_that_differ_in_the_trunk():
    members, _ = _members("vit")
    with torch.no_grad():
        members[1].blocks[1].norm1.weight.add_(0.01)  # block 1 is in the trunk: trained by one member
    with pytest.raises(ValueError, match=r"shared trunk: the members differ in encoder\.blocks\.1\.norm1\.weight"):
        fuse(get_adapter("vit"), members, shared_blocks=K)


def test_sampled_members_keep_every_head_of_the_trunk():
    heads = [4, 4, 4, 4]
    ranking = [(lay, h) for h in range(4) for lay in range(4)]  # trunk heads first: they must be skipped
    per_layer = sample_members(ranking, heads, Budget(per_layer=2), [0, 1, 2], shared=K)
    total = sample_members(ranking, heads, Budget(total=3), [0, 1, 2], pool=5, shared=K)
    for keep in per_layer + total:
        assert keep[:K] == [[0, 1, 2, 3]] * K
    assert all(sum(map(len, keep[K:])) == 4 for keep in per_layer)
    assert all(sum(map(len, keep[K:])) == 5 for keep in total)
    with pytest.raises(ValueError, match="cannot prune 9 heads: the model has 8"):
        sample_members(ranking, heads, Budget(total=9), [0], shared=K)


def test_members_fine_tune_only_after_the_trunk(user_files):
    ckpt, data = user_files  # a 2-block BERT
    runs = member_train_config(ticket_config(ckpt, data, **{"hydra.shared_blocks": 1}), 0, depth=2)
    assert runs.last_blocks == 1
    model = tiny_bert(layers=2)
    names = trainable_names(model, runs.unfreeze, runs.last_blocks)
    assert names and not [n for n in names if "embeddings" in n or ".layer.0." in n]
    explicit = member_train_config(
        ticket_config(ckpt, data, **{"hydra.shared_blocks": 1, "hydra.finetune_blocks": 1}), 0
    )
    assert explicit.last_blocks == 1


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"hydra.shared_blocks": 2}, r"hydra\.shared_blocks must be in \[0, 2\) for the base model's 2 blocks, got 2"),
        ({"hydra.shared_blocks": -1}, r"hydra\.shared_blocks must be an integer >= 0, got -1"),
        (
            {"hydra.shared_blocks": 1, "hydra.finetune_blocks": 2},
            r"hydra\.finetune_blocks=2 would train blocks of the shared trunk \(hydra\.shared_blocks=1 of 2\)",
        ),
        (
            {"hydra.shared_blocks": 1, "hydra.prune_per_layer": None, "hydra.prune_total": 5},
            r"hydra\.prune_total=5 exceeds the 4 heads after the shared trunk \(hydra\.shared_blocks=1\)",
        ),
    ],
)
def test_a_trunk_that_does_not_fit_fails_in_one_line_before_anything_loads(user_files, tmp_path, over, message):
    ckpt, data = user_files
    with pytest.raises(ConfigError, match=message) as err:
        cfg = ticket_config(ckpt, data, **over)  # load_config validates
        check_request(cfg, tmp_path / "out", None, None)  # what the build runs before any data or weights load
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_zero_shot_trunk_is_refused():
    with pytest.raises(ConfigError, match="a shared trunk is for the vit and bert families, not clip"):
        load_config("offline/configs/zeroshot-fast.yaml", {"hydra.shared_blocks": 1})


def test_check_budget_counts_only_the_heads_after_the_trunk(user_files):
    ckpt, data = user_files
    cfg = ticket_config(ckpt, data, **{"hydra.shared_blocks": 1, "hydra.prune_per_layer": None, "hydra.prune_total": 4})
    check_budget(cfg, [4, 4])  # all 4 heads of the one layer after the trunk: allowed


def _older_manifest() -> type:
    """The manifest model of a server that predates ``shared_blocks``: the same closed top level without it."""
    fields = {n: (f.annotation, f) for n, f in Manifest.model_fields.items() if n != "shared_blocks"}
    return create_model("OlderManifest", __config__=Manifest.model_config, **fields)


def test_a_trunk_build_serves_its_members_and_an_older_server_refuses_it(user_files, tmp_path):
    ckpt, data = user_files
    over = {"hydra.shared_blocks": 1, "export.torchscript": True}
    out = build(load_config(None, ticket_build(ckpt, data, **over)), tmp_path / "artifact")
    m = load_manifest(out)
    assert m.shared_blocks == 1 and m.model.config["shared_blocks"] == 1
    assert all(keep[0] == [0, 1, 2, 3] for keep in m.heads)  # the trunk's layer keeps every head in every member
    assert {e for e in m.exports} >= {"torchscript", "onnx"}  # exported and checked against eager by the build
    model = load_model(out / "model.safetensors", m.model.config)
    assert model.encoder.blocks[0].attn.qkv.weight.shape[0] == 1
    app = create_app(settings_for(out, backend="onnx"))
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        r = c.post("/predict", json={"texts": ["where is my parcel"]})
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["label"] in LABELS
    doc = json.loads((out / "manifest.json").read_text())
    with pytest.raises(ValidationError, match="shared_blocks") as err:
        _older_manifest().model_validate(doc)
    assert "Extra inputs are not permitted" in str(err.value)
    _older_manifest().model_validate({k: v for k, v in doc.items() if k != "shared_blocks"})  # the rest is old


def test_old_artifacts_load_as_no_trunk(tmp_path):
    from tests.fixtures.tiny_artifact import make_tiny_artifact

    root = make_tiny_artifact(tmp_path / "a", family="vit")
    m = load_manifest(root)
    assert m.shared_blocks is None and "shared_blocks" not in m.model.config
    assert load_model(root / m.model.weights, m.model.config).encoder.shared_blocks == 0
    doc = json.loads((root / "manifest.json").read_text())
    doc["model"]["config"]["shared_blocks"] = 1  # a trunk in the config the top level does not declare
    with pytest.raises(ValidationError, match="shared_blocks None differs from model.config.shared_blocks 1"):
        Manifest.model_validate(doc)
