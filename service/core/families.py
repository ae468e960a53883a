"""The model families as the artifact and the server know them: one table, :data:`FAMILIES`, that every family list
and every family check of the manifest and the builder's config is derived from.

Each row says what a family is to the code outside its own files: its name (the manifest's ``family``), its task
(``classification`` or ``zero-shot``: which pipeline builds it and which runtime serves it), the modality of its
inputs (what data a build may give it), the ``arch`` its fused model's config carries (what
:mod:`service.core.registry` builds) and what it supports (a shared trunk, the efficient-ensemble baselines).

A family is three files: its adapter (``offline/families/<name>.py``, which points at its row here), its fused
module (``service/core/fused_<name>.py``, whose class carries the ``ARCH`` this row names) and its tests. The
built-in rows are below; a family kept outside this module registers its row with :func:`register_family` from its
fused module, which :mod:`service.core.registry` imports at start-up (``tests/offline/test_families.py`` builds and
serves such a made-up family).

Imports only the standard library: the manifest (pydantic, no torch) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "MODALITIES", "TASKS", "Family", "family", "register_family"]

TASKS = ("classification", "zero-shot")
MODALITIES = ("image", "text")


@dataclass(frozen=True)
class Family:
    """One model family, as the artifact, the config checks and the server need it."""

    name: str
    task: str  # one of TASKS
    modality: str  # one of MODALITIES: the inputs its builds take (a zero-shot family: its images)
    arch: str  # the fused model config's "arch" (service.core.registry.ARCHS)
    shared_trunk: bool = True  # hydra.shared_blocks > 0 is supported
    baselines: bool = True  # the efficient-ensemble baselines (base.baselines) are built for it

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"family {self.name!r}: task must be one of {TASKS}, got {self.task!r}")
        if self.modality not in MODALITIES:
            raise ValueError(f"family {self.name!r}: modality must be one of {MODALITIES}, got {self.modality!r}")


FAMILIES: dict[str, Family] = {}


def register_family(row: Family) -> Family:
    """Add ``row`` to :data:`FAMILIES` and return it; the same row again is a no-op, another row of a known name an
    error."""
    known = FAMILIES.get(row.name)
    if known is not None and known != row:
        raise ValueError(f"family {row.name!r} is registered already, as {known}")
    FAMILIES[row.name] = row
    return row


def family(name: str) -> Family:
    """The row of ``name``; a ``ValueError`` listing the known families otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


VIT = register_family(Family("vit", task="classification", modality="image", arch="vit"))
BERT = register_family(Family("bert", task="classification", modality="text", arch="bert"))
CLIP = register_family(
    Family("clip", task="zero-shot", modality="image", arch="clip", shared_trunk=False, baselines=False)
)
