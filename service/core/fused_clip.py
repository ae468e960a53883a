"""Fused Hydra dual encoder for zero-shot classification (OpenCLIP ``CLIP`` / ``CustomTextCLIP``).

M pruned copies of one OpenCLIP model run as one model: the image encoder gives
``(B, M, D)`` and the text encoder ``(L, M, D)`` L2-normalised embeddings in one pass
each; member m's zero-shot logits are ``exp(logit_scale) · image[:, m] · text[:, m]ᵀ``
(``+ logit_bias`` for SigLIP-style models), so :meth:`FusedCLIP.forward` returns
``(B, M, L)`` logits: the shape ``service.core.uncertainty.summarize`` takes. Only torch is
imported here; the blocks are the shared ones of :mod:`service.core.fused` (activations
``(M, N*T, d)``, per-member attention, shared or per-member MLP, zero-padded heads).

Config (written by ``offline/families/clip.py::CLIPAdapter.to_fused``)::

    {"arch": "clip", "members": M, "embed_dim": D, "logit_scale": float (exp'd), "logit_bias": float|None,
     "mlp": "shared"|"per_member",
     "vision": {"img_size": [H, W], "patch_size": [p, p], "in_chans": 3, "dim", "head_dim",
                "num_heads": [per layer, padded], "mlp_hidden", "act", "eps", "qkv_bias", "layer_scale",
                "ln_pre": bool, "pool": "tok"|"avg", "final_ln_after_pool": bool},
     "text": {"type": "clip", "vocab_size", "context_length", "dim", "head_dim", "num_heads", "mlp_hidden",
              "act", "eps", "qkv_bias", "layer_scale", "causal": bool, "pool": "argmax"|"eos"|"first"|"last",
              "eos_id", "proj": "linear"|"none", "proj_bias": bool}
          | {"type": "hf-bert", "vocab_size", "max_position", "type_vocab_size", "pad_token_id", "dim",
             "head_dim", "num_heads", "mlp_hidden", "act", "eps", "qkv_bias",
             "pooler": "mean_pooler"|"cls_pooler"|"cls_last_hidden_state_pooler",
             "proj": "none"|"linear"|"mlp", "proj_hidden": int|None}}

Exports: :attr:`FusedCLIP.image_encoder` (``pixel_values -> (B, M, D)``) and
:attr:`FusedCLIP.text_encoder` (``input_ids, attention_mask -> (L, M, D)``) are the tower
modules themselves, each traceable / ONNX-exportable on its own with dynamic batch, label
count and sequence length. The causal (standard CLIP) text tower reads only ``input_ids``:
its padding never reaches the EOT token, exactly as in open_clip.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from service.core.fused import FusedEncoder, GroupedLinear, MemberLayerNorm, stack_members

__all__ = ["FusedCLIP", "FusedCLIPVision", "FusedCLIPText", "FusedHFText", "zero_shot_logits"]


def _pair(v: int | list[int] | tuple[int, int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _encoder_cfg(tower: dict[str, Any], members: int, mlp: str) -> dict[str, Any]:
    return {**tower, "members": members, "mlp": mlp}


def zero_shot_logits(
    image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-member logits ``(B, M, L)`` from image ``(B, M, D)`` and text ``(L, M, D)`` embeddings."""
    logits = scale * torch.einsum("bmd,lmd->bml", image, text)
    return logits if bias is None else logits + bias


