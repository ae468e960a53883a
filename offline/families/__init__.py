"""Model family adapters: timm ViT, Hugging Face BERT, OpenCLIP; the registry is filled at import, from every module
of this package (a new family is one more file here).


May import: ``service.core`` only; every other room of the builder may import it.
"""

from __future__ import annotations

import importlib
import pkgutil

from offline.families.base import FamilyAdapter
from service.core.families import FAMILIES

# family name -> adapter class: every FamilyAdapter subclass with a row in the modules of this package, imported here
ADAPTERS: dict[str, type[FamilyAdapter]] = {}


def register(adapter: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Add ``adapter`` under its family's name; another adapter of a known family is an error."""
    if ADAPTERS.get(adapter.name, adapter) is not adapter:
        raise ValueError(f"family {adapter.name!r} has an adapter already: {ADAPTERS[adapter.name].__name__}")
    ADAPTERS[adapter.name] = adapter
    return adapter


for _info in pkgutil.iter_modules(__path__):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _value in list(vars(_module).values()):
        if isinstance(_value, type) and issubclass(_value, FamilyAdapter) and "row" in vars(_value):
            register(_value)
# in the family table's order (vit, bert, clip), so that lists and messages read alike everywhere
_ordered = sorted(ADAPTERS.items(), key=lambda kv: list(FAMILIES).index(kv[0]))
ADAPTERS.clear()
ADAPTERS.update(_ordered)


def get_adapter(family: str) -> FamilyAdapter:
    """The adapter of ``family`` (a name registered in :data:`ADAPTERS`)."""
    if family not in ADAPTERS:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(map(repr, ADAPTERS))}")
    return ADAPTERS[family]()


__all__ = ["ADAPTERS", "FamilyAdapter", "get_adapter", "register"]
