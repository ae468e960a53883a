"""OpenCLIP zero-shot family: fused dual encoder == members one by one, pruned == ablated, joint heads, exports.

Tiny random-init OpenCLIP models of the real architectures: ``CLIP`` (both towers open_clip
transformers with ``nn.MultiheadAttention``, causal text mask, EOT pooling) and ``CustomTextCLIP``
with a Hugging Face BERT text tower (built from a saved ``BertConfig``, no download).
"""

from __future__ import annotations

import pytest
import torch

from offline.families import get_adapter
from offline.families.attention import SlicedMultiheadAttention
from offline.families.clip import split_heads
from offline.method.fusion import fuse
from offline.method.head_scores import HiddenStateCache
from service.core.registry import load_model
from tests.fixtures.tiny_bert import tiny_bert_config

EOT = 99  # the largest id of the tiny vocabulary, as <end_of_text> is in open_clip's
# joint layers: 2 vision layers (4 heads), then 2 text layers (3 heads in CLIP, 4 in the HF tower);
# unequal head counts per member and per layer, a vision and a text layer with no head left
KEEPS_CLIP = [
    [[0, 1, 2], [1, 3], [0, 2], [1]],
    [[3], [0, 1, 2, 3], [], [0, 1, 2]],
    [[0, 2], [2, 3], [1, 2], [0]],
]
KEEPS_HF = [
    [[0, 1, 2], [1, 3], [0, 2], [1, 3]],
    [[3], [0, 1, 2, 3], [], [0, 1, 2, 3]],
    [[0, 2], [], [1, 2, 3], [0]],
]
VISION = {"image_size": 16, "patch_size": 4, "width": 32, "layers": 2, "head_width": 8, "mlp_ratio": 2.0}
HF_VARIANTS = [("mean_pooler", "mlp"), ("cls_pooler", "linear"), ("cls_last_hidden_state_pooler", None)]


