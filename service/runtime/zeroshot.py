"""The zero-shot runtime (``task: zero-shot``, family ``clip``): images against labels given per request.

The artifact (``offline/pipelines/zeroshot_build.py``) holds a fused :class:`service.core.fused_clip.FusedCLIP`.
Serving:

* text side: the prompts ``template.format(label=...)`` -> text embeddings ``(L, M, D)``, computed once per
  ``(labels, template)`` and kept in a bounded LRU cache (:class:`TextCache`); the manifest's fixed ``labels``
  with ``zero_shot.template`` are embedded at load (they serve ``/predict``);
* image side: images go through the batcher like ``/predict``: one ``(M, D)`` embedding per image;
* per request: member logits ``(B, M, L) = logit_scale * einsum("bmd,lmd->bml") (+ logit_bias)``, then
  :func:`~service.runtime.interface.summarize_rows` (manifest temperature, OOD metric and threshold) and the
  answer over the request's labels, in the request's order.
* the OOD flag: artifacts with label-free statistics (manifest ``ood.label_free``) score each image's
  embeddings (and its image tower's layer features) against the ID images, whatever the request's labels
  (``mahalanobis`` / ``mahalanobis_layers``); older artifacts flag on a probability score of the logits.

Backend: torch eager only (:func:`service.runtime.plan.resolve_plan` with ``eager_only``: fp32 on CPU, bf16
autocast on CUDA or with ``HYDRA_PRECISION=bf16``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from prometheus_client import Counter

from service.core.artifact import DEFAULT_TEMPLATE, ArtifactError, ImagePreprocessing, Manifest
from service.core.errors import InvalidInput
from service.core.fused_clip import FusedCLIP, zero_shot_logits
from service.core.preprocess import ImagePreprocessor, TextPreprocessor
from service.core.registry import load_model
from service.metrics import Metrics
from service.runtime.interface import (
    ItemResult,
    Outcome,
    Query,
    Runtime,
    load_ood_stats,
    preprocess_images,
    summarize_rows,
)
from service.runtime.plan import resolve_plan
from service.settings import Settings

__all__ = ["CLIPZeroShotRuntime", "TextCache", "TEXT_CACHE_SIZE", "text_cache_counter"]

log = logging.getLogger("hydra.zeroshot")

TEXT_CACHE_SIZE = 256  # (labels, template) entries
TEXT_CHUNK = 64  # prompts per text-encoder pass


def text_cache_counter(metrics: Metrics) -> Counter:
    """``hydra_zero_shot_text_cache_total{model, result="hit"|"miss"}``, registered once per :class:`Metrics`."""
    if metrics.zero_shot_text_cache is None:
        metrics.zero_shot_text_cache = Counter(
            "hydra_zero_shot_text_cache",
            "Zero-shot text-embedding cache lookups, by result (hit or miss).",
            ["model", "result"],
            registry=metrics.registry,
        )
    return metrics.zero_shot_text_cache


class TextCache:
    """Bounded LRU of text embeddings ``(L, M, D)`` keyed by ``(labels tuple, template)``; thread-safe."""

    def __init__(self, size: int = TEXT_CACHE_SIZE) -> None:
        self.size = int(size)
        self._data: OrderedDict[tuple[tuple[str, ...], str], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[tuple[str, ...], str]) -> torch.Tensor | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: tuple[tuple[str, ...], str], value: torch.Tensor) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class CLIPZeroShotRuntime(Runtime):
    """A fused CLIP artifact: ``/zero-shot`` with any labels, ``/predict`` (images) with the manifest's labels."""

    pre: ImagePreprocessor  # images only: the labels are text, embedded by the model

    task = "zero-shot"

    def __init__(self, root: Path, manifest: Manifest, settings: Settings, metrics: Metrics | None) -> None:
        super().__init__(root, manifest, settings, metrics)
        prep = manifest.preprocessing
        if manifest.model.config.get("arch") != "clip":
            raise ArtifactError(f"{root}: a zero-shot artifact needs model.config.arch 'clip'")
        if not isinstance(prep, ImagePreprocessing) or prep.text is None:  # refused at load; narrows the type
            raise ArtifactError(f"{root}: a zero-shot artifact needs image preprocessing with a text part")
        try:
            self.pre = ImagePreprocessor(prep, settings.max_image_pixels)
            self.text_pre = TextPreprocessor(prep.text, root)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ArtifactError(f"{root}: bad preprocessing in the manifest: {e}") from e
        self.template: str = manifest.zero_shot.template if manifest.zero_shot is not None else DEFAULT_TEMPLATE
        self.model: FusedCLIP | None = None
        self.cache = TextCache(TEXT_CACHE_SIZE)
        self._fixed: torch.Tensor | None = None  # (C, M, D) text embeddings of the manifest's labels
        self._counter = text_cache_counter(metrics) if metrics is not None else None
        self.ood_stats = load_ood_stats(root, manifest)  # label-free: one Gaussian of the ID images per member
        self._layers = self.ood_stats is not None and self.ood_stats.layers is not None

    @property
    def modality(self) -> str:
        return "image"

    def answers(self, task: str) -> bool:
        """``/zero-shot``, and ``/predict`` too: images against the manifest's fixed labels."""
        return task in ("zero-shot", "classification")

    # -- set-up
    def resolve(self) -> None:
        """Torch eager on ``HYDRA_DEVICE``; fp32 on CPU, bf16 autocast on CUDA (unless ``HYDRA_PRECISION``)."""
        s = self.settings
        self.plan = resolve_plan(
            self.manifest, device=s.device, backend=s.backend, precision=s.precision, eager_only=True
        )

    def load(self) -> None:
        """Read the fused weights and embed the manifest's labels with its template (blocking)."""
        if self.plan is None:
            self.resolve()
        assert self.plan is not None
        spec = self.manifest.model
        try:
            model = load_model(self.root / spec.weights, spec.config, device=self.plan.device)
        except Exception as e:  # weights not matching the config, unreadable file, ...
            raise ArtifactError(f"{self.root}: cannot load the zero-shot model: {e}") from e
        assert isinstance(model, FusedCLIP)
        self.model = model
        if self.labels:
            self._fixed = self.embed_text(self.labels, self.template)
            self.cache.put((tuple(self.labels), self.template), self._fixed)
        log.info("%s: torch on %s, %s (%s)", self.name, self.plan.device, self.plan.precision, self.plan.reason)

    def _autocast(self) -> Any:
        assert self.plan is not None
        on = self.plan.precision == "bf16"
        return torch.autocast(device_type=self.plan.device, dtype=torch.bfloat16, enabled=on)

    def embed_text(self, labels: list[str], template: str) -> torch.Tensor:
        """Prompts ``template.format(label=l)`` -> normalised text embeddings ``(L, M, D)`` fp32 on CPU (blocking)."""
        assert self.model is not None and self.plan is not None
        prompts = [template.format(label=lab) for lab in labels]
        ids = self.text_pre.encode(prompts)
        out = []
        with torch.inference_mode(), self._autocast():
            for i in range(0, len(ids), TEXT_CHUNK):
                batch = self.text_pre.collate(ids[i : i + TEXT_CHUNK])
                emb = self.model.encode_text(
                    batch["input_ids"].to(self.plan.device), batch["attention_mask"].to(self.plan.device)
                )
                out.append(emb.float().cpu())
        return torch.cat(out)

    async def text_embeddings(self, labels: list[str], template: str) -> torch.Tensor:
        """Cached :meth:`embed_text` (a miss runs in a worker thread); counts hits and misses."""
        key = (tuple(labels), template)
        emb = self.cache.get(key)
        if self._counter is not None:
            self._counter.labels(self.name, "miss" if emb is None else "hit").inc()
        if emb is None:
            emb = await anyio.to_thread.run_sync(self.embed_text, list(labels), template)
            self.cache.put(key, emb)
        return emb

    # -- request side
    def prepare(self, raw: Sequence[str | bytes], field: str, *, base64_encoded: bool) -> list[Any]:
        """Decode and preprocess the images of one request -> ``(C, H, W)`` tensors (raises naming the input)."""
        return preprocess_images(self.pre, raw, field, base64_encoded=base64_encoded)

    # -- worker thread: images -> embeddings
    def _run(self, items: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``B`` prepared images -> ``B`` pairs: image embeddings ``(M, D)`` and (label-free ``mahalanobis_layers``)
        layer features ``(M, L-1, d)``, fp32 on CPU."""
        assert self.model is not None and self.plan is not None
        pixels = self.pre.collate(items)["pixel_values"].to(self.plan.device)
        with torch.inference_mode(), self._autocast():
            emb, layers = self.model.image_features(pixels) if self._layers else (self.model.encode_image(pixels), None)
        if emb.dim() != 3 or emb.shape[0] != len(items):
            raise RuntimeError(f"{self.name}: image encoder output {tuple(emb.shape)}, expected (B={len(items)}, M, D)")
        per_layer = layers.float().cpu().unbind(0) if layers is not None else [None] * len(items)
        return list(zip(emb.float().cpu().unbind(0), per_layer, strict=True))

    def _results(self, image: torch.Tensor, text: torch.Tensor, layers: torch.Tensor | None = None) -> list[ItemResult]:
        """Image ``(B, M, D)`` and text ``(L, M, D)`` embeddings (and the images' layer features) -> one
        :class:`ItemResult` per image; with label-free statistics the OOD scores of the image side too."""
        assert self.model is not None
        with torch.inference_mode():
            scale = self.model.logit_scale.detach().float().exp().cpu()
            bias = self.model.logit_bias.detach().float().cpu() if self.model.logit_bias is not None else None
            logits = zero_shot_logits(image, text, scale, bias)  # (B, M, L)
        if self.ood_stats is None:
            return summarize_rows(logits, self.temperature, self.ood_metric, self.ood_threshold)
        return summarize_rows(
            logits, self.temperature, self.ood_metric, self.ood_threshold, image, self.ood_stats, layers
        )

    def sets_hold(self, query: Query) -> bool:
        """The sets and risk rules were calibrated on the build's labels and template: they hold for ``/predict``
        and for ``/zero-shot`` requests with exactly those; the OOD p-value (label-free) holds for any."""
        return query.labels is None or (list(query.labels) == self.labels and query.template == self.template)

    async def _outcome(self, prepared: list[Any], query: Query) -> Outcome:
        """Prepared images against the request's labels (``/zero-shot``: prompts ``template.format(label=...)``),
        or against the manifest's fixed labels when the query has none (``/predict``)."""
        if query.labels is None:
            if self._fixed is None:
                raise InvalidInput(f"model: {self.name!r} has no fixed labels; send the images to /zero-shot")
            labels, text = self.labels, self._fixed
        else:
            labels, text = list(query.labels), await self.text_embeddings(query.labels, query.template)
        res = await self.batcher.submit(prepared)
        image = torch.stack([e for e, _ in res.results])  # (B, M, D)
        layers = torch.stack([lay for _, lay in res.results]) if self._layers else None  # (B, M, L-1, d)
        return Outcome(self._results(image, text, layers), labels, res)

    async def warmup(self) -> None:
        """One image through preprocess, batcher, image encoder and uncertainty (fixed labels embedded at load)."""
        prepared = self.prepare([self.pre.example()], "warmup", base64_encoded=False)
        # without fixed labels: two placeholder labels, which also warms the text encoder
        labels = None if self._fixed is not None else ["a", "b"]
        query = Query(top_k=1, return_members=True, labels=labels, template=self.template, monitor=False)
        await self.outcome(prepared, query)
        self.ready = True

    async def probe(self) -> None:
        """The warm-up image through the batcher and image encoder, not counted as a prediction."""
        await self.batcher.submit(self.prepare([self.pre.example()], "probe", base64_encoded=False))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        zs = self.manifest.zero_shot
        d["zero_shot"] = {
            "template": self.template,
            "embed_dim": zs.embed_dim if zs is not None else None,
            "text_cache_size": self.cache.size,
        }
        return d
