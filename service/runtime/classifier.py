"""The classifier runtime (``task: classification``): images (vit) or texts (bert) over the artifact's labels.

The backend (torch eager, TorchScript or ONNX Runtime; :func:`service.runtime.plan.resolve_plan`
picks it with the device and precision) maps a collated batch to member logits
``(B, M, C)``; :func:`~service.runtime.interface.summarize_rows` turns them into the
uncertainty of each input (an :class:`~service.runtime.interface.Outcome`; the API builds the answer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from service.core.artifact import ArtifactError, Manifest
from service.core.backends import Backend, BackendConfigError
from service.core.preprocess import ImagePreprocessor, TextPreprocessor, make_preprocessor
from service.metrics import Metrics
from service.runtime.interface import (
    ItemResult,
    Outcome,
    Query,
    Runtime,
    fill_scores,
    load_ood_stats,
    preprocess_images,
    summarize_rows,
)
from service.runtime.plan import Plan, load_backend, resolve_plan
from service.settings import Settings

__all__ = ["ClassifierRuntime"]

log = logging.getLogger("hydra.runtime")


class ClassifierRuntime(Runtime):
    """``task: classification``: images (vit) or texts (bert) -> member logits ``(B, M, C)`` over ``labels``."""

    task = "classification"

    def __init__(self, root: Path, manifest: Manifest, settings: Settings, metrics: Metrics | None) -> None:
        super().__init__(root, manifest, settings, metrics)
        prep = manifest.preprocessing
        try:
            self.pre: ImagePreprocessor | TextPreprocessor = make_preprocessor(prep, root, settings.max_image_pixels)
        except (ValueError, KeyError, OSError) as e:
            raise ArtifactError(f"{root}: bad preprocessing in the manifest: {e}") from e
        cfg = manifest.model.config  # the fused architecture (free form: service.core.registry reads it)
        if isinstance(self.pre, TextPreprocessor) and self.pre.max_length > int(cfg.get("max_position", 1 << 30)):
            raise ArtifactError(
                f"{root}: preprocessing.max_length {self.pre.max_length} exceeds the model's "
                f"max_position {cfg['max_position']}"
            )
        if int(cfg.get("num_classes", len(self.labels))) != len(self.labels):
            raise ArtifactError(f"{root}: {len(self.labels)} labels but the model has {cfg['num_classes']} classes")
        self.ood_stats = load_ood_stats(root, manifest)
        self.backend: Backend | None = None

    @property
    def modality(self) -> str:
        return self.pre.modality

    def resolve(self) -> None:
        """Choose backend, device and precision (:func:`resolve_plan`); raises :class:`BackendConfigError`."""
        s = self.settings
        self.plan = resolve_plan(self.manifest, device=s.device, backend=s.backend, precision=s.precision)

    def load(self) -> None:
        """Build the backend (blocking: reads weights / exports)."""
        s = self.settings
        if self.plan is None:
            self.resolve()
        assert self.plan is not None
        try:
            self.backend = load_backend(self.root, self.manifest, self.plan, threads=s.threads)
        except BackendConfigError:
            raise
        except Exception as e:  # unreadable export, weights not matching the config, ...
            raise ArtifactError(f"{self.root}: cannot load the model for the {self.plan.backend} backend: {e}") from e
        if self.backend.device != self.plan.device:  # e.g. ONNX Runtime without its CUDA provider
            self.plan = Plan(self.plan.backend, self.backend.device, self.plan.precision, self.plan.reason)
        log.info(
            "%s: %s on %s, %s (%s)",
            self.name,
            self.plan.backend,
            self.plan.device,
            self.plan.precision,
            self.plan.reason,
        )

    # -- request side (event loop or a request thread): one bad input fails only its request
    def prepare(self, raw: Sequence[str | bytes], field: str, *, base64_encoded: bool) -> list[Any]:
        """Images -> ``(C, H, W)`` tensors; texts -> token ids (raises naming the input)."""
        if isinstance(self.pre, ImagePreprocessor):
            return preprocess_images(self.pre, raw, field, base64_encoded=base64_encoded)
        return self.pre.encode(cast(list[str], list(raw)))  # a text model is sent texts

    # -- worker thread
    def _run(self, items: list[Any]) -> list[ItemResult]:
        assert self.backend is not None
        outs = self.backend.outputs(self.pre.collate(items))
        logits = outs[0]  # (B, M, C)
        if logits.dim() != 3 or logits.shape[0] != len(items) or logits.shape[2] != len(self.labels):
            raise RuntimeError(
                f"{self.name}: model output {tuple(logits.shape)}, expected (B={len(items)}, M, C={len(self.labels)})"
            )
        features = outs[1] if len(outs) > 1 else None  # (B, M, D)
        layers = outs[2] if len(outs) > 2 else None  # (B, M, L-1, d)
        return summarize_rows(
            logits, self.temperature, self.ood_metric, self.ood_threshold, features, self.ood_stats, layers, False
        )

    async def _outcome(self, prepared: list[Any], query: Query) -> Outcome:
        """Prepared inputs of one request -> its results over the artifact's labels."""
        res = await self.batcher.submit(prepared)
        if query.return_scores:  # the batch computed the served score only
            fill_scores(res.results, self.ood_stats, self.temperature)
        return Outcome(res.results, self.labels, res)

    async def warmup(self) -> None:
        prepared = self.prepare([self.pre.example()], "warmup", base64_encoded=False)
        query = Query(top_k=1, return_members=True, monitor=False)  # not traffic: kept out of the drift test
        await self.outcome(prepared, query)
        self.ready = True

    async def probe(self) -> None:
        """The warm-up input through the batcher and backend, not counted as a prediction."""
        await self.batcher.submit(self.prepare([self.pre.example()], "probe", base64_encoded=False))
