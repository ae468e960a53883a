"""Fused Hydra ensemble: M pruned transformer members run as one model.

This is the runtime half of the project: the offline builder (``offline/fusion.py``)
writes a config dict plus a safetensors state dict, and the server rebuilds the
model from them with :func:`service.core.registry.load_model`. Only torch is imported here.

Layout (see ``benchmarks/bench_fusion.py`` and its results): the residual
streams of the M members are one tensor ``(M, B*T, d)`` (members, batch ×
tokens, width). Per-member q/k/v and output projections are grouped linears
computed with one ``torch.baddbmm`` over members, the output projection
accumulating straight into the residual stream; the attention kernel sees
``M*B`` independent sequences as ``(M*B, H, T, hd)`` views of the q/k/v tensor
(no copies). The MLP, shared by all members (the paper's averaged MLP), is one
GEMM over all M·B·T rows, its activation applied in place and its second GEMM
accumulating into the residual stream. LayerNorms whose affine is the same for
every member (members pruned from one base model) run as one ``layer_norm``.
Few, large operations matter on a small shared CPU: every operation is a
parallel region whose threads must meet, and a per-member loop of 2-D GEMMs
was slower than one ``baddbmm`` as soon as other processes competed for the
cores. With a first-token readout (ViT class token, BERT [CLS]) the last layer
computes only that token (exact: nothing else is read). Members may keep
different numbers of heads in a layer: each layer is padded to the largest
member's head count with zero heads (zero q/k/v rows and zero
output-projection columns), which contribute exactly nothing, so the fusion
stays exact.

Parameter layout (what ``offline.families.base.fused_block_state`` writes):
``GroupedLinear.weight (M, in, out)``, ``bias (M, 1, out)``;
``MemberLayerNorm.weight/bias (M, 1, d)``; the shared MLP is two ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GroupedLinear",
    "MemberLayerNorm",
    "Sequences",
    "FusedAttention",
    "FusedMLP",
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
]


class QuickGELU(nn.Module):
    """x · sigmoid(1.702 x), as in OpenAI CLIP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _quick_gelu_(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(torch.sigmoid(1.702 * x))


# Activations of the MLP's hidden tensor, the largest activation in the model ((M*B*T, 4d)),
# out of place and in place: in place saves allocating (and page-faulting) a second one.
_ACTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "gelu": (F.gelu, torch._C._nn.gelu_),  # type: ignore[attr-defined]  # in torch, not in its stubs
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda x: torch._C._nn.gelu_(x, approximate="tanh")),  # type: ignore[attr-defined]
    "quick_gelu": (lambda x: x * torch.sigmoid(1.702 * x), _quick_gelu_),
    "relu": (torch.relu, torch.relu_),
}


def _activate(name: str, x: torch.Tensor) -> torch.Tensor:
    """Activation ``name`` of a fresh intermediate ``x``, in place unless autograd needs ``x``."""
    out_of_place, in_place = _ACTS[name]
    return out_of_place(x) if x.requires_grad else in_place(x)


def _residual_fusable(x: torch.Tensor) -> bool:
    """Whether a GEMM may accumulate into the residual stream: not under autocast, which would make it bf16."""
    return not torch.is_autocast_enabled(x.device.type)


def _bmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x (M, N, in) @ w (M, in, out) + b (M, 1, out)``, one batched GEMM."""
    return torch.bmm(x, w) if b is None else torch.baddbmm(b, x, w)


class GroupedLinear(nn.Module):
    """M independent linears applied to M streams: ``(M, N, in) -> (M, N, out)``.

    Weight is stored as ``(M, in, out)`` (transposed w.r.t. ``nn.Linear``) and bias
    as ``(M, 1, out)``, so the forward is a single ``baddbmm`` with no copies.
    """

    def __init__(self, members: int, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(members, 1, out_features)) if bias else None
        nn.init.normal_(self.weight, std=in_features**-0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x (M, N, in) -> (M, N, out)``, plus ``residual (M, N, out)`` when given."""
        if residual is not None and _residual_fusable(x):
            if self.bias is None:
                return torch.baddbmm(residual, x, self.weight)
            # residual + bias is a fresh tensor: the GEMM accumulates into it in place (no extra pass)
            return (residual + self.bias).baddbmm_(x, self.weight)
        y = _bmm(x, self.weight, self.bias)
        return y if residual is None else residual + y


