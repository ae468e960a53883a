"""The fused-model registry: every fused architecture by its config's ``arch``, built or loaded from an artifact.

The offline builder writes a config dict (``arch`` names the class) and a safetensors state dict;
:func:`load_model` rebuilds the model from them. The architectures live in :mod:`service.core.fused`
(``vit``, ``bert``) and :mod:`service.core.fused_clip` (``clip``, the dual encoder, built from the layers of
:mod:`service.core.fused`); this module is the one place that knows them all, so the model modules import
only downwards (``fused_clip -> fused``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from service.core.fused import FusedBert, FusedViT
from service.core.fused_clip import FusedCLIP

__all__ = ["ARCHS", "build_model", "load_model"]

ARCHS: dict[str, type[nn.Module]] = {"vit": FusedViT, "bert": FusedBert, "clip": FusedCLIP}


def build_model(config: dict[str, Any]) -> nn.Module:
    """Instantiate a fused model (random init) from its config; ``config["arch"]`` picks the class."""
    arch = config.get("arch")
    if arch not in ARCHS:
        raise ValueError(f"unknown fused architecture {arch!r}; known: {sorted(ARCHS)}")
    return ARCHS[arch](config)


def load_model(weights: str | Path, config: dict[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    """Build the fused model from ``config`` and load its safetensors weights (strict); eval mode."""
    model = build_model(config)
    state = load_file(str(weights), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"weights {weights} do not match the fused config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.to(device).eval()
