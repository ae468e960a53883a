"""Model family adapters: timm ViT, Hugging Face BERT, OpenCLIP."""

from __future__ import annotations

from .base import FamilyAdapter


def get_adapter(family: str) -> FamilyAdapter:
    """The adapter of ``family`` (``vit``, ``bert``)."""
    if family == "vit":
        from .vit import ViTAdapter

        return ViTAdapter()
    if family == "bert":
        from .bert import BertAdapter

        return BertAdapter()
    raise ValueError(f"unknown model family {family!r}; expected 'vit' or 'bert'")


__all__ = ["FamilyAdapter", "get_adapter"]