class MemberLayerNorm(nn.Module):
    """LayerNorm whose affine parameters may differ per member: ``(M, N, d) -> (M, N, d)``.

    Parameters are ``(M, 1, d)``. When every member holds the same affine (members
    pruned from one base model and not fine-tuned), the forward is a single
    ``layer_norm`` with that affine; otherwise the normalised tensor is scaled per
    member (one more pass). Which case holds is re-checked only when the
    parameters change (their version counters or storage).
    """

    def __init__(self, members: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(members, 1, dim))
        self.bias = nn.Parameter(torch.zeros(members, 1, dim))
        self._shared_key: tuple[int, ...] | None = None
        self._shared = True

    def shared(self) -> bool:
        """True when all members' affine parameters are equal (cached on the parameters' versions)."""
        w, b = self.weight, self.bias
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return self._shared  # a graph capture sees no storage; settled by an eager call first (offline.export)
        key = (w._version, b._version, w.data_ptr(), b.data_ptr())
        if key != self._shared_key:
            with torch.no_grad():
                self._shared = all(torch.equal(w[0], w[i]) and torch.equal(b[0], b[i]) for i in range(1, len(w)))
            self._shared_key = key
        return self._shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (M, N, d)
        if self.shared():
            return F.layer_norm(x, (self.dim,), self.weight[0, 0], self.bias[0, 0], self.eps)
        return torch.addcmul(self.bias, F.layer_norm(x, (self.dim,), eps=self.eps), self.weight)


