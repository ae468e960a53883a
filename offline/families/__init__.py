"""Model family adapters: timm ViT, Hugging Face BERT, OpenCLIP."""

from __future__ import annotations

from .base import FamilyAdapter


def get_adapter(family: str) -> FamilyAdapter:
    """The adapter of ``family`` (``vit``, ``bert``, ``clip``)."""
    if family == "vit":
        from .vit import ViTAdapter

        return ViTAdapter()
    if family == "bert":
        from .bert import BertAdapter

        return BertAdapter()
    if family == "clip":
        from .clip import CLIPAdapter

        return CLIPAdapter()
    raise ValueError(f"unknown model family {family!r}; expected 'vit', 'bert' or 'clip'")


__all__ = ["FamilyAdapter", "get_adapter"]
