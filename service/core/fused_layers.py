"""The member-grouped layers of a fused Hydra model: M members' transformer layers as one set of tensors.

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

Only torch is imported here; :mod:`service.core.fused` and :mod:`service.core.fused_clip` build their models of
these layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BlockLayout",
    "FusedAttention",
    "FusedBlock",
    "FusedEncoder",
    "FusedMLP",
    "GroupedLinear",
    "MemberLayerNorm",
    "QuickGELU",
    "Sequences",
    "first_tokens",
    "shared_blocks_of",
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
            # a graph capture sees no storage; settled by an eager call first (offline.models.export)
            return self._shared
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


def first_tokens(x: torch.Tensor, seq_len: int) -> torch.Tensor:
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
            q = _bmm(first_tokens(x, seq_len), w[..., :A], None if b is None else b[..., :A])  # (M, B, H*hd)
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


@dataclass(frozen=True)
class BlockLayout:
    """What the layers of one fused encoder share; only the head count differs from layer to layer (a pruned layer
    is a smaller instance of the same block)."""

    members: int  # M
    dim: int  # d, the model width
    head_dim: int  # the attention width of a layer is num_heads * head_dim, apart from d
    mlp_hidden: int
    act: str = "gelu"
    norm_first: bool = True  # pre-norm (ViT, CLIP) or post-norm (BERT)
    eps: float = 1e-6  # the LayerNorms'
    qkv_bias: bool = True
    layer_scale: bool = False  # per-channel scales on both residual branches (timm's LayerScale)
    shared_mlp: bool = True  # the MLP's weights as one grouped GEMM for all members

    @classmethod
    def of(cls, cfg: dict[str, Any], norm_first: bool) -> BlockLayout:
        """The layout of a fused config (``members``, ``dim``, ``head_dim``, ``mlp_hidden`` and the optional keys)."""
        return cls(
            members=cfg["members"],
            dim=cfg["dim"],
            head_dim=cfg["head_dim"],
            mlp_hidden=cfg["mlp_hidden"],
            act=cfg.get("act", "gelu"),
            norm_first=norm_first,
            eps=cfg.get("eps", 1e-6),
            qkv_bias=cfg.get("qkv_bias", True),
            layer_scale=cfg.get("layer_scale", False),
            shared_mlp=cfg.get("mlp", "shared") == "shared",
        )


class FusedBlock(nn.Module):
    """One transformer layer for M members; pre-norm (ViT, CLIP) or post-norm (BERT)."""

    def __init__(self, layout: BlockLayout, num_heads: int) -> None:
        super().__init__()
        M, d = layout.members, layout.dim
        self.norm_first = layout.norm_first
        self.norm1 = MemberLayerNorm(M, d, layout.eps)
        self.attn = FusedAttention(M, d, num_heads, layout.head_dim, qkv_bias=layout.qkv_bias)
        self.norm2 = MemberLayerNorm(M, d, layout.eps)
        self.mlp = FusedMLP(M, d, layout.mlp_hidden, layout.act, shared=layout.shared_mlp)
        self.ls1 = nn.Parameter(torch.ones(M, 1, d)) if layout.layer_scale else None
        self.ls2 = nn.Parameter(torch.ones(M, 1, d)) if layout.layer_scale else None

    def forward(self, x: torch.Tensor, seqs: Sequences, first_token_only: bool = False) -> torch.Tensor:
        """``x (M, B*T, d) -> (M, B*T, d)``, the rows forming the sequences ``seqs`` (see :class:`Sequences`).

        With ``first_token_only`` the layer computes only each sequence's first token: ``-> (M, B, d)``.
        """
        res = first_tokens(x, seqs.seq_len) if first_token_only else x  # the rows this layer outputs
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


def shared_blocks_of(cfg: dict[str, Any]) -> int:
    """The config's shared trunk: how many first blocks every member runs as one (``shared_blocks``, absent = 0).

    Raises ValueError unless it lies in ``[0, L)``: the last block is always the members' own."""
    k = cfg.get("shared_blocks", 0)
    L = len(cfg["num_heads"])
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < L:
        raise ValueError(f"shared_blocks must be an integer in [0, {L}) for {L} blocks, got {k!r}")
    return k


class FusedEncoder(nn.Module):
    """A stack of :class:`FusedBlock` built from the config's per-layer head counts.

    With a shared trunk (config ``shared_blocks`` k > 0: the members left blocks ``< k`` whole and untrained, so
    those blocks are the same computation for all of them) the first k blocks hold one member's weights and run
    once, on ``(1, B*T, d)``; the stream is then broadcast to the M members (a view, no copy) for the rest.
    """

    def __init__(self, cfg: dict[str, Any], norm_first: bool) -> None:
        super().__init__()
        self.shared_blocks = shared_blocks_of(cfg)
        self.members: int = cfg["members"]
        layout = BlockLayout.of(cfg, norm_first)
        trunk = BlockLayout.of({**cfg, "members": 1}, norm_first)
        self.blocks = nn.ModuleList(
            FusedBlock(trunk if i < self.shared_blocks else layout, h) for i, h in enumerate(cfg["num_heads"])
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

        With a shared trunk ``x`` is the one stream ``(1, B*T, d)`` (and ``attn_mask`` one member's,
        ``(B, 1, 1, T)``); the output is the M members' all the same.
        ``first_token_only``: the last layer computes only each sequence's first token (all that a
        class-token readout reads; exact, and it skips most of that layer's work): ``-> (M, B, d)``.
        With ``pool`` (``(m, B*T, d) -> (m, B, d)``), ``pool`` of every block's output but the last's is appended
        to ``pooled`` (``(M, B, d)`` each): the intermediate layers' pooled features of the OOD scores.
        """
        k, M = self.shared_blocks, self.members
        seqs = Sequences(seq_len, attn_mask, is_causal)
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            if k and i == k:  # the trunk's output -> M member streams: (1, B*T, d) -> (M, B*T, d), a view
                x = x.expand(M, -1, -1)
                if attn_mask is not None:  # (B, 1, 1, T) -> (M*B, 1, 1, T)
                    mask = attn_mask.unsqueeze(0).expand(M, *attn_mask.shape)
                    seqs = Sequences(seq_len, mask.reshape(M * attn_mask.shape[0], *attn_mask.shape[1:]), is_causal)
            x = blk(x, seqs, first_token_only=first_token_only and i == last)
            if pool is not None and pooled is not None and i < last:
                p = pool(x)  # (m, B, d)
                pooled.append(p.expand(M, -1, -1) if i < k else p)
        return x
