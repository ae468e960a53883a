"""Self-attention with any number of heads: a drop-in for ``nn.MultiheadAttention`` that a pruned layer can hold.

``nn.MultiheadAttention`` cannot hold fewer heads than ``embed_dim / head_dim``; a structurally pruned OpenCLIP
layer is :class:`SlicedMultiheadAttention` with the kept heads' rows (:meth:`SlicedMultiheadAttention.from_attention`),
the same parameter names and call signature, run by ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SlicedMultiheadAttention(nn.Module):
    """Self-attention with any number of heads of width ``head_dim``; a drop-in for ``nn.MultiheadAttention``.

    Same parameter names as ``nn.MultiheadAttention`` (``in_proj_weight (3*H*hd, d)`` with rows
    ``[Wq; Wk; Wv]``, ``in_proj_bias``, ``out_proj``) and the same call as open_clip makes:
    ``attn(q, k, v, need_weights=False, attn_mask=mask) -> (out, None)``. With no head left the
    output is the output-projection bias.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, head_dim: int, bias: bool = True, batch_first: bool = True
    ) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.batch_first = batch_first
        attn_dim = num_heads * head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(3 * attn_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * attn_dim)) if bias else None
        self.out_proj = nn.Linear(attn_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    @classmethod
    def from_attention(cls, attn: nn.Module, keep: Sequence[int]) -> SlicedMultiheadAttention:
        """Keep heads ``keep`` (indices into ``attn``'s heads) of an ``nn.MultiheadAttention`` or sliced one."""
        hd, H, d = attn.head_dim, attn.num_heads, attn.embed_dim
        rows = torch.tensor([h * hd + c for h in keep for c in range(hd)], dtype=torch.long)
        qkv_rows = torch.cat([rows + s * H * hd for s in range(3)])  # rows of [Wq; Wk; Wv] to keep
        new = cls(d, len(keep), hd, bias=attn.in_proj_bias is not None, batch_first=attn.batch_first)
        new = new.to(attn.in_proj_weight)
        with torch.no_grad():
            new.in_proj_weight.copy_(attn.in_proj_weight[qkv_rows])
            if attn.in_proj_bias is not None:
                new.in_proj_bias.copy_(attn.in_proj_bias[qkv_rows])
            new.out_proj.weight.copy_(attn.out_proj.weight[:, rows])
            new.out_proj.bias.copy_(attn.out_proj.bias)
        return new

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Self-attention of ``query`` ``(B, T, d)`` (``(T, B, d)`` unless batch_first); key/value must be it too.

        ``attn_mask``: ``(T, T)`` additive float mask or bool mask (True = not allowed), as in
        ``nn.MultiheadAttention``; ``key_padding_mask``: bool ``(B, T)``, True = padding.
        """
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("SlicedMultiheadAttention only does self-attention (key and value must be the query)")
        x = query if self.batch_first else query.transpose(0, 1)  # (B, T, d)
        B, T, _ = x.shape
        if self.num_heads == 0:  # every head pruned: only the projection bias is left
            out = self.out_proj(x.new_zeros(B, T, 0))
        else:
            qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, T, 3*H*hd)
            q, k, v = qkv.view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            # q, k, v: (B, H, T, hd)
            mask = _sdpa_mask(attn_mask, key_padding_mask, x.dtype)
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, hd)
            out = self.out_proj(z.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        return (out if self.batch_first else out.transpose(0, 1)), None


def _sdpa_mask(
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """``nn.MultiheadAttention`` masks (bool True = blocked, or additive float) -> one additive SDPA mask."""
    mask = None
    if attn_mask is not None:
        if attn_mask.dim() != 2:
            raise ValueError(f"only a (T, T) attn_mask is supported, got shape {tuple(attn_mask.shape)}")
        if attn_mask.dtype == torch.bool:  # True = not allowed
            mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
                attn_mask, float("-inf")
            )
        else:
            mask = attn_mask.to(dtype)
    if key_padding_mask is not None:
        kp = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
        kp = kp.masked_fill(key_padding_mask.bool(), float("-inf"))[:, None, None, :]  # (B, 1, 1, T)
        mask = kp if mask is None else mask + kp
    return mask
