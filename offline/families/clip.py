"""Adapter for OpenCLIP dual encoders used zero-shot (``ViT-B-32`` in production).

Supported models:

* ``open_clip.CLIP``: vision ``VisionTransformer`` and text transformer, both made of
  ``ResidualAttentionBlock`` with ``nn.MultiheadAttention`` (fused ``in_proj_weight`` =
  ``[Wq; Wk; Wv]``); causal text mask, EOT (``argmax``) pooling, ``ln_final``, ``text_projection``.
* ``open_clip.CustomTextCLIP`` with the same vision tower and either an open_clip
  ``TextTransformer`` or a Hugging Face BERT text tower (``HFTextEncoder``: padding mask, mean /
  cls pooler, optional linear or MLP projection).

**Joint head index.** Both towers are one model to scoring and pruning: the flat layer index
runs over the vision tower's layers first (``0 .. Lv-1``) and then the text tower's
(``Lv .. Lv+Lt-1``). ``heads()``, ``kept_heads()``, rankings ``(layer, head)`` and budgets
(``prune_total`` over both towers, ``prune_per_layer`` in every layer of both) all use it;
:func:`split_heads` turns a flat per-layer list into ``{"vision": [...], "text": [...]}``.
Joint scoring (circuits) needs one head width for both towers (true of every OpenCLIP ViT
config: 64); fusion and pruning do not.

**Batches.** ``{"pixel_values": (B, 3, H, W), "input_ids": (L, T), "attention_mask": (L, T)}``:
images and the L class prompts. :meth:`CLIPAdapter.forward` gives zero-shot logits ``(B, L)`` =
``exp(logit_scale) · normalize(image) · normalize(text)ᵀ (+ logit_bias)`` computed with the
model's own ``encode_image`` / ``encode_text`` (standard CLIP text must be padded to the
model's ``context_length``, as open_clip's tokenizer does). ``stem/block/readout`` carry both
towers' hidden states ``(h_vision, h_text)`` so that circuit scoring re-runs only the layers
after an ablated head; vision first keeps that cheap (the L prompts are re-encoded, the images
are not).

Structural slicing replaces a pruned ``nn.MultiheadAttention`` (which cannot hold fewer heads
than ``embed_dim / head_dim``) by :class:`SlicedMultiheadAttention` (:mod:`.attention`), a drop-in with the
same call signature and parameter names; BERT text layers are sliced as in the ``bert`` family.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offline.families.attention import SlicedMultiheadAttention
from offline.families.base import FamilyAdapter, fuse_blocks, grouped_linear, layer_weights, member_norm, shared_or_mean
from offline.families.bert import BERT_ACTS, BertAdapter, fuse_bert_encoder
from service.core.families import CLIP

TEXT_POOLS = ("argmax", "eos", "first", "last")
HF_POOLERS = ("mean_pooler", "cls_pooler", "cls_last_hidden_state_pooler")


# ----------------------------------------------------------------------------- model anatomy
def _is_hf_text(model: nn.Module) -> bool:
    from open_clip.hf_model import HFTextEncoder

    return isinstance(getattr(model, "text", None), HFTextEncoder)


def _text(model: nn.Module) -> nn.Module:
    """The module holding the open_clip text transformer: the CLIP itself, or ``model.text`` (CustomTextCLIP)."""
    return model.text if hasattr(model, "text") else model


def _text_pool(model: nn.Module) -> tuple[str, int | None]:
    t = _text(model)
    if t is model:
        return model.text_pool_type, getattr(model, "text_eos_id", None)
    return t.pool_type, getattr(t, "eos_id", None)


def _bert_shim(model: nn.Module) -> SimpleNamespace:
    """What :class:`BertAdapter` reads (``.bert``, ``.config``), pointing at the HF text tower."""
    hf = model.text.transformer
    return SimpleNamespace(bert=hf, config=hf.config)


def _vision_blocks(model: nn.Module) -> nn.ModuleList:
    return model.visual.transformer.resblocks


def _text_blocks(model: nn.Module) -> nn.ModuleList:
    if _is_hf_text(model):
        return model.text.transformer.encoder.layer
    return _text(model).transformer.resblocks


def _act_name(act: nn.Module) -> str:
    from open_clip.transformer import QuickGELU as OCQuickGELU

    if isinstance(act, OCQuickGELU):
        return "quick_gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    raise ValueError(f"unsupported MLP activation {type(act).__name__}; expected QuickGELU or GELU")


def _check_blocks(blocks: nn.ModuleList, tower: str, problems: list[str]) -> None:
    from open_clip.transformer import ResidualAttentionBlock

    for i, blk in enumerate(blocks):
        if not isinstance(blk, ResidualAttentionBlock):
            problems.append(f"{tower} block {i} is a {type(blk).__name__} (qk-norm / scaled-cosine custom blocks)")
            return
        a = blk.attn
        if isinstance(a, nn.MultiheadAttention):
            if not a._qkv_same_embed_dim or a.bias_k is not None or a.add_zero_attn or not a.batch_first:
                problems.append(f"{tower} block {i}: MultiheadAttention with kdim/vdim, bias_kv, zero_attn, seq-first")
                return
        elif not isinstance(a, SlicedMultiheadAttention):
            problems.append(f"{tower} block {i}: attention {type(a).__name__}")
            return
        if hasattr(blk, "ln_1_kv"):
            problems.append(f"{tower} block {i}: cross-attention")
            return


def check_supported(model: nn.Module) -> None:
    """Raise TypeError / ValueError naming every OpenCLIP feature the fused dual encoder does not implement."""
    from open_clip.model import CLIP, CustomTextCLIP
    from open_clip.transformer import TextTransformer, VisionTransformer

    if not isinstance(model, CLIP | CustomTextCLIP):
        raise TypeError(f"the clip family expects an open_clip CLIP or CustomTextCLIP, got {type(model).__name__}")
    problems: list[str] = []
    v = model.visual
    if not isinstance(v, VisionTransformer):
        raise ValueError(f"the clip family needs a VisionTransformer image tower, got {type(v).__name__}")
    if v.attn_pool is not None:
        problems.append("vision attentional pooling")
    if v.pool_type not in ("tok", "avg"):
        problems.append(f"vision pool_type={v.pool_type!r}")
    if v.proj is None:
        problems.append("vision tower without projection")
    _check_blocks(_vision_blocks(model), "vision", problems)
    if _is_hf_text(model):
        hf = model.text
        cfg = hf.transformer.config
        if cfg.model_type != "bert":
            problems.append(f"HF text tower of type {cfg.model_type!r} (only bert is supported)")
        if cfg.hidden_act not in BERT_ACTS:
            problems.append(f"HF text hidden_act {cfg.hidden_act!r}")
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            problems.append("HF text relative position embeddings")
        pooler = type(hf.pooler).__name__
        if _hf_pooler_name(hf) not in HF_POOLERS:
            problems.append(f"HF text pooler {pooler}")
    else:
        t = _text(model)
        if isinstance(t, TextTransformer) and t.cls_emb is not None:
            problems.append("text cls embedding (CoCa)")
        if isinstance(t, TextTransformer) and t.use_pad_mask:
            problems.append("text padding mask")
        pool, _ = _text_pool(model)
        if pool not in TEXT_POOLS:
            problems.append(f"text pool_type={pool!r}")
        _check_blocks(_text_blocks(model), "text", problems)
    if problems:
        raise ValueError(f"unsupported OpenCLIP features for Hydra fusion: {', '.join(problems)}")


def _hf_pooler_name(hf: nn.Module) -> str:
    from open_clip.hf_model import ClsLastHiddenStatePooler, ClsPooler, MeanPooler

    if isinstance(hf.pooler, MeanPooler):
        return "mean_pooler"
    if isinstance(hf.pooler, ClsPooler):
        # uses the BERT pooler (dense + tanh) only when the HF model was built with it
        if hf.transformer.pooler is not None and hf.pooler.use_pooler_output:
            return "cls_pooler"
        return "cls_last_hidden_state_pooler"
    if isinstance(hf.pooler, ClsLastHiddenStatePooler):
        return "cls_last_hidden_state_pooler"
    return type(hf.pooler).__name__


def _hf_proj(hf: nn.Module) -> tuple[str, list[nn.Linear]]:
    """The HF tower's projection: ``none`` (Identity), ``linear`` or ``mlp`` (Linear, GELU, Linear), no biases."""
    p = hf.proj
    if isinstance(p, nn.Identity):
        return "none", []
    if isinstance(p, nn.Linear) and p.bias is None:
        return "linear", [p]
    if isinstance(p, nn.Sequential) and len(p) == 3 and isinstance(p[1], nn.GELU) and p[1].approximate == "none":
        if all(isinstance(p[i], nn.Linear) and p[i].bias is None for i in (0, 2)):
            return "mlp", [p[0], p[2]]
    raise ValueError(f"unsupported HF text projection {p}")