class FusedCLIPVision(nn.Module):
    """OpenCLIP ``VisionTransformer`` of M members: ``pixel_values (B, C, H, W) -> (B, M, D)``, L2-normalised."""

    def __init__(self, cfg: dict[str, Any], members: int, embed_dim: int, mlp: str = "shared") -> None:
        super().__init__()
        self.members = members
        self.dim = d = cfg["dim"]
        ph, pw = _pair(cfg["patch_size"])
        ih, iw = _pair(cfg["img_size"])
        self.patch_embed = nn.Conv2d(cfg.get("in_chans", 3), d, kernel_size=(ph, pw), stride=(ph, pw), bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.pos_embed = nn.Parameter(torch.zeros((ih // ph) * (iw // pw) + 1, d))
        eps = cfg.get("eps", 1e-5)
        self.norm_pre = MemberLayerNorm(members, d, eps) if cfg.get("ln_pre", True) else None
        self.encoder = FusedEncoder(_encoder_cfg(cfg, members, mlp), norm_first=True)
        self.norm = MemberLayerNorm(members, d, eps)
        self.pool = cfg.get("pool", "tok")
        self.final_ln_after_pool = bool(cfg.get("final_ln_after_pool", False))
        self.proj = GroupedLinear(members, d, embed_dim, bias=False)
        # True (a tower of 2 or more layers): forward returns (embeddings, layer features (B, M, L-1, d)), every
        # block's output but the last's averaged over the tokens: the label-free OOD score reads them
        self.with_layer_features = False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values (B, C, H, W) -> (B, M, D)`` normalised embeddings (and the layer features, with
        :attr:`with_layer_features`)."""
        emb, layers = self.embed(pixel_values, self.with_layer_features)
        return emb if layers is None else (emb, layers)

    def embed(self, pixel_values: torch.Tensor, layers: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(embeddings (B, M, D), layer features (B, M, L-1, d) or None)``: the latter when asked for and the
        tower has a second layer."""
        B = pixel_values.shape[0]
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (B, T0, d)
        cls = self.class_embedding.view(1, 1, -1).expand(B, 1, self.dim)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, T, d)
        T = x.shape[1]
        x = stack_members(x, self.members)  # (M, B*T, d)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        M, d = self.members, self.dim
        pooled: list[torch.Tensor] | None = [] if layers and len(self.encoder.blocks) > 1 else None
        pool = (lambda h: h.view(M, B, T, d).mean(dim=2)) if pooled is not None else None  # (M, B, d)
        x = self.encoder(x, T, pooled=pooled, pool=pool)
        if not self.final_ln_after_pool:
            x = self.norm(x)
        x = x.view(self.members, B, T, self.dim)  # (M, B, T, d)
        x = x[:, :, 1:].mean(dim=2) if self.pool == "avg" else x[:, :, 0]  # (M, B, d)
        if self.final_ln_after_pool:
            x = self.norm(x)
        x = self.proj(x)  # (M, B, D)
        emb = F.normalize(x, dim=-1).transpose(0, 1)  # (B, M, D)
        return emb, (torch.stack(pooled, dim=2).transpose(0, 1) if pooled else None)  # (B, M, L-1, d)


class FusedCLIPText(nn.Module):
    """OpenCLIP text transformer of M members: ``input_ids (L, T) -> (L, M, D)``, L2-normalised.

    Causal self-attention (unless ``causal`` is false), ``ln_final``, pooling at the EOT token
    (``argmax`` of the ids, or the first ``eos_id``), then the text projection. ``T`` may be
    shorter than ``context_length``. ``attention_mask`` is accepted for a uniform signature and
    not used: with a causal mask, tokens after the EOT never reach it (as in open_clip).
    """

    def __init__(self, cfg: dict[str, Any], members: int, embed_dim: int, mlp: str = "shared") -> None:
        super().__init__()
        self.members = members
        self.dim = d = cfg["dim"]
        self.causal = bool(cfg.get("causal", True))
        self.pool = cfg.get("pool", "argmax")
        self.eos_id = int(cfg["eos_id"]) if cfg.get("eos_id") is not None else -1
        self.token_embedding = nn.Embedding(cfg["vocab_size"], d)
        self.pos_embed = nn.Parameter(torch.zeros(cfg["context_length"], d))
        self.encoder = FusedEncoder(_encoder_cfg(cfg, members, mlp), norm_first=True)
        self.norm = MemberLayerNorm(members, d, cfg.get("eps", 1e-5))
        proj = cfg.get("proj", "linear")
        self.proj = GroupedLinear(members, d, embed_dim, bias=cfg.get("proj_bias", False)) if proj != "none" else None

    def _pool_index(self, input_ids: torch.Tensor) -> torch.Tensor:
        L, T = input_ids.shape
        if self.pool == "argmax":  # the EOT token has the largest id
            return input_ids.argmax(dim=-1)
        if self.pool == "eos":
            return (input_ids == self.eos_id).int().argmax(dim=-1)
        if self.pool == "first":
            return torch.zeros(L, dtype=torch.long, device=input_ids.device)
        return torch.full((L,), T - 1, dtype=torch.long, device=input_ids.device)  # last

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        L, T = input_ids.shape
        x = self.token_embedding(input_ids) + self.pos_embed[:T]  # (L, T, d)
        x = self.encoder(stack_members(x, self.members), T, None, is_causal=self.causal)  # (M, L*T, d)
        x = x.view(self.members, L, T, self.dim)
        idx = self._pool_index(input_ids).view(1, L, 1, 1).expand(self.members, L, 1, self.dim)
        x = self.norm(x.gather(2, idx).squeeze(2))  # (M, L, d): LayerNorm is per token, pool first
        if self.proj is not None:
            x = self.proj(x)  # (M, L, D)
        return F.normalize(x, dim=-1).transpose(0, 1)  # (L, M, D)


class FusedHFText(nn.Module):
    """Hugging Face BERT text tower (open_clip ``HFTextEncoder``) of M members: ``(L, T) -> (L, M, D)``, normalised.

    Post-norm BERT blocks with a key padding mask, then the configured pooler (masked mean,
    BERT pooler on [CLS], or the [CLS] hidden state) and projection (none, linear, or
    Linear-GELU-Linear), all without bias as in open_clip.
    """

    def __init__(self, cfg: dict[str, Any], members: int, embed_dim: int, mlp: str = "shared") -> None:
        super().__init__()
        self.members = members
        self.dim = d = cfg["dim"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], d)
        self.position_embeddings = nn.Embedding(cfg["max_position"], d)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), d)
        eps = cfg.get("eps", 1e-12)
        self.emb_norm = MemberLayerNorm(members, d, eps)
        self.encoder = FusedEncoder(_encoder_cfg({**cfg, "eps": eps}, members, mlp), norm_first=False)
        self.pooler_kind = cfg.get("pooler", "mean_pooler")
        self.pooler = GroupedLinear(members, d, d) if self.pooler_kind == "cls_pooler" else None
        self.proj_kind = cfg.get("proj", "none")
        if self.proj_kind == "linear":
            self.proj = GroupedLinear(members, d, embed_dim, bias=False)
        elif self.proj_kind == "mlp":
            self.proj1 = GroupedLinear(members, d, cfg["proj_hidden"], bias=False)
            self.proj2 = GroupedLinear(members, cfg["proj_hidden"], embed_dim, bias=False)
            self.act = nn.GELU()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        L, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.emb_norm(stack_members(x, self.members))  # (M, L*T, d)
        keep = attention_mask.to(torch.bool)
        # key padding mask, True = attend: (L, T) -> (M*L, 1, 1, T)
        mask = keep.view(1, L, 1, 1, T).expand(self.members, L, 1, 1, T).reshape(self.members * L, 1, 1, T)
        x = self.encoder(x, T, mask).view(self.members, L, T, self.dim)  # (M, L, T, d)
        if self.pooler_kind == "mean_pooler":
            w = attention_mask.to(x.dtype)  # (L, T)
            x = (x * w[None, :, :, None]).sum(dim=2) / w.sum(dim=-1)[None, :, None]  # (M, L, d)
        else:
            x = x[:, :, 0]  # (M, L, d) the [CLS] token
            if self.pooler is not None:
                x = torch.tanh(self.pooler(x))
        if self.proj_kind == "linear":
            x = self.proj(x)
        elif self.proj_kind == "mlp":
            x = self.proj2(self.act(self.proj1(x)))
        return F.normalize(x, dim=-1).transpose(0, 1)  # (L, M, D)


