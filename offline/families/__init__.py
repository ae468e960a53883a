"""Model family adapters: timm ViT, Hugging Face BERT, OpenCLIP; the registry is filled at import.


May import: ``service.core`` only; every other room of the builder may import it.
"""

from __future__ import annotations

from offline.families.base import FamilyAdapter
from offline.families.bert import BertAdapter
from offline.families.clip import CLIPAdapter
from offline.families.vit import ViTAdapter

# family name -> adapter class
ADAPTERS: dict[str, type[FamilyAdapter]] = {"vit": ViTAdapter, "bert": BertAdapter, "clip": CLIPAdapter}


def get_adapter(family: str) -> FamilyAdapter:
    """The adapter of ``family`` (a name registered in :data:`ADAPTERS`)."""
    if family not in ADAPTERS:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(map(repr, ADAPTERS))}")
    return ADAPTERS[family]()


__all__ = ["ADAPTERS", "FamilyAdapter", "get_adapter"]