def _first_tokens(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(M, B*T, d) -> (M, B, d): the first token of every sequence (a view)."""
    M, N, d = x.shape
    return x.reshape(M, N // seq_len, seq_len, d)[:, :, 0]


class Sequences(NamedTuple):
    """How the rows of member streams ``(M, B*T, d)`` form sequences, and which tokens each token attends to.

    ``seq_len``: T. ``attn_mask``: None or bool broadcastable to ``(M*B, H, T, T)``, True = attend.
    ``is_causal``: each token attends to itself and the tokens before it only.
    """

    seq_len: int
    attn_mask: torch.Tensor | None = None
    is_causal: bool = False


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
            self.qkv: GroupedLinear | None = GroupedLinear(members, dim, 3 * self.attn_dim, bias=qkv_bias)
            self.proj: GroupedLinear | None = GroupedLinear(members, self.attn_dim, dim, bias=proj_bias)
        else:  # every member pruned every head of this layer: only the projection bias is left
            self.qkv = None
            self.proj = None
            self.proj_bias = nn.Parameter(torch.zeros(members, 1, dim))

    def forward(
        self, x: torch.Tensor, seqs: Sequences, residual: torch.Tensor | None = None, first_token_only: bool = False
    ) -> torch.Tensor:
        """``x (M, B*T, d) -> (M, B*T, d)``, plus ``residual`` when given; ``seqs``: its sequences and mask.

        With ``first_token_only`` only each sequence's first token is queried (keys and values
        still cover every token): the output and ``residual`` are ``(M, B, d)``.
        """
        M, N, d = x.shape
        seq_len, attn_mask, is_causal = seqs
        if self.qkv is None:
            out = self.proj_bias.expand(M, N // seq_len if first_token_only else N, d)
            return out if residual is None else residual + self.proj_bias
        H, hd, A = self.num_heads, self.head_dim, self.attn_dim
        w, b = self.qkv.weight, self.qkv.bias  # (M, d, 3*H*hd): columns q | k | v, head-major within each
        if first_token_only:
            q = _bmm(_first_tokens(x, seq_len), w[..., :A], None if b is None else b[..., :A])  # (M, B, H*hd)
            q = q.view(-1, 1, H, hd).transpose(1, 2)  # (M*B, H, 1, hd)
            kv = _bmm(x, w[..., A:], None if b is None else b[..., A:])  # (M, B*T, 2*H*hd)
            k, v = kv.view(-1, seq_len, 2, H, hd).permute(2, 0, 3, 1, 4).unbind(0)  # (M*B, H, T, hd) each
        else:
            qkv = _bmm(x, w, b)  # (M, B*T, 3*H*hd)
            q, k, v = qkv.view(-1, seq_len, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)  # (M*B, H, T, hd) each
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)  # (M*B, H, T|1, hd)
        z = z.transpose(1, 2).reshape(M, -1, A)  # (M, B*T or B, H*hd)
        assert self.proj is not None  # set with qkv
        return self.proj(z, residual)


class FusedMLP(nn.Module):
    """Two-layer MLP, shared by all members (``shared=True``, the paper's merged MLP) or per member."""

    def __init__(self, members: int, dim: int, hidden: int, act: str, shared: bool = True) -> None:
        super().__init__()
        self.shared = shared
        if shared:
            self.fc1: nn.Module = nn.Linear(dim, hidden)
            self.fc2: nn.Module = nn.Linear(hidden, dim)
        else:
            self.fc1 = GroupedLinear(members, dim, hidden)
            self.fc2 = GroupedLinear(members, hidden, dim)
        if act not in _ACTS:
            raise ValueError(f"unknown activation {act!r}; expected one of {sorted(_ACTS)}")
        self.act = act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x (M, N, d) -> (M, N, d)``, plus ``residual (M, N, d)`` when given."""
        if not self.shared:
            return self.fc2(_activate(self.act, self.fc1(x)), residual)
        fc1, fc2 = cast(nn.Linear, self.fc1), cast(nn.Linear, self.fc2)
        M, N, d = x.shape
        # one GEMM over every member's rows: (M*N, d) -> (M*N, hidden)
        h = _activate(self.act, F.linear(x.reshape(M * N, d), fc1.weight, fc1.bias))
        if residual is not None and _residual_fusable(x):
            # (residual + bias) is a fresh tensor: the GEMM accumulates h @ W2^T into it in place
            out = (residual.reshape(M * N, d) + fc2.bias).addmm_(h, fc2.weight.t())
        else:
            out = F.linear(h, fc2.weight, fc2.bias)
            if residual is not None:
                out = residual.reshape(M * N, d) + out
        return out.view(M, N, d)


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

    def forward(self, x: torch.Tensor, seqs: Sequences, first_token_only: bool = False) -> torch.Tensor:
        """``x (M, B*T, d) -> (M, B*T, d)``, the rows forming the sequences ``seqs`` (see :class:`Sequences`).

        With ``first_token_only`` the layer computes only each sequence's first token: ``-> (M, B, d)``.
        """
        res = _first_tokens(x, seqs.seq_len) if first_token_only else x  # the rows this layer outputs
        if not self.norm_first:  # post-norm (BERT): norm1(x + attn(x)), then norm2(x + mlp(x))
            x = self.norm1(self.attn(x, seqs, residual=res, first_token_only=first_token_only))
            return self.norm2(self.mlp(x, residual=x))
        h = self.norm1(x)
        if self.ls1 is None:  # x + attn(norm1(x)), the residual added by the output projection's GEMM
            x = self.attn(h, seqs, residual=res, first_token_only=first_token_only)
        else:
            a = self.attn(h, seqs, first_token_only=first_token_only)
            x = torch.addcmul(res, a, self.ls1)
        if self.ls2 is None:
            return self.mlp(self.norm2(x), residual=x)
        return torch.addcmul(x, self.mlp(self.norm2(x)), self.ls2)


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
        self,
        x: torch.Tensor,
        seq_len: int,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        first_token_only: bool = False,
        pooled: list[torch.Tensor] | None = None,
        pool: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``x (M, B*T, d) -> (M, B*T, d)``: sequences of ``seq_len`` tokens, masked as in :class:`Sequences`.

        ``first_token_only``: the last layer computes only each sequence's first token (all that a
        class-token readout reads; exact, and it skips most of that layer's work): ``-> (M, B, d)``.
        With ``pool`` (``(M, B*T, d) -> (M, B, d)``), ``pool`` of every block's output but the last's is appended
        to ``pooled``: the intermediate layers' pooled features of the OOD scores.
        """
        seqs = Sequences(seq_len, attn_mask, is_causal)
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            x = blk(x, seqs, first_token_only=first_token_only and i == last)
            if pool is not None and pooled is not None and i < last:
                pooled.append(pool(x))
        return x


# Most rows (members x sequences x tokens) one CPU forward pass works on; larger batches run as
# sub-batches, one after another. On a CPU with native bf16 (AMX) a batch-32 pass over 3 x 32 x 128
# rows made the fused model *slower* than the deep ensemble (its 12,288-row activations leave the
# cache; each member's 4,096 rows do not), while sub-batches of at most 4,096 rows made it 0.79 of it
# (benchmarks/README.md, "A CPU with native bf16"). Exact: the sequences of a batch never interact.
CPU_MAX_ROWS = 4096


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
    return max(1, min(batch, max_rows // (members * tokens)))


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
        self.cpu_max_rows = CPU_MAX_ROWS  # eager CPU passes split larger batches (see CPU_MAX_ROWS)
        # True: forward returns (logits, features), the members' penultimate features (the input of each member's
        # classifier head, ``(B, M, D)``) for the feature-space OOD scores (service.core.ood); set before tracing
        self.with_features = False
        # True (with ``with_features``, and a model of 2 or more layers): a third output, the layer features
        # ``(B, M, L-1, d)``: every block's output but the last's, pooled over each sequence's tokens (the mean;
        # text: over its real tokens), per member. Low-level shifts (noise, blank frames) show in the early layers
        # long before they reach the last feature; the multi-layer OOD scores (service.core.ood) read them
        self.with_layer_features = False

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
        return _first_tokens(self.encoder(x, seq_len, attn_mask, pooled=pooled, pool=pool), seq_len)


class FusedViT(FusedClassifier):
    """Fused timm ``VisionTransformer``: ``pixel_values (B, C, H, W) -> logits (B, M, C)``.

    Config keys: members, img_size, patch_size, in_chans, dim, head_dim, num_heads
    (per layer, padded), mlp_hidden, num_classes, act, eps, qkv_bias, layer_scale,
    mlp ("shared"|"per_member"), class_token, global_pool ("token"|"avg"),
    norm_pre, final_norm, fc_norm, patch_bias.
    """

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
        self.norm_pre = MemberLayerNorm(M, d, eps) if cfg.get("norm_pre", False) else None
        self.encoder = FusedEncoder(cfg, norm_first=True)
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
        x = stack_members(x, self.members)  # (M, B*T, d)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        M, d = self.members, self.dim
        pooled: list[torch.Tensor] | None = [] if self.layer_features else None
        pool = (lambda h: h.view(M, B, T, d).mean(dim=2)) if pooled is not None else None  # (M, B, d): every token
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
    mlp, pooler (bool).
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg, first_token_readout=True)  # the readout reads only the [CLS] token
        M, d = self.members, self.dim
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], d)
        self.position_embeddings = nn.Embedding(cfg["max_position"], d)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), d)
        eps = cfg.get("eps", 1e-12)
        self.emb_norm = MemberLayerNorm(M, d, eps)
        self.encoder = FusedEncoder({**cfg, "eps": eps}, norm_first=False)
        self.pooler = GroupedLinear(M, d, d) if cfg.get("pooler", True) else None
        self.classifier = GroupedLinear(M, d, cfg["num_classes"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Outputs:
        """``input_ids, attention_mask (B, T) -> logits (B, M, C)`` (and features ``(B, M, D)``: ``with_features``)."""
        return _in_sub_batches(self, self._forward, input_ids.shape[1], input_ids, attention_mask)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Outputs:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.emb_norm(stack_members(x, self.members))  # (M, B*T, d)
        # key padding mask, True = attend: (B, T) -> (M*B, 1, 1, T)
        mask = attention_mask.to(torch.bool).view(1, B, 1, 1, T).expand(self.members, B, 1, 1, T)
        mask = mask.reshape(self.members * B, 1, 1, T)
        pooled: list[torch.Tensor] | None = [] if self.layer_features else None
        pool = None
        if pooled is not None:  # the mean over each text's real tokens (padding left out): (M, B*T, d) -> (M, B, d)
            M, d = self.members, self.dim
            w = attention_mask.to(x.dtype)  # (B, T)
            w = (w / w.sum(dim=1, keepdim=True).clamp_min(1.0)).view(1, B, T, 1)  # (1, B, T, 1) weights
            pool = lambda h: (h.view(M, B, T, d) * w).sum(dim=2)  # noqa: E731
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