def _widen(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights wide enough that every head changes the answers (open_clip's init is too small)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model.eval()


def tiny_clip(quick_gelu: bool = True, vision: dict | None = None, **text) -> torch.nn.Module:
    from open_clip.model import CLIP

    torch.manual_seed(0)
    text_cfg = {"context_length": 12, "vocab_size": 100, "width": 24, "heads": 3, "layers": 2, **text}
    return _widen(CLIP(16, {**VISION, **(vision or {})}, text_cfg, quick_gelu=quick_gelu))


def tiny_hf_clip(folder, pooler: str = "mean_pooler", proj: str | None = "mlp") -> torch.nn.Module:
    from open_clip.model import CustomTextCLIP

    tiny_bert_config(vocab_size=100, num_hidden_layers=2).save_pretrained(folder)
    torch.manual_seed(0)
    text_cfg = {
        "hf_model_name": str(folder),
        "hf_model_pretrained": False,
        "hf_proj_type": proj,
        "hf_pooler_type": pooler,
    }
    return _widen(CustomTextCLIP(16 if proj else 32, VISION, text_cfg))


def clip_batch(eot: int | None = EOT, seq: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """5 images and 4 prompts; prompt i ends (EOT, then padding 0) at a different position."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 98, (4, seq), generator=g)
    for i, end in enumerate(min(e, seq - 1) for e in (5, seq - 1, 2, 8)):
        if eot is not None:
            ids[i, end] = eot
        ids[i, end + 1 :] = 0
    return {
        "pixel_values": torch.randn(5, 3, 16, 16, generator=g),
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
    }


def tiny_custom_text_clip() -> torch.nn.Module:
    """CustomTextCLIP with an open_clip TextTransformer tower (``model.text``), GELU, layer scale, Linear projection."""
    from open_clip.model import CustomTextCLIP

    torch.manual_seed(0)
    text_cfg = {
        "context_length": 12,
        "vocab_size": 100,
        "width": 24,
        "heads": 3,
        "layers": 2,
        "proj_bias": True,
        "ls_init_value": 0.5,
    }
    return _widen(CustomTextCLIP(16, {**VISION, "ls_init_value": 0.5, "final_ln_after_pool": True}, text_cfg))


def _model(kind: str, tmp_path) -> tuple[torch.nn.Module, list, dict]:
    if kind == "clip":
        return tiny_clip(), KEEPS_CLIP, clip_batch()
    if kind == "custom":
        return tiny_custom_text_clip(), KEEPS_CLIP, clip_batch()
    pooler, proj = HF_VARIANTS[int(kind[-1])]
    return tiny_hf_clip(tmp_path, pooler, proj), KEEPS_HF, clip_batch(eot=None)


KINDS = ["clip", "custom", "hf0", "hf1", "hf2"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mlp", ["shared", "per_member"])
def test_fused_equals_members(kind, mlp, tmp_path):
    base, keeps, batch = _model(kind, tmp_path)
    adapter = get_adapter("clip")
    members = [adapter.prune_to(base, k) for k in keeps]
    fused, cfg = fuse(adapter, members, mlp=mlp)
    assert cfg["vision"]["num_heads"] == [3, 4]
    assert cfg["text"]["num_heads"] == ([3, 4] if kind.startswith("hf") else [2, 3])
    with torch.no_grad():
        img = fused.encode_image(batch["pixel_values"])  # (B, M, D)
        txt = fused.encode_text(batch["input_ids"], batch["attention_mask"])  # (L, M, D)
        logits = fused(**batch)  # (B, M, L)
        assert img.shape == (5, 3, cfg["embed_dim"]) and txt.shape == (4, 3, cfg["embed_dim"])
        assert logits.shape == (5, 3, 4)
        for m, member in enumerate(members):
            torch.testing.assert_close(
                img[:, m], member.encode_image(batch["pixel_values"], normalize=True), atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                txt[:, m], member.encode_text(batch["input_ids"], normalize=True), atol=1e-5, rtol=0
            )
            torch.testing.assert_close(logits[:, m], adapter.forward(member, batch), atol=1e-5, rtol=0)
        # members really differ: the ensemble is not three copies of one model
        assert (logits[:, 0] - logits[:, 1]).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["clip", "hf0", "hf1"])
def test_pruned_member_equals_ablated_base(kind, tmp_path):
    base, keeps, batch = _model(kind, tmp_path)
    adapter = get_adapter("clip")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    heads = adapter.heads(base)
    for keep in keeps:
        member = adapter.prune_to(base, keep)
        assert adapter.kept_heads(member) == [sorted(k) for k in keep]
        dropped = {layer: [h for h in range(heads[layer]) if h not in k] for layer, k in enumerate(keep)}
        with torch.no_grad(), adapter.ablate(base, dropped):
            ablated = adapter.forward(base, batch)
        with torch.no_grad():
            torch.testing.assert_close(adapter.forward(member, batch), ablated, atol=1e-5, rtol=0)
    for k, v in base.state_dict().items():  # ablation is temporary
        assert torch.equal(v, before[k]), k


def test_sliced_attention_is_a_dropin_for_multihead_attention():
    """Keeping every head gives nn.MultiheadAttention's output, with and without the causal mask."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(24, 3, batch_first=True).eval()
    sliced = SlicedMultiheadAttention.from_attention(mha, [0, 1, 2])
    x = torch.randn(2, 7, 24)
    causal = torch.full((7, 7), float("-inf")).triu(1)
    with torch.no_grad():
        for mask in (None, causal, causal.isinf()):
            torch.testing.assert_close(
                sliced(x, x, x, need_weights=False, attn_mask=mask)[0],
                mha(x, x, x, need_weights=False, attn_mask=mask)[0],
                atol=1e-6,
                rtol=0,
            )
        empty = SlicedMultiheadAttention.from_attention(mha, [])
        torch.testing.assert_close(empty(x, x, x)[0], mha.out_proj.bias.expand(2, 7, 24))


@pytest.mark.parametrize("kind", ["clip", "hf0"])
def test_cached_layer_path_equals_forward(kind, tmp_path):
    """stem -> blocks -> readout (what circuit scoring caches) gives the model's own zero-shot logits."""
    base, _, batch = _model(kind, tmp_path)
    adapter = get_adapter("clip")
    with torch.no_grad():
        h, ctx = adapter.stem(base, batch)
        for layer in range(adapter.num_layers(base)):
            h = adapter.block(base, layer, h, ctx)
        torch.testing.assert_close(adapter.readout(base, h, ctx), adapter.forward(base, batch), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["clip", "hf0"])
def test_cached_reruns_after_ablations_equal_fresh_forwards(kind, tmp_path):
    """Circuit scoring's cache (re-run from the ablated layer on, image / prompt states reused) is never stale."""
    base, _, batch = _model(kind, tmp_path)
    adapter = get_adapter("clip")
    with torch.no_grad():
        cache = HiddenStateCache(adapter, base, [batch])
        clean = adapter.forward(base, batch)
        for layer in [0, 2, 1, 3, 2, 0]:  # vision and text layers, interleaved
            with adapter.ablate(base, {layer: [0]}):
                torch.testing.assert_close(cache.logits_from(layer), adapter.forward(base, batch), atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.logits_from(layer), clean, atol=1e-5, rtol=0)
            assert (cache.logits_from(4) - clean).abs().max() < 1e-5


def test_joint_head_index():
    base = tiny_clip()
    adapter = get_adapter("clip")
    assert adapter.heads(base) == [4, 4, 3, 3]  # vision layers first, then text layers
    assert adapter.num_vision_layers(base) == 2 and adapter.head_dim(base) == 8
    assert split_heads(base, adapter.kept_heads(adapter.prune_to(base, KEEPS_CLIP[1]))) == {
        "vision": [[3], [0, 1, 2, 3]],
        "text": [[], [0, 1, 2]],
    }
    # the out-projection ablated for joint layer 3 is the second text block's
    assert adapter.out_proj(base, 3) is base.transformer.resblocks[1].attn.out_proj
    unequal = tiny_clip(vision={"head_width": 16})
    with pytest.raises(ValueError, match="one head width"):
        adapter.head_dim(unequal)
    members = [adapter.prune_to(unequal, [[0], [1], [0, 2], [1]]), adapter.prune_to(unequal, [[1], [0], [2], [0, 2]])]
    fused, _ = fuse(adapter, members)  # fusion itself does not need one head width
    batch = clip_batch()
    with torch.no_grad():
        for m, member in enumerate(members):
            torch.testing.assert_close(fused(**batch)[:, m], adapter.forward(member, batch), atol=1e-5, rtol=0)


def test_causal_text_tower():
    """Tokens after the EOT never reach it (causal mask): padding and shorter sequences give the same embedding."""
    base = tiny_clip()
    adapter = get_adapter("clip")
    members = [adapter.prune_to(base, k) for k in KEEPS_CLIP]
    fused, _ = fuse(adapter, members)
    batch = clip_batch()
    ids, am = batch["input_ids"], batch["attention_mask"]
    after = ids.clone()
    after[0, 6:] = 7  # prompt 0 ends at 5: change what follows its EOT
    before = ids.clone()
    before[0, 1] = 3 if ids[0, 1] != 3 else 4  # ... and, separately, a token before it
    with torch.no_grad():
        ref = fused.encode_text(ids, am)
        torch.testing.assert_close(fused.encode_text(after, am), ref, atol=0, rtol=0)
        assert (fused.encode_text(before, am)[0] - ref[0]).abs().max() > 1e-3
        # open_clip agrees: the member run one by one ignores the tokens after the EOT too
        torch.testing.assert_close(members[0].encode_text(after, normalize=True), ref[:, 0], atol=1e-5, rtol=0)
        # the fused tower takes sequences shorter than the context length (position embeddings sliced)
        torch.testing.assert_close(fused.encode_text(ids[2:3, :3], am[2:3, :3]), ref[2:3], atol=1e-6, rtol=0)


def test_circuit_ranking_over_both_towers_matches_brute_force():
    """The first two greedy steps of circuit extraction pick the best joint (layer, head) by direct evaluation."""
    from offline.method.head_scores import circuit_objective, circuit_ranking

    base = tiny_clip()
    adapter = get_adapter("clip")
    id_batch, ood_batch = clip_batch(seed=1), clip_batch(seed=2)
    ood_batch["pixel_values"] = ood_batch["pixel_values"] * 3 + 1
    labels = torch.tensor([0, 1, 2, 3, 1])
    res = circuit_ranking(adapter, base, [id_batch], labels, [ood_batch], score="ood", budget=2, progress=False)
    objective = circuit_objective("ood")
    removed: dict[int, list[int]] = {}
    for step in range(2):
        best, best_s = None, -float("inf")
        for layer, n in enumerate(adapter.heads(base)):
            for h in range(n):
                if h in removed.get(layer, []):
                    continue
                trial = {k: list(v) for k, v in removed.items()}
                trial.setdefault(layer, []).append(h)
                with torch.no_grad(), adapter.ablate(base, trial):
                    s = objective(adapter.forward(base, id_batch), labels, adapter.forward(base, ood_batch))
                if s > best_s:
                    best, best_s = (layer, h), s
        assert res.ranking[step] == best, f"step {step}"
        assert res.scores[step] == pytest.approx(best_s, abs=1e-6)
        removed.setdefault(best[0], []).append(best[1])


def test_taylor_scores_read_the_fused_in_proj_gradients():
    """Taylor on the vision tower: per-head scores from in_proj_weight's [Wq; Wk; Wv] rows and gradients."""
    from offline.method.head_scores import accumulate_grads, taylor_layer_scores, taylor_prune

    base = tiny_clip()
    adapter = get_adapter("clip")
    batch = clip_batch()
    labels = torch.tensor([0, 1, 2, 3, 1])
    accumulate_grads(adapter, base, [(batch, labels)])
    attn = base.visual.transformer.resblocks[1].attn
    w, g = attn.in_proj_weight.detach(), attn.in_proj_weight.grad
    prod = (w * g).abs().view(3, 4, 8, 32)  # (q/k/v, head, head_dim, d)
    expected = prod.sum(dim=(2, 3)).mean(0) / (8 * 32)
    torch.testing.assert_close(taylor_layer_scores(adapter, base, 1), expected)
    res = taylor_prune(adapter, base, [(batch, labels)], [1, 2, 0, 0])
    assert adapter.heads(res.model) == [3, 2, 3, 3]  # text tower untouched
    base.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["clip", "hf0"])
def test_roundtrip_through_safetensors_and_build_model(kind, tmp_path):
    from safetensors.torch import save_file

    base, keeps, batch = _model(kind, tmp_path / "bert")
    adapter = get_adapter("clip")
    fused, cfg = fuse(adapter, [adapter.prune_to(base, k) for k in keeps])
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path / "model.safetensors", cfg)  # service.core.registry.build_model -> FusedCLIP
    assert type(loaded).__name__ == "FusedCLIP"
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch), fused(**batch), atol=0, rtol=0)
    assert cfg["logit_scale"] == pytest.approx(float(base.logit_scale.detach().exp()))


