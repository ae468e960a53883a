"""Fused Hydra ensemble: M pruned transformer members run as one model.

This is the runtime half of the project: the offline builder (``offline/fusion.py``)
writes a config dict plus a safetensors state dict, and the server rebuilds the
model from them with :func:`load_model`. Only torch is imported here.

Layout (see ``shared/PERF.md`` for why): activations are kept as ``(M, B*T, d)``
(members, batch × tokens, width). Per-member attention projections are grouped
linears computed with one ``torch.baddbmm`` over members; the attention kernel
sees ``M*B`` independent sequences; the MLP is one shared ``nn.Linear`` applied
to every member stream (the paper's averaged MLP) or a grouped linear when the
members keep their own MLPs. Members may keep different numbers of heads in a
layer: each layer is padded to the largest member's head count with zero heads
(zero q/k/v rows and zero output-projection columns), which contribute exactly
nothing, so the fusion stays exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GroupedLinear",
    "MemberLayerNorm",
    "FusedAttention",
    "FusedBlock",
    "FusedViT",
    "FusedBert",
    "build_model",
    "load_model",
    "tiny_config",
    "ARCHS",
]


def _act(name: str):
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "quick_gelu":
        return QuickGELU()
    if name == "relu":
        return nn.ReLU()
    raise ValueError(f"unknown activation {name!r}; expected gelu, gelu_tanh, quick_gelu or relu")


class QuickGELU(nn.Module):
    """x · sigmoid(1.702 x), as in OpenAI CLIP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class GroupedLinear(nn.Module):
    """M independent linears applied to M streams: ``(M, N, in) -> (M, N, out)``.

    Weight is stored as ``(M, in, out)`` (transposed w.r.t. ``nn.Linear``) so the
    forward is a single ``baddbmm`` with no copies.
    """

    def __init__(self, members: int, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(members, 1, out_features)) if bias else None
        nn.init.normal_(self.weight, std=in_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.bmm(x, self.weight)
        return torch.baddbmm(self.bias, x, self.weight)


class MemberLayerNorm(nn.Module):
    """LayerNorm whose affine parameters differ per member: ``(M, N, d) -> (M, N, d)``."""

    def __init__(self, members: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(members, 1, dim))
        self.bias = nn.Parameter(torch.zeros(members, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.bias, F.layer_norm(x, (self.dim,), eps=self.eps), self.weight)


class FusedAttention(nn.Module):
    """Multi-head self-attention of M members at once.

    ``num_heads`` is the padded per-member head count of this layer (the largest
    member's); a member with fewer heads has zero weights in the padded slots.
    """

    def __init__(
        self, members: int, dim: int, num_heads: int, head_dim: int, qkv_bias: bool = True, proj_bias: bool = True
    ) -> None:
        super().__init__()
        self.members = members
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        if num_heads > 0:
            self.qkv = GroupedLinear(members, dim, 3 * self.attn_dim, bias=qkv_bias)
            self.proj = GroupedLinear(members, self.attn_dim, dim, bias=proj_bias)
        else:  # every member pruned every head of this layer: only the projection bias is left
            self.qkv = None
            self.proj = None
            self.proj_bias = nn.Parameter(torch.zeros(members, 1, dim))

    def forward(self, x: torch.Tensor, seq_len: int, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        # x: (M, B*T, d); attn_mask: None or bool (M*B, 1, 1|T, T), True = attend
        if self.qkv is None:
            return self.proj_bias.expand_as(x)
        M, N, _ = x.shape
        qkv = self.qkv(x)  # (M, B*T, 3*H*hd)
        q, k, v = qkv.view(-1, seq_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        # q, k, v: (M*B, H, T, hd)
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)  # (M*B, H, T, hd)
        z = z.transpose(1, 2).reshape(M, N, self.attn_dim)  # (M, B*T, H*hd)
        return self.proj(z)


class FusedMLP(nn.Module):
    """Two-layer MLP, shared by all members (``shared=True``, the paper's merged MLP) or per member."""

    def __init__(self, members: int, dim: int, hidden: int, act: str, shared: bool = True) -> None:
        super().__init__()
        self.shared = shared
        if shared:
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, dim)
        else:
            self.fc1 = GroupedLinear(members, dim, hidden)
            self.fc2 = GroupedLinear(members, hidden, dim)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FusedBlock(nn.Module):
    """One transformer layer for M members; pre-norm (ViT, CLIP) or post-norm (BERT)."""

    def __init__(
        self,
        members: int,
        dim: int,
        num_heads: int,
        head_dim: int,
        mlp_hidden: int,
        act: str = "gelu",
        norm_first: bool = True,
        eps: float = 1e-6,
        qkv_bias: bool = True,
        layer_scale: bool = False,
        shared_mlp: bool = True,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm1 = MemberLayerNorm(members, dim, eps)
        self.attn = FusedAttention(members, dim, num_heads, head_dim, qkv_bias=qkv_bias)
        self.norm2 = MemberLayerNorm(members, dim, eps)
        self.mlp = FusedMLP(members, dim, mlp_hidden, act, shared=shared_mlp)
        self.ls1 = nn.Parameter(torch.ones(members, 1, dim)) if layer_scale else None
        self.ls2 = nn.Parameter(torch.ones(members, 1, dim)) if layer_scale else None

    def forward(
        self, x: torch.Tensor, seq_len: int, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        if self.norm_first:
            a = self.attn(self.norm1(x), seq_len, attn_mask, is_causal)
            x = x + (a if self.ls1 is None else a * self.ls1)
            m = self.mlp(self.norm2(x))
            return x + (m if self.ls2 is None else m * self.ls2)
        x = self.norm1(x + self.attn(x, seq_len, attn_mask, is_causal))
        return self.norm2(x + self.mlp(x))


class FusedEncoder(nn.Module):
    """A stack of :class:`FusedBlock` built from the config's per-layer head counts."""

    def __init__(self, cfg: dict[str, Any], norm_first: bool) -> None:
        super().__init__()
        M, d = cfg["members"], cfg["dim"]
        self.blocks = nn.ModuleList(
            FusedBlock(
                M,
                d,
                h,
                cfg["head_dim"],
                cfg["mlp_hidden"],
                act=cfg.get("act", "gelu"),
                norm_first=norm_first,
                eps=cfg.get("eps", 1e-6),
                qkv_bias=cfg.get("qkv_bias", True),
                layer_scale=cfg.get("layer_scale", False),
                shared_mlp=cfg.get("mlp", "shared") == "shared",
            )
            for h in cfg["num_heads"]
        )

    def forward(
        self, x: torch.Tensor, seq_len: int, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x, seq_len, attn_mask, is_causal)
        return x


def _stack_members(x: torch.Tensor, members: int) -> torch.Tensor:
    """(B, T, d) shared embedding -> (M, B*T, d) member streams."""
    B, T, d = x.shape
    return x.reshape(1, B * T, d).expand(members, B * T, d)


class FusedViT(nn.Module):
    """Fused timm ``VisionTransformer``: ``pixel_values (B, C, H, W) -> logits (B, M, C)``.

    Config keys: members, img_size, patch_size, in_chans, dim, head_dim, num_heads
    (per layer, padded), mlp_hidden, num_classes, act, eps, qkv_bias, layer_scale,
    mlp ("shared"|"per_member"), class_token, global_pool ("token"|"avg"),
    norm_pre, final_norm, fc_norm, patch_bias.
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = dict(cfg)
        M, d = cfg["members"], cfg["dim"]
        self.members = M
        self.dim = d
        p = cfg["patch_size"]
        self.patch_embed = nn.Conv2d(cfg["in_chans"], d, kernel_size=p, stride=p, bias=cfg.get("patch_bias", True))
        gh, gw = cfg["img_size"][0] // p, cfg["img_size"][1] // p
        self.num_prefix = 1 if cfg.get("class_token", True) else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if self.num_prefix else None
        self.pos_embed = nn.Parameter(torch.randn(1, gh * gw + self.num_prefix, d) * 0.02)
        eps = cfg.get("eps", 1e-6)
        self.norm_pre = MemberLayerNorm(M, d, eps) if cfg.get("norm_pre", False) else None
        self.encoder = FusedEncoder(cfg, norm_first=True)
        self.norm = MemberLayerNorm(M, d, eps) if cfg.get("final_norm", True) else None
        self.fc_norm = MemberLayerNorm(M, d, eps) if cfg.get("fc_norm", False) else None
        self.global_pool = cfg.get("global_pool", "token")
        self.head = GroupedLinear(M, d, cfg["num_classes"])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        B = pixel_values.shape[0]
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (B, T0, d)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)  # (B, T, d)
        x = x + self.pos_embed
        T = x.shape[1]
        x = _stack_members(x, self.members)  # (M, B*T, d)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        x = self.encoder(x, T)
        if self.norm is not None:
            x = self.norm(x)
        x = x.view(self.members, B, T, self.dim)  # (M, B, T, d)
        if self.global_pool == "avg":
            x = x[:, :, self.num_prefix :].mean(dim=2)
        else:
            x = x[:, :, 0]  # (M, B, d)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return self.head(x).transpose(0, 1)  # (B, M, C)


class FusedBert(nn.Module):
    """Fused BERT-family sequence classifier: ``(input_ids, attention_mask) (B, T) -> logits (B, M, C)``.

    Embeddings are shared by all members (word, position, token type); the
    embedding LayerNorm, every block's LayerNorms, the pooler and the classifier
    are per member. Config keys: members, vocab_size, max_position, type_vocab_size,
    dim, head_dim, num_heads (per layer, padded), mlp_hidden, num_classes, act, eps,
    mlp, pooler (bool).
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = dict(cfg)
        M, d = cfg["members"], cfg["dim"]
        self.members = M
        self.dim = d
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], d)
        self.position_embeddings = nn.Embedding(cfg["max_position"], d)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), d)
        eps = cfg.get("eps", 1e-12)
        self.emb_norm = MemberLayerNorm(M, d, eps)
        self.encoder = FusedEncoder({**cfg, "eps": eps}, norm_first=False)
        self.pooler = GroupedLinear(M, d, d) if cfg.get("pooler", True) else None
        self.classifier = GroupedLinear(M, d, cfg["num_classes"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.emb_norm(_stack_members(x, self.members))  # (M, B*T, d)
        # key padding mask, True = attend: (B, T) -> (M*B, 1, 1, T)
        mask = attention_mask.to(torch.bool).view(1, B, 1, 1, T).expand(self.members, B, 1, 1, T)
        x = self.encoder(x, T, mask.reshape(self.members * B, 1, 1, T))
        x = x.view(self.members, B, T, self.dim)[:, :, 0]  # (M, B, d) first token
        if self.pooler is not None:
            x = torch.tanh(self.pooler(x))
        return self.classifier(x).transpose(0, 1)  # (B, M, C)


ARCHS: dict[str, type[nn.Module]] = {"vit": FusedViT, "bert": FusedBert}


def build_model(config: dict[str, Any]) -> nn.Module:
    """Instantiate a fused model (random init) from its config; ``config["arch"]`` picks the class."""
    arch = config.get("arch")
    if arch == "clip" and arch not in ARCHS:  # the dual encoder lives in its own module
        from service.fused_clip import FusedCLIP

        ARCHS["clip"] = FusedCLIP
    if arch not in ARCHS:
        raise ValueError(f"unknown fused architecture {arch!r}; known: {sorted(ARCHS)}")
    return ARCHS[arch](config)


def load_model(weights: str | Path, config: dict[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    """Build the fused model from ``config`` and load its safetensors weights (strict); eval mode."""
    from safetensors.torch import load_file

    model = build_model(config)
    state = load_file(str(weights), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"weights {weights} do not match the fused config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.to(device).eval()


def tiny_config(family: str, num_classes: int = 4, members: int = 3) -> dict[str, Any]:
    """A tiny runnable config for tests and fixtures (random weights)."""
    if family == "vit":
        return {
            "arch": "vit",
            "members": members,
            "img_size": [16, 16],
            "patch_size": 4,
            "in_chans": 1,
            "dim": 32,
            "head_dim": 8,
            "num_heads": [3, 2],
            "mlp_hidden": 64,
            "num_classes": num_classes,
            "act": "gelu",
            "eps": 1e-6,
        }
    if family == "bert":
        return {
            "arch": "bert",
            "members": members,
            "vocab_size": 30522,
            "max_position": 64,
            "type_vocab_size": 2,
            "dim": 32,
            "head_dim": 8,
            "num_heads": [3, 2],
            "mlp_hidden": 64,
            "num_classes": num_classes,
            "act": "gelu",
            "eps": 1e-12,
        }
    raise ValueError(f"unknown family {family!r}")


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
