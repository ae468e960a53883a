"""Fuse structurally pruned members into one ``service.core.fused`` model (one forward pass, ``(B, M, C)`` logits)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from service.core.registry import build_model

from .families import FamilyAdapter


def fuse(adapter: FamilyAdapter, members: Sequence[nn.Module], mlp: str = "shared") -> tuple[nn.Module, dict]:
    """Build the fused model of ``members`` (pruned copies of one base model).

    ``mlp="shared"`` merges the members' MLPs by averaging (the paper's default);
    ``"per_member"`` keeps each member's MLP. Returns the model (eval mode) and its
    config, which together with ``model.state_dict()`` is what an artifact stores.
    """
    if not members:
        raise ValueError("need at least one member to fuse")
    config, state = adapter.to_fused(members, mlp=mlp)
    model = build_model(config)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"fused state does not match the fused model: missing {missing}, unexpected {unexpected}")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise RuntimeError(f"fused weight {k}: shape {tuple(v.shape)} != model {tuple(own[k].shape)}")
    model.load_state_dict(state)
    return model.eval(), config