@pytest.mark.parametrize("kind", ["clip", "hf0"])
def test_encoders_export_with_dynamic_batch_labels_and_length(kind, tmp_path):
    from offline.models.export import check_parity, export_onnx, export_torchscript

    base, keeps, batch = _model(kind, tmp_path / "bert")
    adapter = get_adapter("clip")
    fused, _ = fuse(adapter, [adapter.prune_to(base, k) for k in keeps])
    other = clip_batch(eot=EOT if kind == "clip" else None, seq=7, seed=3)
    image_batches = [{"pixel_values": batch["pixel_values"][:2]}, {"pixel_values": other["pixel_values"]}]
    text_batches = [
        {k: batch[k] for k in ("input_ids", "attention_mask")},
        {k: other[k][:3] for k in ("input_ids", "attention_mask")},
    ]  # 3 labels, 7 tokens
    for side, mod, batches in (
        ("image", fused.image_encoder, image_batches),
        ("text", fused.text_encoder, text_batches),
    ):
        export_torchscript(mod, batches[0], tmp_path / f"{side}.ts")
        assert check_parity(mod, tmp_path / f"{side}.ts", "torchscript", batches, 1e-5) <= 1e-5
        export_onnx(mod, batches[0], tmp_path / f"{side}.onnx", output_names=[f"{side}_embeds"])
        assert check_parity(mod, tmp_path / f"{side}.onnx", "onnx", batches, 1e-4) <= 1e-4


