"""Fuse structurally pruned members into one ``service.core.fused`` model (one forward pass, ``(B, M, C)`` logits)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from offline.families import FamilyAdapter
from service.core.registry import build_model


def fuse(
    adapter: FamilyAdapter, members: Sequence[nn.Module], mlp: str = "shared", shared_blocks: int = 0
) -> tuple[nn.Module, dict]:
    """Build the fused model of ``members`` (pruned copies of one base model).

    ``mlp="shared"`` merges the members' MLPs by averaging (the paper's default);
    ``"per_member"`` keeps each member's MLP. ``shared_blocks`` k > 0: the members' first k blocks (and what comes
    before them) are one trunk, run once (:class:`service.core.fused.FusedEncoder`); the members must hold the same
    weights there, to the bit. Returns the model (eval mode) and its config, which together with
    ``model.state_dict()`` is what an artifact stores.
    """
    if not members:
        raise ValueError("need at least one member to fuse")
    config, state = adapter.to_fused(members, mlp=mlp)
    if shared_blocks:
        config["shared_blocks"] = shared_blocks
    model = build_model(config)
    own = model.state_dict()
    if shared_blocks:
        state = _trunk_state(state, own, len(members))
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"fused state does not match the fused model: missing {missing}, unexpected {unexpected}")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise RuntimeError(f"fused weight {k}: shape {tuple(v.shape)} != model {tuple(own[k].shape)}")
    model.load_state_dict(state)
    return model.eval(), config


def _trunk_state(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor], members: int) -> dict[str, torch.Tensor]:
    """The fused state with the shared trunk's per-member tensors ``(M, ...)`` cut to the one ``(1, ...)`` the trunk
    holds (every tensor the model holds for one stream only); raises ValueError naming the first tensor whose
    members differ (a trunk block was pruned or trained)."""
    out = dict(state)
    for name, t in state.items():
        want = own.get(name)
        if want is None or want.shape == t.shape or want.shape[:1] != (1,) or t.shape[1:] != want.shape[1:]:
            continue
        if t.shape[0] != members:
            continue  # a shape mismatch: reported with the others by the caller
        diff = float((t - t[:1]).abs().max())
        if diff > 0:
            raise ValueError(
                f"shared trunk: the members differ in {name} (by up to {diff:.3g}); the blocks before "
                "hydra.shared_blocks must stay whole and untrained in every member"
            )
        out[name] = t[:1].clone()
    return out