def text_attention_mask(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask the model's own text tower uses: ``ids != pad_token_id`` (HF) or all ones (causal)."""
    if _is_hf_text(model):
        return (input_ids != model.text.config.pad_token_id).long()
    return torch.ones_like(input_ids)


def split_heads(model_or_layers: nn.Module | int, per_layer: Sequence[Any]) -> dict[str, list[Any]]:
    """A flat per-layer list (vision layers, then text layers) as ``{"vision": [...], "text": [...]}``."""
    lv = model_or_layers if isinstance(model_or_layers, int) else len(_vision_blocks(model_or_layers))
    return {"vision": list(per_layer[:lv]), "text": list(per_layer[lv:])}


def _memo(ctx: dict, key: str, deps: tuple[torch.Tensor, ...], compute: Any) -> torch.Tensor:
    """``compute()``, reused while its inputs are the very same tensors, unmodified (no-grad only).

    Circuit scoring re-runs the layers after an ablated head from cached states: an ablated text
    head leaves the images' features unchanged, an ablated vision head the prompts' states. The
    cache key is the identity and in-place version counter of every dependency (the input state
    and the layer's parameters, which an ablation writes to), so a changed weight or input misses.
    """
    if torch.is_grad_enabled():
        return compute()
    stamp = tuple((id(t), t._version) for t in deps)
    hit = ctx.setdefault("_memo", {}).get(key)
    if hit is not None and hit[0] == stamp:
        return hit[2]
    out = compute()
    ctx["_memo"][key] = (stamp, deps, out)  # holding deps keeps their ids from being reused
    return out


# ----------------------------------------------------------------------------- the adapter
class CLIPAdapter(FamilyAdapter):
    """Joint vision + text head access for OpenCLIP models; see the module docstring for the layer index."""

    row = CLIP
    base_loader = "openclip"
    check = staticmethod(check_supported)

    def num_vision_layers(self, model: nn.Module) -> int:
        return len(_vision_blocks(model))

    def num_layers(self, model: nn.Module) -> int:
        return len(_vision_blocks(model)) + len(_text_blocks(model))

    def _locate(self, model: nn.Module, layer: int) -> tuple[str, int]:
        lv = self.num_vision_layers(model)
        if not 0 <= layer < self.num_layers(model):
            raise IndexError(f"layer {layer} out of range for {self.num_layers(model)} joint layers")
        return ("vision", layer) if layer < lv else ("text", layer - lv)

    def _attn(self, model: nn.Module, layer: int) -> nn.Module:
        tower, i = self._locate(model, layer)
        return (_vision_blocks(model) if tower == "vision" else _text_blocks(model))[i].attn

    # -- structure -------------------------------------------------------------------
    def layer_head_dim(self, model: nn.Module, layer: int) -> int:
        tower, i = self._locate(model, layer)
        if tower == "text" and _is_hf_text(model):
            return BertAdapter().head_dim(_bert_shim(model))
        return self._attn(model, layer).head_dim

    def tower_head_dims(self, model: nn.Module) -> tuple[int, int]:
        return self.layer_head_dim(model, 0), self.layer_head_dim(model, self.num_vision_layers(model))

    def head_dim(self, model: nn.Module) -> int:
        hv, ht = self.tower_head_dims(model)
        if hv != ht:
            raise ValueError(
                f"vision heads are {hv} wide and text heads {ht}: joint head scoring needs one head width "
                "(prune with explicit kept heads instead)"
            )
        return hv

    def heads(self, model: nn.Module) -> list[int]:
        vision = [blk.attn.num_heads for blk in _vision_blocks(model)]
        if _is_hf_text(model):
            return vision + BertAdapter().heads(_bert_shim(model))
        return vision + [blk.attn.num_heads for blk in _text_blocks(model)]

    def out_proj(self, model: nn.Module, layer: int) -> nn.Linear:
        tower, i = self._locate(model, layer)
        if tower == "text" and _is_hf_text(model):
            return BertAdapter().out_proj(_bert_shim(model), i)
        return self._attn(model, layer).out_proj

    def qkv_weights(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tower, i = self._locate(model, layer)
        if tower == "text" and _is_hf_text(model):
            return BertAdapter().qkv_weights(_bert_shim(model), i)
        return tuple(self._attn(model, layer).in_proj_weight.chunk(3, dim=0))  # rows [Wq; Wk; Wv]

    def qkv_grads(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tower, i = self._locate(model, layer)
        if tower == "text" and _is_hf_text(model):
            return BertAdapter().qkv_grads(_bert_shim(model), i)
        g = self._attn(model, layer).in_proj_weight.grad
        if g is None:
            raise RuntimeError(f"no gradient on {tower} layer {i} in_proj_weight: run a backward pass first")
        return tuple(g.chunk(3, dim=0))

    def _slice_layer(self, model: nn.Module, layer: int, keep: Sequence[int]) -> None:
        tower, i = self._locate(model, layer)
        if tower == "text" and _is_hf_text(model):
            BertAdapter()._slice_layer(_bert_shim(model), i, keep)
            return
        blk = (_vision_blocks(model) if tower == "vision" else _text_blocks(model))[i]
        blk.attn = SlicedMultiheadAttention.from_attention(blk.attn, keep)

    # -- running -----------------------------------------------------------------------
    def logits(self, model: nn.Module, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """Zero-shot logits ``(B, L)`` of normalised image ``(B, D)`` and text ``(L, D)`` features."""
        out = model.logit_scale.exp() * image_features @ text_features.T
        if model.logit_bias is not None:
            out = out + model.logit_bias
        return out

    def encode_text(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Normalised text features ``(L, D)`` of the prompts, through the model's own ``encode_text``."""
        return model.encode_text(batch["input_ids"], normalize=True)

    def encode_image(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Normalised image features ``(B, D)`` through the model's own ``encode_image``."""
        return model.encode_image(batch["pixel_values"], normalize=True)

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Zero-shot logits ``(B, L)`` of the batch's images against its L prompts (open_clip's own code path)."""
        return self.logits(model, self.encode_image(model, batch), self.encode_text(model, batch))

    def stem(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor], Any]:
        """((vision tokens (B, Tv, dv), text tokens (L, T, dt)), context with the text mask and ids)."""
        hv = model.visual._embeds(batch["pixel_values"])  # (B, Tv, dv)
        ids = batch["input_ids"]
        am = batch.get("attention_mask")
        if am is None:
            am = text_attention_mask(model, ids)
        if _is_hf_text(model):
            ht, mask = BertAdapter().stem(_bert_shim(model), {"input_ids": ids, "attention_mask": am})
        else:
            t = _text(model)
            T = ids.shape[1]
            ht = t.token_embedding(ids) + t.positional_embedding[:T]  # (L, T, dt)
            mask = t.attn_mask[:T, :T] if t.attn_mask is not None else None  # additive causal mask
        return (hv, ht), {"text_mask": mask, "input_ids": ids, "attention_mask": am}

    def block(self, model: nn.Module, layer: int, h: tuple[torch.Tensor, torch.Tensor], ctx: Any) -> tuple:
        hv, ht = h
        tower, i = self._locate(model, layer)
        if tower == "vision":
            return _vision_blocks(model)[i](hv), ht
        blk = _text_blocks(model)[i]
        return hv, _memo(ctx, f"text{i}", (ht, *blk.parameters()), lambda: self._text_block(model, i, ht, ctx))

    def _text_block(self, model: nn.Module, i: int, ht: torch.Tensor, ctx: Any) -> torch.Tensor:
        if _is_hf_text(model):
            return BertAdapter().block(_bert_shim(model), i, ht, ctx["text_mask"])
        return _text_blocks(model)[i](ht, attn_mask=ctx["text_mask"])

    def _image_features(self, model: nn.Module, hv: torch.Tensor) -> torch.Tensor:
        v = model.visual
        pooled, _ = v._pool(hv)
        return F.normalize(pooled @ v.proj, dim=-1)  # (B, D)

    def readout(self, model: nn.Module, h: tuple[torch.Tensor, torch.Tensor], ctx: Any) -> torch.Tensor:
        hv, ht = h
        v = model.visual
        img = _memo(ctx, "image", (hv, *v.ln_post.parameters(), v.proj), lambda: self._image_features(model, hv))
        ids, am = ctx["input_ids"], ctx["attention_mask"]
        if _is_hf_text(model):
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            hf = model.text
            bert = hf.transformer
            pooler_out = bert.pooler(ht) if bert.pooler is not None else None
            out = BaseModelOutputWithPooling(last_hidden_state=ht, pooler_output=pooler_out)
            txt = hf.proj(hf.pooler(out, am))
        else:
            from open_clip.transformer import text_global_pool

            t = _text(model)
            pool, eos = _text_pool(model)
            x = text_global_pool(t.ln_final(ht), ids, pool, eos_token_id=eos)
            proj = t.text_projection
            txt = x if proj is None else (proj(x) if isinstance(proj, nn.Linear) else x @ proj)
        return self.logits(model, img, F.normalize(txt, dim=-1))

    # -- fusion ----------------------------------------------------------------------------
    def fused_config(
        self, members: Sequence[nn.Module], mlp: str, report: dict[str, float], sd: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The config of ``service.core.fused_clip.FusedCLIP`` (see :meth:`FamilyAdapter.to_fused`)."""
        ref = members[0]
        vcfg = _fuse_vision(members, mlp, report, sd)
        fuse_text = _fuse_hf_text if _is_hf_text(ref) else _fuse_clip_text
        tcfg = fuse_text(members, mlp, report, sd)
        sd["logit_scale"] = shared_or_mean([m.logit_scale.reshape(()) for m in members], "logit_scale", report)
        bias = None
        if ref.logit_bias is not None:
            sd["logit_bias"] = shared_or_mean([m.logit_bias.reshape(()) for m in members], "logit_bias", report)
            bias = float(sd["logit_bias"])
        return {
            "arch": self.row.arch,
            "members": len(members),
            "embed_dim": int(ref.visual.proj.shape[1]),
            "logit_scale": float(sd["logit_scale"].exp()),
            "logit_bias": bias,
            "mlp": mlp,
            "vision": vcfg,
            "text": tcfg,
        }


def _mha_layer(blk: nn.Module) -> dict[str, Any]:
    """Canonical weights (:func:`.base.layer_weights`) of an open_clip ``ResidualAttentionBlock``."""
    a, mlp = blk.attn, blk.mlp
    ls = (blk.ls_1.gamma, blk.ls_2.gamma) if hasattr(blk.ls_1, "gamma") else None
    qkv_bias = a.in_proj_bias.chunk(3) if a.in_proj_bias is not None else None
    return layer_weights(a.in_proj_weight.chunk(3), qkv_bias, a.out_proj, blk.ln_1, blk.ln_2, mlp.c_fc, mlp.c_proj, ls)


def _mha_blocks_cfg(blocks: nn.ModuleList) -> dict[str, Any]:
    blk0 = blocks[0]
    return {
        "dim": blk0.ln_1.normalized_shape[0],
        "head_dim": blk0.attn.head_dim,
        "mlp_hidden": blk0.mlp.c_fc.out_features,
        "act": _act_name(blk0.mlp.gelu),
        "eps": blk0.ln_1.eps,
        "qkv_bias": blk0.attn.in_proj_bias is not None,
        "layer_scale": hasattr(blk0.ls_1, "gamma"),
    }


def _fuse_vision(members: Sequence[nn.Module], mlp: str, report: dict, sd: dict) -> dict[str, Any]:
    vs = [m.visual for m in members]
    v = vs[0]
    sd["visual.patch_embed.weight"] = shared_or_mean([x.conv1.weight for x in vs], "visual.conv1", report)
    sd["visual.class_embedding"] = shared_or_mean([x.class_embedding for x in vs], "visual.class_embedding", report)
    sd["visual.pos_embed"] = shared_or_mean([x.positional_embedding for x in vs], "visual.positional_embedding", report)
    ln_pre = not isinstance(v.ln_pre, nn.Identity)
    if ln_pre:
        for k, t in member_norm([x.ln_pre.weight for x in vs], [x.ln_pre.bias for x in vs]).items():
            sd[f"visual.norm_pre.{k}"] = t
    blocks = [x.transformer.resblocks for x in vs]
    cfg = _mha_blocks_cfg(blocks[0])
    cfg["num_heads"] = fuse_blocks("visual.encoder.blocks", blocks, _mha_layer, cfg["head_dim"], mlp, report, sd)
    for k, t in member_norm([x.ln_post.weight for x in vs], [x.ln_post.bias for x in vs]).items():
        sd[f"visual.norm.{k}"] = t
    sd["visual.proj.weight"] = torch.stack([x.proj.detach().float() for x in vs]).contiguous()  # (M, width, D)
    return {
        **cfg,
        "img_size": list(v.image_size),
        "patch_size": list(v.patch_size),
        "in_chans": v.conv1.in_channels,
        "ln_pre": ln_pre,
        "pool": v.pool_type,
        "final_ln_after_pool": bool(v.final_ln_after_pool),
    }


def _fuse_clip_text(members: Sequence[nn.Module], mlp: str, report: dict, sd: dict) -> dict[str, Any]:
    ts = [_text(m) for m in members]
    t = ts[0]
    sd["text.token_embedding.weight"] = shared_or_mean([x.token_embedding.weight for x in ts], "text.token", report)
    sd["text.pos_embed"] = shared_or_mean([x.positional_embedding for x in ts], "text.positional_embedding", report)
    blocks = [x.transformer.resblocks for x in ts]
    cfg = _mha_blocks_cfg(blocks[0])
    cfg["num_heads"] = fuse_blocks("text.encoder.blocks", blocks, _mha_layer, cfg["head_dim"], mlp, report, sd)
    for k, v in member_norm([x.ln_final.weight for x in ts], [x.ln_final.bias for x in ts]).items():
        sd[f"text.norm.{k}"] = v
    proj = t.text_projection
    if proj is None:
        proj_kind = "none"
    elif isinstance(proj, nn.Linear):
        proj_kind = "linear"
        biases = [x.text_projection.bias for x in ts] if proj.bias is not None else None
        lin = grouped_linear([x.text_projection.weight for x in ts], biases)
        for k, v in lin.items():
            sd[f"text.proj.{k}"] = v
    else:  # a (width, D) parameter used as x @ P
        proj_kind = "linear"
        sd["text.proj.weight"] = torch.stack([x.text_projection.detach().float() for x in ts]).contiguous()
    pool, eos = _text_pool(members[0])
    return {
        **cfg,
        "type": "clip",
        "vocab_size": t.token_embedding.num_embeddings,
        "context_length": t.positional_embedding.shape[0],
        "causal": t.attn_mask is not None,
        "pool": pool,
        "eos_id": eos,
        "proj": proj_kind,
        "proj_bias": isinstance(proj, nn.Linear) and proj.bias is not None,
    }


def _fuse_hf_text(members: Sequence[nn.Module], mlp: str, report: dict, sd: dict) -> dict[str, Any]:
    hfs = [m.text for m in members]
    berts = [h.transformer for h in hfs]
    c = berts[0].config
    num_heads = fuse_bert_encoder(berts, "text.", mlp, report, sd)
    pooler = _hf_pooler_name(hfs[0])
    if pooler == "cls_pooler":
        dense = [b.pooler.dense for b in berts]
        for k, v in grouped_linear([p.weight for p in dense], [p.bias for p in dense]).items():
            sd[f"text.pooler.{k}"] = v
    proj, _ = _hf_proj(hfs[0])
    projs = [_hf_proj(h)[1] for h in hfs]
    proj_hidden = None
    if proj == "linear":
        sd["text.proj.weight"] = grouped_linear([p[0].weight for p in projs], None)["weight"]
    elif proj == "mlp":
        sd["text.proj1.weight"] = grouped_linear([p[0].weight for p in projs], None)["weight"]
        sd["text.proj2.weight"] = grouped_linear([p[1].weight for p in projs], None)["weight"]
        proj_hidden = projs[0][0].out_features
    return {
        "type": "hf-bert",
        "vocab_size": c.vocab_size,
        "max_position": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size,
        "pad_token_id": c.pad_token_id,
        "dim": c.hidden_size,
        "head_dim": c.hidden_size // c.num_attention_heads,
        "num_heads": num_heads,
        "mlp_hidden": c.intermediate_size,
        "act": BERT_ACTS[c.hidden_act],
        "eps": c.layer_norm_eps,
        "qkv_bias": True,
        "pooler": pooler,
        "proj": proj,
        "proj_hidden": proj_hidden,
    }


__all__ = [
    "CLIPAdapter",
    "SlicedMultiheadAttention",
    "check_supported",
    "split_heads",
    "text_attention_mask",
]