def test_hydra_members_of_openclip_checkpoint_on_disk(tmp_path):
    """A tiny OpenCLIP checkpoint file loads through open_clip's own loader; its fused Hydra == its members."""
    import json

    import open_clip

    from offline.models.loaders import load_openclip

    cfg_path = tmp_path / "tiny-clip-hydra-test.json"
    cfg_path.write_text(
        json.dumps(
            {
                "embed_dim": 16,
                "quick_gelu": True,
                "vision_cfg": VISION,
                "text_cfg": {"context_length": 12, "vocab_size": 100, "width": 24, "heads": 3, "layers": 2},
            }
        )
    )
    open_clip.add_model_config(cfg_path)
    ref = _widen(open_clip.create_model("tiny-clip-hydra-test"))
    torch.save(ref.state_dict(), tmp_path / "open_clip_pytorch_model.bin")
    base = load_openclip(str(cfg_path), str(tmp_path / "open_clip_pytorch_model.bin"))  # create_model(pretrained=)
    for k, v in ref.state_dict().items():
        assert torch.equal(base.state_dict()[k], v), k
    with pytest.raises(ValueError, match="not a known tag or valid file path"):
        load_openclip(str(cfg_path), str(tmp_path / "missing.bin"))
    adapter = get_adapter("clip")
    members = [adapter.prune_to(base, k) for k in KEEPS_CLIP]
    fused, _ = fuse(adapter, members)
    batch = clip_batch()
    with torch.no_grad():
        for m, member in enumerate(members):
            torch.testing.assert_close(fused(**batch)[:, m], adapter.forward(member, batch), atol=1e-5, rtol=0)


def test_openclip_tokenizer_matches_open_clip_ids(tmp_path):
    """The artifact's Hugging Face tokenizer for standard CLIP gives open_clip.tokenize's ids (padding 0)."""
    import open_clip
    from transformers import AutoTokenizer

    from offline.models.loaders import openclip_tokenizer

    texts = ["A photo of a T-shirt/top.", "a photo of a dog", "Ankle boot", "word " * 100]
    openclip_tokenizer(77).save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    enc = tok(texts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
    assert torch.equal(enc["input_ids"], open_clip.tokenize(texts))
