"""Adapter for timm ``VisionTransformer`` (any depth, width and head count; ``vit_base_patch16_224`` in production)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from offline.families.base import (
    FamilyAdapter,
    fuse_blocks,
    grouped_linear,
    layer_weights,
    member_norm,
    shared_or_mean,
    stack,
)
from service.core.families import VIT


def check_supported(model: nn.Module) -> None:
    """Raise TypeError / ValueError naming every timm ViT feature the fused model does not implement."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise TypeError(f"the vit family expects a timm VisionTransformer, got {type(model).__name__}")
    problems = []
    if model.reg_token is not None:
        problems.append("register tokens")
    if model.attn_pool is not None:
        problems.append("attention pooling")
    if getattr(model, "dynamic_img_size", False):
        problems.append("dynamic_img_size")
    if model.no_embed_class:
        problems.append("no_embed_class")
    if not isinstance(model.patch_embed.norm, nn.Identity):
        problems.append("patch-embedding norm")
    if model.global_pool not in ("token", "avg"):
        problems.append(f"global_pool={model.global_pool!r}")
    for i, blk in enumerate(model.blocks):
        a = blk.attn
        if not isinstance(a.q_norm, nn.Identity) or not isinstance(a.norm, nn.Identity) or a.gate is not None:
            problems.append(f"block {i}: qk_norm / scale_norm / gated attention")
            break
    if problems:
        raise ValueError(f"unsupported VisionTransformer features for Hydra fusion: {', '.join(problems)}")


class ViTAdapter(FamilyAdapter):
    row = VIT
    base_loader = "timm"
    lora_targets = r".*blocks\.\d+\.attn\.(qkv|proj)"

    def logits(self, model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
        return model(batch["pixel_values"], **kwargs)

    check = staticmethod(check_supported)

    def num_layers(self, model: nn.Module) -> int:
        return len(model.blocks)

    def head_dim(self, model: nn.Module) -> int:
        return model.blocks[0].attn.head_dim

    def heads(self, model: nn.Module) -> list[int]:
        return [blk.attn.num_heads for blk in model.blocks]

    def layer_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def out_proj(self, model: nn.Module, layer: int) -> nn.Linear:
        return model.blocks[layer].attn.proj

    def qkv_weights(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(model.blocks[layer].attn.qkv.weight.chunk(3, dim=0))  # rows [Wq; Wk; Wv]

    def qkv_grads(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = model.blocks[layer].attn.qkv.weight.grad
        if g is None:
            raise RuntimeError(f"no gradient on block {layer} qkv: run a backward pass first")
        return tuple(g.chunk(3, dim=0))

    def _slice_layer(self, model: nn.Module, layer: int, keep: Sequence[int]) -> None:
        attn = model.blocks[layer].attn
        hd, H = attn.head_dim, attn.num_heads
        rows = torch.tensor([h * hd + c for h in keep for c in range(hd)], dtype=torch.long)
        qkv_rows = torch.cat([rows + s * H * hd for s in range(3)])
        old_qkv, old_proj = attn.qkv, attn.proj
        qkv = nn.Linear(old_qkv.in_features, len(qkv_rows), bias=old_qkv.bias is not None)
        proj = nn.Linear(len(rows), old_proj.out_features, bias=old_proj.bias is not None)
        with torch.no_grad():
            qkv.weight.copy_(old_qkv.weight[qkv_rows])
            if old_qkv.bias is not None:
                qkv.bias.copy_(old_qkv.bias[qkv_rows])
            proj.weight.copy_(old_proj.weight[:, rows])
            if old_proj.bias is not None:
                proj.bias.copy_(old_proj.bias)
        attn.qkv, attn.proj = qkv.to(old_qkv.weight), proj.to(old_proj.weight)
        attn.num_heads = len(keep)
        attn.attn_dim = len(keep) * hd

    def stem(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        x = model.patch_embed(batch["pixel_values"])
        x = model._pos_embed(x)
        x = model.patch_drop(x)
        return model.norm_pre(x), None

    def block(self, model: nn.Module, layer: int, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        return model.blocks[layer](h)

    def readout(self, model: nn.Module, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        return model.forward_head(model.norm(h))

    def fused_config(
        self, members: Sequence[nn.Module], mlp: str, report: dict[str, float], sd: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        ref = members[0]
        sd["patch_embed.weight"] = shared_or_mean([m.patch_embed.proj.weight for m in members], "patch_embed", report)
        if ref.patch_embed.proj.bias is not None:
            sd["patch_embed.bias"] = shared_or_mean([m.patch_embed.proj.bias for m in members], "patch_embed", report)
        if ref.cls_token is not None:
            sd["cls_token"] = shared_or_mean([m.cls_token for m in members], "cls_token", report)
        sd["pos_embed"] = shared_or_mean([m.pos_embed for m in members], "pos_embed", report)
        hd = self.head_dim(ref)
        num_heads = fuse_blocks("encoder.blocks", [m.blocks for m in members], _block_weights, hd, mlp, report, sd)
        for name in ("norm_pre", "norm", "fc_norm"):
            if not isinstance(getattr(ref, name), nn.Identity):
                mods = [getattr(m, name) for m in members]
                for k, v in member_norm([n.weight for n in mods], [n.bias for n in mods]).items():
                    sd[f"{name}.{k}"] = v
        for k, v in grouped_linear([m.head.weight for m in members], [m.head.bias for m in members]).items():
            sd[f"head.{k}"] = v
        blk0 = ref.blocks[0]
        act = blk0.mlp.act
        act_name = "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
        if not isinstance(act, nn.GELU):
            raise ValueError(f"unsupported MLP activation {type(act).__name__}")
        return {
            "arch": self.row.arch,
            "members": len(members),
            "img_size": list(ref.patch_embed.img_size),
            "patch_size": ref.patch_embed.patch_size[0],
            "in_chans": ref.patch_embed.proj.in_channels,
            "dim": ref.embed_dim,
            "head_dim": hd,
            "num_heads": num_heads,
            "mlp_hidden": blk0.mlp.fc1.out_features,
            "num_classes": ref.num_classes,
            "act": act_name,
            "eps": blk0.norm1.eps,
            "qkv_bias": blk0.attn.qkv.bias is not None,
            "layer_scale": hasattr(blk0.ls1, "gamma"),
            "mlp": mlp,
            "class_token": ref.cls_token is not None,
            "global_pool": ref.global_pool,
            "norm_pre": not isinstance(ref.norm_pre, nn.Identity),
            "final_norm": not isinstance(ref.norm, nn.Identity),
            "fc_norm": not isinstance(ref.fc_norm, nn.Identity),
            "patch_bias": ref.patch_embed.proj.bias is not None,
        }


def _block_weights(blk: nn.Module) -> dict[str, Any]:
    """Canonical weights (:func:`.base.layer_weights`) of a timm ``Block``."""
    a, mlp = blk.attn, blk.mlp
    ls = (blk.ls1.gamma, blk.ls2.gamma) if hasattr(blk.ls1, "gamma") else None
    qkv_bias = a.qkv.bias.chunk(3) if a.qkv.bias is not None else None
    return layer_weights(a.qkv.weight.chunk(3), qkv_bias, a.proj, blk.norm1, blk.norm2, mlp.fc1, mlp.fc2, ls)


__all__ = ["ViTAdapter", "check_supported", "stack"]
