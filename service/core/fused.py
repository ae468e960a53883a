"""Fused Hydra ensemble: M pruned transformer members run as one model.

This is the runtime half of the project: the offline builder (``offline/method/fusion.py``)
writes a config dict plus a safetensors state dict, and the server rebuilds the
model from them with :func:`service.core.registry.load_model`. Only torch is imported here.

The model is built of the member-grouped layers of :mod:`service.core.fused_layers` (whose docstring gives the
tensor and parameter layout): a :class:`FusedEncoder` of :class:`FusedBlock` layers, each an instance of one
:class:`BlockLayout` with its own head count. This module holds the classifiers over them (:class:`FusedViT`,
:class:`FusedBert`), their first-token readout and CPU sub-batching, and re-exports the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from service.core.fused_layers import (
    BlockLayout,
    FusedAttention,
    FusedBlock,
    FusedEncoder,
    FusedMLP,
    GroupedLinear,
    MemberLayerNorm,
    QuickGELU,
    Sequences,
    first_tokens,
)

__all__ = [
    "GroupedLinear",
    "MemberLayerNorm",
    "Sequences",
    "FusedAttention",
    "FusedMLP",
    "BlockLayout",
    "FusedBlock",
    "FusedEncoder",
    "FusedClassifier",
    "FusedViT",
    "FusedBert",
    "QuickGELU",
    "stack_members",
    "tiny_config",
    "count_params",
    "CPU_MAX_ROWS",
    "cpu_max_rows_for",
]


# Most rows (members x sequences x tokens) one CPU forward pass works on; larger batches run as
# sub-batches, one after another. On a CPU with native bf16 (AMX) a batch-32 pass over 3 x 32 x 128
# rows made the fused model *slower* than the deep ensemble (its 12,288-row activations leave the
# cache; each member's 4,096 rows do not), while sub-batches of at most 4,096 rows made it 0.79 of it
# (benchmarks/README.md, "A CPU with native bf16"). Exact: the sequences of a batch never interact.
# What leaves the cache is bytes, so the limit scales with the width: 4,096 rows at 768 (where it was measured),
# 16,384 at the default image model's 192, whose 3 x 32 x 50 rows then run in one pass (a split there made the
# pass 18 % slower in bf16 on an AMX CPU: 36 against 30.5 ms at batch 32).
CPU_MAX_ROWS = 4096
CPU_ROWS_WIDTH = 768


def cpu_max_rows_for(dim: int) -> int:
    """The CPU sub-batch row limit of a model of width ``dim``: :data:`CPU_MAX_ROWS` at :data:`CPU_ROWS_WIDTH`."""
    return max(1, CPU_MAX_ROWS * CPU_ROWS_WIDTH // max(1, dim))


def _sub_batch(model: nn.Module, batch: int, tokens: int, device: torch.device) -> int:
    """Sequences per forward pass: ``batch`` (one pass) unless the model runs eagerly on CPU with more
    than ``model.cpu_max_rows`` member rows (0 disables); traced, scripted and exported graphs are one pass."""
    max_rows: int = model.cpu_max_rows  # type: ignore[assignment]  # an int attribute of every fused model
    if (
        not max_rows
        or device.type != "cpu"
        or torch.jit.is_scripting()
        or torch.jit.is_tracing()
        or torch.onnx.is_in_onnx_export()
        or torch.compiler.is_compiling()  # torch.export / AOTInductor (strict: dynamo traces the graph)
        or torch.compiler.is_exporting()  # torch.export, non-strict
    ):
        return batch
    members: int = model.members  # type: ignore[assignment]  # an int attribute of every fused model
    step = max(1, min(batch, max_rows // (members * tokens)))
    return -(-batch // -(-batch // step))  # as even as the passes allow: 32 at most 27 -> 16 + 16, not 27 + 5


# logits (B, M, C), or (logits, features (B, M, D)), or (logits, features, layer features (B, M, L-1, d))
Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def _in_sub_batches(model: nn.Module, run: Callable[..., Outputs], tokens: int, *inputs: torch.Tensor) -> Outputs:
    """``run(*inputs)`` (each input batch-first), as sub-batches of :func:`_sub_batch`'s size, concatenated
    (each output separately when ``run`` returns several)."""
    B = inputs[0].shape[0]
    step = _sub_batch(model, B, tokens, inputs[0].device)
    if step >= B:
        return run(*inputs)
    parts = [run(*(t[i : i + step] for t in inputs)) for i in range(0, B, step)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))
    return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])  # every part is one tensor here


def stack_members(x: torch.Tensor, members: int) -> torch.Tensor:
    """(B, T, d) shared embedding -> (M, B*T, d) member streams (a broadcast view, no copy)."""
    B, T, d = x.shape
    return x.reshape(1, B * T, d).expand(members, B * T, d)


class FusedClassifier(nn.Module):
    """What the fused classifiers share (:class:`FusedViT`, :class:`FusedBert`; member logits ``(B, M, C)``).

    The config, member count and width, the CPU sub-batch size and the first-token readout:
    when ``first_token_readout`` is true the last layer computes only each sequence's first token
    (exact when the readout reads only that token; about one layer less work). False computes every
    token, as the members do. Subclasses set ``self.encoder``.
    """

    encoder: FusedEncoder

    def __init__(self, cfg: dict[str, Any], first_token_readout: bool) -> None:
        super().__init__()
        self.cfg = dict(cfg)
        self.members: int = cfg["members"]
        self.dim: int = cfg["dim"]
        self.first_token_readout = first_token_readout
        self.cpu_max_rows = cpu_max_rows_for(self.dim)  # eager CPU passes split larger batches (see CPU_MAX_ROWS)
        # True: forward returns (logits, features), the members' penultimate features (the input of each member's
        # classifier head, ``(B, M, D)``) for the feature-space OOD scores (service.core.ood); set before tracing
        self.with_features = False
        # True (with ``with_features``, and a model of 2 or more layers): a third output, the layer features
        # ``(B, M, L-1, d)``: every block's output but the last's, pooled over each sequence's tokens (the mean;
        # text: over its real tokens), per member. Low-level shifts (noise, blank frames) show in the early layers
        # long before they reach the last feature; the multi-layer OOD scores (service.core.ood) read them
        self.with_layer_features = False

    @property
    def streams(self) -> int:
        """How many streams enter the encoder: M, or 1 into a shared trunk (config ``shared_blocks``)."""
        return 1 if self.encoder.shared_blocks else self.members

    @property
    def layer_features(self) -> bool:
        """Whether forward returns the layer features (:attr:`with_layer_features` and a second layer to pool)."""
        return self.with_features and self.with_layer_features and len(self.encoder.blocks) > 1

    def _readout(self, x: torch.Tensor, head: nn.Module, pooled: list[torch.Tensor] | None = None) -> Outputs:
        """``x (M, B, D)`` penultimate features -> logits ``(B, M, C)`` (and ``x`` as ``(B, M, D)``; and the pooled
        layers ``[(M, B, d)] * (L-1)`` as ``(B, M, L-1, d)``)."""
        logits = head(x).transpose(0, 1)  # (B, M, C)
        if self.with_features:
            if pooled:
                return logits, x.transpose(0, 1), torch.stack(pooled, dim=2).transpose(0, 1)  # (B, M, L-1, d)
            return logits, x.transpose(0, 1)  # (B, M, D)
        return logits

    def _first_token_states(
        self,
        x: torch.Tensor,
        seq_len: int,
        attn_mask: torch.Tensor | None = None,
        pooled: list[torch.Tensor] | None = None,
        pool: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The encoder's last-layer states of each sequence's first token: ``x (M, B*T, d) -> (M, B, d)``
        (``pooled``, ``pool``: see :meth:`FusedEncoder.forward`)."""
        if self.first_token_readout:
            return self.encoder(x, seq_len, attn_mask, first_token_only=True, pooled=pooled, pool=pool)
        return first_tokens(self.encoder(x, seq_len, attn_mask, pooled=pooled, pool=pool), seq_len)


