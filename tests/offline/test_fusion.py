"""The fused model equals its members run one by one; pruned members equal ablated base models."""

from __future__ import annotations

import pytest
import torch

from offline.families import get_adapter
from offline.method.fusion import fuse
from service.core.registry import load_model

from .conftest import bert_batch, tiny_bert, tiny_vit

# Unequal head counts per layer and per member, including a layer with no head left.
KEEPS = [
    [[0, 1, 2], [1, 3], [0, 1, 2, 3]],
    [[3], [0, 1, 2], []],
    [[0, 2], [2, 3], [1]],
]


def _dropped(keep, heads=4):
    return {layer: [h for h in range(heads) if h not in k] for layer, k in enumerate(keep)}


def _vit_batch(n=6):
    return {"pixel_values": torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(1))}


def _run(adapter, model, batch):
    return adapter.forward(model, batch)


@pytest.mark.parametrize("family", ["vit", "bert"])
@pytest.mark.parametrize("mlp", ["shared", "per_member"])
def test_fused_equals_members(family, mlp):
    base = tiny_vit() if family == "vit" else tiny_bert()
    batch = _vit_batch() if family == "vit" else bert_batch()
    adapter = get_adapter(family)
    members = [adapter.prune(base, k) for k in KEEPS]
    fused, cfg = fuse(adapter, members, mlp=mlp)
    assert cfg["num_heads"] == [3, 3, 4]  # padded to the largest member per layer
    with torch.no_grad():
        out = fused(**batch)
        assert out.shape == (next(iter(batch.values())).shape[0], 3, cfg["num_classes"])
        for m, member in enumerate(members):
            ref = _run(adapter, member, batch)
            torch.testing.assert_close(out[:, m], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_pruned_member_equals_ablated_base(family):
    base = tiny_vit() if family == "vit" else tiny_bert()
    batch = _vit_batch() if family == "vit" else bert_batch()
    adapter = get_adapter(family)
    for keep in KEEPS:
        member = adapter.prune(base, keep)
        assert adapter.kept_heads(member) == [sorted(k) for k in keep]
        with torch.no_grad(), adapter.ablate(base, _dropped(keep)):
            ablated = _run(adapter, base, batch)
        with torch.no_grad():
            torch.testing.assert_close(_run(adapter, member, batch), ablated, atol=1e-5, rtol=0)
    # ablation is temporary: weights restored exactly
    fresh = tiny_vit() if family == "vit" else tiny_bert()
    for a, b in zip(base.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_bert_padding_does_not_change_answers():
    base = tiny_bert()
    adapter = get_adapter("bert")
    fused, _ = fuse(adapter, [adapter.prune(base, k) for k in KEEPS])
    batch = bert_batch()
    with torch.no_grad():
        full = fused(**batch)
        # the sequence padded to length 5 gives the same logits when run alone, unpadded
        alone = fused(input_ids=batch["input_ids"][1:2, :5], attention_mask=batch["attention_mask"][1:2, :5])
    torch.testing.assert_close(full[1:2], alone, atol=1e-5, rtol=0)


def test_members_with_different_mlps_shared_mode_averages():
    base = tiny_vit()
    adapter = get_adapter("vit")
    members = [adapter.prune(base, k) for k in KEEPS[:2]]
    with torch.no_grad():
        members[1].blocks[0].mlp.fc1.weight.add_(1.0)
    fused, cfg = fuse(adapter, members, mlp="shared")
    expected = (members[0].blocks[0].mlp.fc1.weight + members[1].blocks[0].mlp.fc1.weight) / 2
    torch.testing.assert_close(fused.encoder.blocks[0].mlp.fc1.weight, expected)
    assert "encoder.blocks.0.mlp.fc1.weight" in cfg["averaged_shared_params"]


def test_fused_roundtrip_through_safetensors(tmp_path):
    from safetensors.torch import save_file

    base = tiny_bert()
    adapter = get_adapter("bert")
    fused, cfg = fuse(adapter, [adapter.prune(base, k) for k in KEEPS])
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path / "model.safetensors", cfg)
    batch = bert_batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch), fused(**batch), atol=0, rtol=0)


def test_vit_b16_layout_fused_equals_members():
    """The production layout (vit_base_patch16_224, random weights), 8 of 12 heads kept per member."""
    import timm

    torch.manual_seed(0)
    base = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=10).eval()
    adapter = get_adapter("vit")
    g = torch.Generator().manual_seed(0)
    keeps = [[sorted(torch.randperm(12, generator=g)[:8].tolist()) for _ in range(12)] for _ in range(3)]
    keeps[2][5] = keeps[2][5][:6]  # a member with fewer heads in one layer
    members = [adapter.prune(base, k) for k in keeps]
    fused, _ = fuse(adapter, members)
    x = torch.randn(2, 3, 224, 224, generator=g)
    with torch.no_grad():
        out = fused(x)
        for m, member in enumerate(members):
            torch.testing.assert_close(out[:, m], member(x), atol=1e-5, rtol=0)
