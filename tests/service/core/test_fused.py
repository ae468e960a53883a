"""The fused runtime (service/core/fused.py) against a naive per-member reference written from the same weights.

The reference runs each member alone with explicit softmax attention, its own
LayerNorm affine and its own (or the shared) MLP, so it checks the fast paths of
the fused layout: per-member GEMMs, the shared-LayerNorm shortcut, residuals
accumulated by the GEMMs, in-place activations, per-member attention masks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from service.core.fused import GroupedLinear, MemberLayerNorm, tiny_config
from service.core.registry import build_model

ACTS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


def _randomize(model: torch.nn.Module, shared_norms: bool, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere; LayerNorm affines equal across members or not."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() >= 2 else 0.1))
        for mod in model.modules():
            if isinstance(mod, MemberLayerNorm):
                mod.weight.add_(1.0)
                if shared_norms:
                    mod.weight.copy_(mod.weight[:1].expand_as(mod.weight))
                    mod.bias.copy_(mod.bias[:1].expand_as(mod.bias))
    return model.eval()


def _ln(norm: MemberLayerNorm, m: int, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (norm.dim,), norm.weight[m, 0], norm.bias[m, 0], norm.eps)


def _ref_block(blk, m: int, h: torch.Tensor, mask: torch.Tensor | None, act: str) -> torch.Tensor:
    """One member's layer, naive: h (B, T, d) -> (B, T, d); mask (B, T) bool, True = attend."""
    attn = blk.attn

    def attention(y: torch.Tensor) -> torch.Tensor:
        if attn.qkv is None:
            return torch.zeros_like(y) + attn.proj_bias[m, 0]
        B, T, _ = y.shape
        H, hd = attn.num_heads, attn.head_dim
        qkv = y @ attn.qkv.weight[m] + attn.qkv.bias[m, 0]  # (B, T, 3*H*hd)
        q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # (B, H, T, hd) each
        s = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, H, T, T)
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        z = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd)
        return z @ attn.proj.weight[m] + attn.proj.bias[m, 0]

    def mlp(y: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = blk.mlp.fc1, blk.mlp.fc2
        if blk.mlp.shared:
            return F.linear(ACTS[act](F.linear(y, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)
        return ACTS[act](y @ fc1.weight[m] + fc1.bias[m, 0]) @ fc2.weight[m] + fc2.bias[m, 0]

    if not blk.norm_first:  # post-norm (BERT)
        h = _ln(blk.norm1, m, h + attention(h))
        return _ln(blk.norm2, m, h + mlp(h))
    ls1 = 1.0 if blk.ls1 is None else blk.ls1[m, 0]
    ls2 = 1.0 if blk.ls2 is None else blk.ls2[m, 0]
    h = h + attention(_ln(blk.norm1, m, h)) * ls1
    return h + mlp(_ln(blk.norm2, m, h)) * ls2


def reference_vit(model, pixel_values: torch.Tensor, pooled: list | None = None) -> torch.Tensor:
    """(B, C, H, W) -> (B, M, C), each member run alone; ``pooled`` gets each member's token means of every block
    but the last, ``[[(B, d)] * (L-1)] * M``."""
    B = pixel_values.shape[0]
    x = model.patch_embed(pixel_values).flatten(2).transpose(1, 2)
    if model.cls_token is not None:
        x = torch.cat([model.cls_token.expand(B, -1, -1), x], dim=1)
    x = x + model.pos_embed
    outs = []
    for m in range(model.members):
        h = x
        if model.norm_pre is not None:
            h = _ln(model.norm_pre, m, h)
        layers = []
        for blk in model.encoder.blocks:
            h = _ref_block(blk, m, h, None, model.cfg.get("act", "gelu"))
            layers.append(h.mean(1))
        if pooled is not None:
            pooled.append(layers[:-1])
        if model.norm is not None:
            h = _ln(model.norm, m, h)
        h = h[:, model.num_prefix :].mean(1) if model.global_pool == "avg" else h[:, 0]
        if model.fc_norm is not None:
            h = _ln(model.fc_norm, m, h)
        outs.append(h @ model.head.weight[m] + model.head.bias[m, 0])
    return torch.stack(outs, 1)


def reference_bert(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooled: list | None = None
) -> torch.Tensor:
    """(B, T) -> (B, M, C), each member run alone; ``pooled``: the means over each text's real tokens, as in
    :func:`reference_vit`."""
    T = input_ids.shape[1]
    x = model.word_embeddings(input_ids) + model.position_embeddings.weight[:T] + model.token_type_embeddings.weight[0]
    mask = attention_mask.bool()
    outs = []
    for m in range(model.members):
        h = _ln(model.emb_norm, m, x)
        layers = []
        for blk in model.encoder.blocks:
            h = _ref_block(blk, m, h, mask, model.cfg.get("act", "gelu"))
            w = mask.float().unsqueeze(-1)  # (B, T, 1)
            layers.append((h * w).sum(1) / w.sum(1))
        if pooled is not None:
            pooled.append(layers[:-1])
        h = h[:, 0]
        if model.pooler is not None:
            h = torch.tanh(h @ model.pooler.weight[m] + model.pooler.bias[m, 0])
        outs.append(h @ model.classifier.weight[m] + model.classifier.bias[m, 0])
    return torch.stack(outs, 1)


def _vit_input(n: int = 3, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))}


def _bert_input(n: int = 3, seq: int = 7, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[0, seq - 3 :] = 0  # padded sequences
    mask[-1, 2:] = 0
    return {"input_ids": torch.randint(0, 100, (n, seq), generator=g), "attention_mask": mask}


def _model(family: str, shared_norms: bool = True, **overrides) -> torch.nn.Module:
    cfg = {**tiny_config(family), "num_heads": [3, 0, 2], **overrides}  # a layer with every head pruned
    return _randomize(build_model(cfg), shared_norms)


def _reference(model, batch: dict[str, torch.Tensor], pooled: list | None = None) -> torch.Tensor:
    ref = reference_vit if model.cfg["arch"] == "vit" else reference_bert
    return ref(model, **batch, pooled=pooled)


def _batch(family: str, **kw) -> dict[str, torch.Tensor]:
    return _vit_input(**kw) if family == "vit" else _bert_input(**kw)


@pytest.mark.parametrize("family", ["vit", "bert"])
@pytest.mark.parametrize("mlp", ["shared", "per_member"])
@pytest.mark.parametrize("shared_norms", [True, False])
@pytest.mark.parametrize("first_token_readout", [True, False])
def test_fused_matches_naive_members(family, mlp, shared_norms, first_token_readout):
    model = _model(family, shared_norms, mlp=mlp)
    model.first_token_readout = first_token_readout  # last layer: first token only, or every token
    norms = [mod for mod in model.modules() if isinstance(mod, MemberLayerNorm)]
    assert all(n.shared() == shared_norms for n in norms)
    batch = _batch(family)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch), _reference(model, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["vit", "bert"])
@pytest.mark.parametrize("first_token_readout", [True, False])
def test_layer_features_match_naive_members(family, first_token_readout):
    """The third output: each member's pooled outputs of every block but the last (token means; text: over the
    real tokens only), the same as each member run alone; logits and features unchanged by asking for them."""
    model = _model(family, shared_norms=False, mlp="per_member")
    model.first_token_readout = first_token_readout
    batch = _batch(family)
    pooled: list = []
    with torch.no_grad():
        ref_logits = _reference(model, batch, pooled)
        model.with_features = True
        assert len(model(**batch)) == 2  # features only until layer features are asked for
        model.with_layer_features = True
        logits, features, layers = model(**batch)
    B, M, L = batch[next(iter(batch))].shape[0], model.members, len(model.encoder.blocks)
    assert layers.shape == (B, M, L - 1, model.dim)
    expected = torch.stack([torch.stack(per_member, dim=1) for per_member in pooled], dim=1)  # (B, M, L-1, d)
    torch.testing.assert_close(layers, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    if family == "bert":  # padding tokens change nothing: the same text padded further gives the same features
        padded = {k: F.pad(v, (0, 4)) for k, v in batch.items()}
        with torch.no_grad():
            torch.testing.assert_close(model(**padded)[2], layers, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "act, pool", [("gelu_tanh", "avg"), ("quick_gelu", "token"), ("relu", "avg"), ("gelu", "token")]
)
def test_vit_variants_match_naive_members(act, pool):
    """Layer scale, average or first-token pooling, fc_norm, norm_pre, other activations."""
    model = _model(
        "vit",
        False,
        act=act,
        layer_scale=True,
        global_pool=pool,
        fc_norm=True,
        final_norm=pool == "token",
        norm_pre=True,
    )
    assert model.first_token_readout == (pool == "token")
    batch = _vit_input()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch), reference_vit(model, **batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_cpu_sub_batches_equal_one_pass(family, monkeypatch):
    """A batch over ``cpu_max_rows`` member rows runs as sub-batches (CPU eager): same logits as one pass."""
    model = _model(family, False)
    batch = _batch(family, n=5)
    tokens = model.num_tokens if family == "vit" else batch["input_ids"].shape[1]
    passes: list[int] = []
    inner = model._forward
    monkeypatch.setattr(model, "_forward", lambda *a: passes.append(len(a[0])) or inner(*a))
    with torch.no_grad():
        model.cpu_max_rows = 0  # one pass
        whole = model(**batch)
        assert passes == [5]
        passes.clear()
        model.cpu_max_rows = 2 * model.members * tokens  # two sequences per pass
        split = model(**batch)
        assert passes == [2, 2, 1]
        passes.clear()
        torch.jit.trace(model, tuple(batch.values()), check_trace=False)  # a traced graph is one pass
        assert passes == [5]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, _reference(model, batch), atol=1e-5, rtol=1e-5)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        build_model({**tiny_config("vit"), "act": "swish"})


def test_member_norm_notices_parameter_changes():
    norm = MemberLayerNorm(3, 8)
    x = torch.randn(3, 5, 8)
    assert norm.shared()
    torch.testing.assert_close(norm(x), F.layer_norm(x, (8,), eps=norm.eps))
    with torch.no_grad():
        norm.weight[1].mul_(2.0)
        norm.bias[2].add_(0.5)
    assert not norm.shared()
    expected = torch.stack([_ln(norm, m, x[m]) for m in range(3)])
    torch.testing.assert_close(norm(x), expected)
    with torch.no_grad():  # equal again: the single-affine path, still right
        norm.weight.fill_(1.5)
        norm.bias.fill_(-0.25)
    assert norm.shared()
    torch.testing.assert_close(norm(x), F.layer_norm(x, (8,), eps=norm.eps) * 1.5 - 0.25)


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear(bias):
    lin = GroupedLinear(3, 6, 4, bias=bias)
    x, r = torch.randn(3, 5, 6), torch.randn(3, 5, 4)
    expected = torch.einsum("mni,mio->mno", x, lin.weight) + (lin.bias if bias else 0)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), expected)
        torch.testing.assert_close(lin(x, residual=r), expected + r)
        # a broadcast residual (the members' shared embedding) is not written to
        shared = torch.randn(1, 5, 4).expand(3, 5, 4)
        before = shared.clone()
        torch.testing.assert_close(lin(x, residual=shared), expected + shared)
        assert torch.equal(shared, before)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # no GEMM into the fp32 residual under autocast
            out = lin(x, residual=r)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected + r, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_gradients_match_naive_members(family):
    """In-place activations and GEMM-accumulated residuals keep autograd right (fine-tuning a fused model)."""
    model = _model(family, False).train()
    batch = _batch(family)
    torch.manual_seed(0)
    w = torch.randn(3, 3, model.cfg["num_classes"])
    grads = []
    for fn in (lambda: model(**batch), lambda: _reference(model, batch)):
        model.zero_grad()
        (fn() * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "encoder.blocks.0.mlp.fc1.weight" in grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-4, rtol=1e-4, msg=n)