class FusedViT(FusedClassifier):
    """Fused timm ``VisionTransformer``: ``pixel_values (B, C, H, W) -> logits (B, M, C)``.

    Config keys: members, img_size, patch_size, in_chans, dim, head_dim, num_heads
    (per layer, padded), mlp_hidden, num_classes, act, eps, qkv_bias, layer_scale,
    mlp ("shared"|"per_member"), class_token, global_pool ("token"|"avg"),
    norm_pre, final_norm, fc_norm, patch_bias, shared_blocks (the trunk: see :class:`FusedEncoder`).
    """

    ARCH = "vit"  # the config's arch (service.core.registry.ARCHS)

    def __init__(self, cfg: dict[str, Any]) -> None:
        # token pooling reads only the first token: the last layer computes only that token
        super().__init__(cfg, first_token_readout=cfg.get("global_pool", "token") == "token")
        M, d = self.members, self.dim
        p = cfg["patch_size"]
        self.patch_embed = nn.Conv2d(cfg["in_chans"], d, kernel_size=p, stride=p, bias=cfg.get("patch_bias", True))
        gh, gw = cfg["img_size"][0] // p, cfg["img_size"][1] // p
        self.num_prefix = 1 if cfg.get("class_token", True) else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if self.num_prefix else None
        self.pos_embed = nn.Parameter(torch.randn(1, gh * gw + self.num_prefix, d) * 0.02)
        eps = cfg.get("eps", 1e-6)
        self.encoder = FusedEncoder(cfg, norm_first=True)
        # before a shared trunk every member's stream is the same one: one norm
        self.norm_pre = MemberLayerNorm(self.streams, d, eps) if cfg.get("norm_pre", False) else None
        self.norm = MemberLayerNorm(M, d, eps) if cfg.get("final_norm", True) else None
        self.fc_norm = MemberLayerNorm(M, d, eps) if cfg.get("fc_norm", False) else None
        self.global_pool = cfg.get("global_pool", "token")
        self.head = GroupedLinear(M, d, cfg["num_classes"])
        self.num_tokens = gh * gw + self.num_prefix

    def forward(self, pixel_values: torch.Tensor) -> Outputs:
        """``pixel_values (B, C, H, W) -> logits (B, M, C)`` (and features ``(B, M, D)``: ``with_features``)."""
        return _in_sub_batches(self, self._forward, self.num_tokens, pixel_values)

    def _forward(self, pixel_values: torch.Tensor) -> Outputs:
        B = pixel_values.shape[0]
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (B, T0, d)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)  # (B, T, d)
        x = x + self.pos_embed
        T = x.shape[1]
        x = stack_members(x, self.streams)  # (M, B*T, d); (1, B*T, d) into a shared trunk
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        M, d = self.members, self.dim
        pooled: list[torch.Tensor] | None = [] if self.layer_features else None
        pool = (lambda h: h.view(-1, B, T, d).mean(dim=2)) if pooled is not None else None  # (m, B, d): every token
        if self.global_pool == "avg":
            x = self.encoder(x, T, pooled=pooled, pool=pool)  # (M, B*T, d)
            if self.norm is not None:
                x = self.norm(x)
            x = x.view(M, B, T, d)[:, :, self.num_prefix :].mean(dim=2)  # (M, B, d)
        else:
            x = self._first_token_states(x, T, pooled=pooled, pool=pool)  # (M, B, d)
            if self.norm is not None:  # LayerNorm is per token: normalising the first token alone is exact
                x = self.norm(x)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return self._readout(x, self.head, pooled)  # (B, M, C)


