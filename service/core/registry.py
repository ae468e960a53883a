"""The fused-model registry: every fused architecture by its config's ``arch``, built or loaded from an artifact.

The offline builder writes a config dict (``arch`` names the class) and a safetensors state dict;
:func:`load_model` rebuilds the model from them. Every module ``service/core/fused*.py`` is imported here at
import, and each ``nn.Module`` class of it that declares ``ARCH`` is registered under that name: a new family's
fused module joins by existing (``fused.py``: ``vit``, ``bert``; ``fused_clip.py``: ``clip``, the dual encoder).
The model modules import only downwards (``fused_clip -> fused -> fused_layers``); this module is the one place that
knows them all. A fused class kept elsewhere (a test's made-up family) joins with :func:`register_arch`.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

import service.core

__all__ = ["ARCHS", "build_model", "load_model", "register_arch"]

ARCHS: dict[str, type[nn.Module]] = {}


def register_arch(cls: type[nn.Module]) -> type[nn.Module]:
    """Register ``cls`` under its ``ARCH``; another class under a known name is an error."""
    arch = vars(cls).get("ARCH")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"{cls.__name__} declares no ARCH name")
    if ARCHS.get(arch, cls) is not cls:
        raise ValueError(f"fused architecture {arch!r} is registered already, as {ARCHS[arch].__name__}")
    ARCHS[arch] = cls
    return cls


def _register_module(module: ModuleType) -> None:
    for value in list(vars(module).values()):
        if isinstance(value, type) and issubclass(value, nn.Module) and "ARCH" in vars(value):
            register_arch(value)


for _info in pkgutil.iter_modules(service.core.__path__):
    if _info.name.startswith("fused"):
        _register_module(importlib.import_module(f"service.core.{_info.name}"))


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