def _fp32_reference(family: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """A random model of ``family`` (per-member LayerNorms), a batch and its fp32 logits on the CPU."""
    model = _model(family, False)
    batch = _batch(family)
    with torch.no_grad():
        return model, batch, model(**batch)


def _bf16_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str) -> torch.Tensor:
    """The model's logits under bf16 autocast on ``device`` (the batch moved there), as float32 on the CPU."""
    with torch.autocast(device, dtype=torch.bfloat16):
        return model(**{k: v.to(device) for k, v in batch.items()}).float().cpu()


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_bf16_autocast_close_to_fp32(family):
    model, batch, ref = _fp32_reference(family)
    with torch.inference_mode():
        out = _bf16_logits(model, batch, "cpu")
    assert out.shape == ref.shape and torch.isfinite(out).all()
    # bf16 keeps ~3 significant digits; the logits here are O(1-10)
    assert float((out.float() - ref).abs().max()) < 0.05 * float(ref.abs().max())


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_torchscript_and_onnx_exports_with_dynamic_axes(family, tmp_path):
    import warnings

    import onnxruntime as ort

    model = _model(family, False)
    example = _batch(family, n=2)
    other = _batch(family, n=4, seed=2) if family == "vit" else _bert_input(n=4, seq=5, seed=2)
    names = list(example)
    args = tuple(example[k] for k in names)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(*args)  # settle MemberLayerNorm.shared() outside the trace
        traced = torch.jit.trace(model, args)
        dyn = {k: ({0: "batch", 1: "seq"} if family == "bert" else {0: "batch"}) for k in names}
        torch.onnx.export(
            model,
            args,
            str(tmp_path / "m.onnx"),
            input_names=names,
            output_names=["logits"],
            dynamic_axes={**dyn, "logits": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
        ref = model(**other)
        got_ts = traced(*(other[k] for k in names))
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got_onnx = torch.from_numpy(sess.run(None, {k: other[k].numpy() for k in names})[0])
    torch.testing.assert_close(got_ts, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_onnx, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["vit", "bert"])
def test_cuda_matches_cpu(family):
    model, batch, ref = _fp32_reference(family)
    with torch.no_grad():
        model.cuda()
        out = model(**{k: v.cuda() for k, v in batch.items()}).cpu()
        out_bf16 = _bf16_logits(model, batch, "cuda")
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert float((out_bf16 - ref).abs().max()) < 0.05 * float(ref.abs().max())