class FusedBert(FusedClassifier):
    """Fused BERT-family sequence classifier: ``(input_ids, attention_mask) (B, T) -> logits (B, M, C)``.

    Embeddings are shared by all members (word, position, token type); the
    embedding LayerNorm, every block's LayerNorms, the pooler and the classifier
    are per member. Config keys: members, vocab_size, max_position, type_vocab_size,
    dim, head_dim, num_heads (per layer, padded), mlp_hidden, num_classes, act, eps,
    mlp, pooler (bool), shared_blocks (the trunk: see :class:`FusedEncoder`).
    """

    ARCH = "bert"  # the config's arch (service.core.registry.ARCHS)

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg, first_token_readout=True)  # the readout reads only the [CLS] token
        M, d = self.members, self.dim
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], d)
        self.position_embeddings = nn.Embedding(cfg["max_position"], d)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), d)
        eps = cfg.get("eps", 1e-12)
        self.encoder = FusedEncoder({**cfg, "eps": eps}, norm_first=False)
        self.emb_norm = MemberLayerNorm(self.streams, d, eps)  # one before a shared trunk
        self.pooler = GroupedLinear(M, d, d) if cfg.get("pooler", True) else None
        self.classifier = GroupedLinear(M, d, cfg["num_classes"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Outputs:
        """``input_ids, attention_mask (B, T) -> logits (B, M, C)`` (and features ``(B, M, D)``: ``with_features``)."""
        return _in_sub_batches(self, self._forward, input_ids.shape[1], input_ids, attention_mask)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Outputs:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        S = self.streams  # M, or 1 into a shared trunk
        x = self.emb_norm(stack_members(x, S))  # (S, B*T, d)
        # key padding mask, True = attend: (B, T) -> (S*B, 1, 1, T)
        mask = attention_mask.to(torch.bool).view(1, B, 1, 1, T).expand(S, B, 1, 1, T)
        mask = mask.reshape(S * B, 1, 1, T)
        pooled: list[torch.Tensor] | None = [] if self.layer_features else None
        pool = None
        if pooled is not None:  # the mean over each text's real tokens (padding left out): (m, B*T, d) -> (m, B, d)
            d = self.dim
            w = attention_mask.to(x.dtype)  # (B, T)
            w = (w / w.sum(dim=1, keepdim=True).clamp_min(1.0)).view(1, B, T, 1)  # (1, B, T, 1) weights
            pool = lambda h: (h.view(-1, B, T, d) * w).sum(dim=2)  # noqa: E731
        x = self._first_token_states(x, T, mask, pooled=pooled, pool=pool)  # (M, B, d) the [CLS] token
        if self.pooler is not None:
            x = torch.tanh(self.pooler(x))
        return self._readout(x, self.classifier, pooled)  # (B, M, C)


def tiny_config(family: str, num_classes: int = 4, members: int = 3) -> dict[str, Any]:
    """A tiny runnable config for tests and fixtures (random weights)."""
    if family == "vit":
        inputs: dict[str, Any] = {"img_size": [16, 16], "patch_size": 4, "in_chans": 1}
        eps = 1e-6
    elif family == "bert":
        inputs = {"vocab_size": 30522, "max_position": 64, "type_vocab_size": 2}
        eps = 1e-12
    else:
        raise ValueError(f"unknown family {family!r}")
    return {
        "arch": family,
        "members": members,
        **inputs,
        "dim": 32,
        "head_dim": 8,
        "num_heads": [3, 2],
        "mlp_hidden": 64,
        "num_classes": num_classes,
        "act": "gelu",
        "eps": eps,
    }


def count_params(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())