class FusedCLIP(nn.Module):
    """Fused Hydra dual encoder: ``forward(pixel_values, input_ids, attention_mask) -> logits (B, M, L)``.

    ``encode_image``: ``(B, C, H, W) -> (B, M, D)``; ``encode_text``: ``(L, T), (L, T) -> (L, M, D)``;
    both L2-normalised. ``logit_scale`` is stored as its log (as in open_clip).
    """

    ARCH = "clip"  # the config's arch (service.core.registry.ARCHS)

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = dict(cfg)
        M, D, mlp = cfg["members"], cfg["embed_dim"], cfg.get("mlp", "shared")
        self.members = M
        self.embed_dim = D
        self.visual = FusedCLIPVision(cfg["vision"], M, D, mlp)
        text_type = cfg["text"].get("type", "clip")
        if text_type == "clip":
            self.text: FusedCLIPText | FusedHFText = FusedCLIPText(cfg["text"], M, D, mlp)
        elif text_type == "hf-bert":
            self.text = FusedHFText(cfg["text"], M, D, mlp)
        else:
            raise ValueError(f"unknown text tower type {text_type!r}; expected 'clip' or 'hf-bert'")
        scale = float(cfg.get("logit_scale", 100.0))
        self.logit_scale = nn.Parameter(torch.tensor(scale).log())
        bias = cfg.get("logit_bias")
        self.logit_bias = nn.Parameter(torch.tensor(float(bias))) if bias is not None else None

    @property
    def image_encoder(self) -> nn.Module:
        """The image tower alone, ``pixel_values -> (B, M, D)``: what gets exported as ``image_encoder``."""
        return self.visual

    @property
    def text_encoder(self) -> nn.Module:
        """The text tower alone, ``(input_ids, attention_mask) -> (L, M, D)``: exported as ``text_encoder``."""
        return self.text

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, M, D)`` normalised image embeddings."""
        return self.visual.embed(pixel_values, layers=False)[0]

    def image_features(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(embeddings (B, M, D), layer features (B, M, L-1, d) or None)``: what the label-free OOD score reads."""
        return self.visual.embed(pixel_values, layers=True)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text(input_ids, attention_mask)

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        return zero_shot_logits(
            self.encode_image(pixel_values),
            self.text(input_ids, attention_mask),
            self.logit_scale.exp(),
            self.logit_bias,
        )
