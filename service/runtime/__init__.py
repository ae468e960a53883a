"""The runtimes: a loaded artifact as preprocess -> batcher -> backend -> uncertainty -> answer.

:func:`open_runtime` reads and verifies an artifact (manifest, every file's size and
sha256) and returns the runtime of its ``task``, found in :data:`RUNTIMES`, with its
backend chosen (:mod:`service.runtime.plan`) but not loaded; :meth:`Runtime.load` then reads
the weights (:func:`load_runtime` does both).

* :mod:`.base`: the :class:`Runtime` base (batcher, health, the answer as the response models);
* :mod:`.classifier`: ``classification`` (vit images, bert texts) on any backend;
* :mod:`.zeroshot`: ``zero-shot`` (CLIP): images against labels given per request.

A new task is one more module and one more entry in :data:`RUNTIMES`. The app never asks
which class a runtime is: :meth:`Runtime.answers` says which endpoints it serves.
"""

from __future__ import annotations

from pathlib import Path

from service.core.artifact import ArtifactError, load_manifest, verify_files
from service.metrics import Metrics
from service.runtime.classifier import ClassifierRuntime
from service.runtime.interface import ItemResult, Outcome, Query, Runtime, summarize_rows
from service.runtime.zeroshot import CLIPZeroShotRuntime, TextCache, text_cache_counter
from service.settings import Settings

__all__ = [
    "RUNTIMES",
    "CLIPZeroShotRuntime",
    "ClassifierRuntime",
    "ItemResult",
    "Outcome",
    "Query",
    "Runtime",
    "TextCache",
    "load_runtime",
    "open_runtime",
    "summarize_rows",
    "text_cache_counter",
]

# the manifest's task -> the runtime that serves it
RUNTIMES: dict[str, type[Runtime]] = {"classification": ClassifierRuntime, "zero-shot": CLIPZeroShotRuntime}


def open_runtime(root: str | Path, settings: Settings, metrics: Metrics | None = None) -> Runtime:
    """Read and verify the artifact at ``root`` (manifest, every file's size and sha256) and check the settings
    against it, without loading the model (:meth:`Runtime.load`). Raises :class:`ArtifactError` naming the file,
    :class:`~service.core.backends.BackendConfigError` for settings that cannot serve it."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"{root}: artifact directory does not exist (HYDRA_ARTIFACTS)")
    manifest = load_manifest(root)
    verify_files(root, manifest)
    cls = RUNTIMES.get(manifest.task)
    if cls is None:
        raise ArtifactError(f"{root}: task {manifest.task!r} has no runtime in this server (known: {sorted(RUNTIMES)})")
    rt = cls(root, manifest, settings, metrics)
    rt.resolve()
    return rt


def load_runtime(root: str | Path, settings: Settings, metrics: Metrics | None = None) -> Runtime:
    """Read, verify and load the artifact at ``root`` (blocking). Raises :class:`ArtifactError` naming the file."""
    rt = open_runtime(root, settings, metrics)
    rt.load()
    return rt
