"""The zero-shot runtime (``task: zero-shot``, family ``clip``): images against labels given per request.

The artifact (``offline/pipeline_clip.py``) holds a fused :class:`service.fused_clip.FusedCLIP`. Serving:

* text side: the prompts ``template.format(label=...)`` -> text embeddings ``(L, M, D)``, computed once per
  ``(labels, template)`` and kept in a bounded LRU cache (:class:`TextCache`); the manifest's fixed ``labels``
  with ``zero_shot.template`` are embedded at load (they serve ``/predict``);
* image side: images go through the batcher like ``/predict``: one ``(M, D)`` embedding per image;
* per request: member logits ``(B, M, L) = logit_scale * einsum("bmd,lmd->bml") (+ logit_bias)``, then
  :func:`service.runtime.summarize_rows` (manifest temperature, OOD metric and threshold) and
  :func:`service.runtime.format_predictions` with the request's labels, in the request's order.

Backend: torch eager only (fp32 on CPU; bf16 autocast on CUDA or with ``HYDRA_PRECISION=bf16``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
import torch
from prometheus_client import Counter

from .artifact import ArtifactError
from .backends import BackendConfigError, Plan
from .errors import InvalidInput
from .fused import load_model
from .fused_clip import FusedCLIP, zero_shot_logits
from .metrics import Metrics
from .preprocess import ImagePreprocessor, TextPreprocessor, decode_base64
from .runtime import RUNTIMES, ItemResult, ZeroShotRuntime, format_predictions, summarize_rows
from .settings import Settings

__all__ = ["CLIPZeroShotRuntime", "TextCache", "TEXT_CACHE_SIZE", "text_cache_counter"]

log = logging.getLogger("hydra.zeroshot")

TEXT_CACHE_SIZE = 256  # (labels, template) entries
TEXT_CHUNK = 64  # prompts per text-encoder pass


def text_cache_counter(metrics: Metrics) -> Counter:
    """``hydra_zero_shot_text_cache_total{model, result="hit"|"miss"}``, registered once per :class:`Metrics`."""
    counter = getattr(metrics, "zero_shot_text_cache", None)
    if counter is None:
        counter = Counter(
            "hydra_zero_shot_text_cache", "Zero-shot text-embedding cache lookups, by result (hit or miss).",
            ["model", "result"], registry=metrics.registry,
        )  # fmt: skip
        metrics.zero_shot_text_cache = counter  # type: ignore[attr-defined]
    return counter


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


class CLIPZeroShotRuntime(ZeroShotRuntime):
    """A fused CLIP artifact: ``/zero-shot`` with any labels, ``/predict`` (images) with the manifest's labels."""

    def __init__(self, root: Path, manifest: dict[str, Any], settings: Settings, metrics: Metrics | None) -> None:
        super().__init__(root, manifest, settings, metrics)
        prep = manifest.get("preprocessing") or {}
        zs = manifest.get("zero_shot") or {}
        model = manifest.get("model")
        if not isinstance(model, dict) or "config" not in model or "weights" not in model:
            raise ArtifactError(f"{root / 'manifest.json'}: manifest lacks the 'model' block (config, weights)")
        if model["config"].get("arch") != "clip":
            raise ArtifactError(f"{root}: a zero-shot artifact needs model.config.arch 'clip'")
        try:
            self.pre = ImagePreprocessor(prep, settings.max_image_pixels)
            self.text_pre = TextPreprocessor({**prep["text"], "type": "text"}, root)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ArtifactError(f"{root}: bad preprocessing in the manifest: {e}") from e
        self.template: str = str(zs.get("template", "A photo of a {label}."))
        self.model: FusedCLIP | None = None
        self.cache = TextCache(TEXT_CACHE_SIZE)
        self._fixed: torch.Tensor | None = None  # (C, M, D) text embeddings of the manifest's labels
        self._counter = text_cache_counter(metrics) if metrics is not None else None

    # -- set-up
    def resolve(self) -> None:
        """Torch eager on ``HYDRA_DEVICE``; fp32 on CPU, bf16 autocast on CUDA (unless ``HYDRA_PRECISION``)."""
        s = self.settings
        cuda = torch.cuda.is_available()
        device = s.device if s.device != "auto" else ("cuda" if cuda else "cpu")
        if device == "cuda" and not cuda:
            raise BackendConfigError(f"{self.name}: HYDRA_DEVICE=cuda but no CUDA device is visible; use auto or cpu")
        precision = s.precision if s.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
        reason = f"zero-shot runs torch eager; precision {precision}"
        if s.backend not in ("auto", "torch"):
            reason += f" (HYDRA_BACKEND={s.backend} applies to classifiers only)"
        self.plan = Plan("torch", device, precision, reason)

    def load(self) -> None:
        """Read the fused weights and embed the manifest's labels with its template (blocking)."""
        if self.plan is None:
            self.resolve()
        assert self.plan is not None
        cfg = self.manifest["model"]
        try:
            model = load_model(self.root / cfg["weights"], cfg["config"], device=self.plan.device)
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
                emb = self.model.encode_text(batch["input_ids"].to(self.plan.device),
                                             batch["attention_mask"].to(self.plan.device))  # fmt: skip
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
    def prepare(self, raw: list[str] | list[bytes], field: str, *, base64_encoded: bool) -> list[torch.Tensor]:
        """Decode and preprocess the images of one request -> ``(C, H, W)`` tensors (raises naming the input)."""
        out = []
        many = len(raw) > 1 or field.endswith("s")
        for i, x in enumerate(raw):
            where = f"{field}[{i}]" if many else field
            data = decode_base64(x, where) if base64_encoded else x
            out.append(self.pre(data, where))
        return out

    # -- worker thread: images -> embeddings
    def _run(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        """``B`` prepared images -> ``B`` image embeddings ``(M, D)`` fp32 on CPU."""
        assert self.model is not None and self.plan is not None
        pixels = self.pre.collate(items)["pixel_values"].to(self.plan.device)
        with torch.inference_mode(), self._autocast():
            emb = self.model.encode_image(pixels)  # (B, M, D)
        if emb.dim() != 3 or emb.shape[0] != len(items):
            raise RuntimeError(f"{self.name}: image encoder output {tuple(emb.shape)}, expected (B={len(items)}, M, D)")
        return list(emb.float().cpu().unbind(0))

    def _results(self, image: torch.Tensor, text: torch.Tensor) -> list[ItemResult]:
        """Image ``(B, M, D)`` and text ``(L, M, D)`` embeddings -> one :class:`ItemResult` per image."""
        assert self.model is not None
        with torch.inference_mode():
            scale = self.model.logit_scale.detach().float().exp().cpu()
            bias = self.model.logit_bias.detach().float().cpu() if self.model.logit_bias is not None else None
            logits = zero_shot_logits(image, text, scale, bias)  # (B, M, L)
        return summarize_rows(logits, self.temperature, self.ood_metric, self.ood_threshold)

    async def _answer(
        self, prepared: list[torch.Tensor], labels: list[str], text: torch.Tensor, *, top_k: int,
        return_members: bool, t0: float,
    ) -> dict[str, Any]:  # fmt: skip
        res = await self.batcher.submit(prepared)
        results = self._results(torch.stack(res.results), text)
        self._count(results)
        preds = format_predictions(
            results, labels, top_k=top_k, return_members=return_members, metric=self.ood_metric,
            threshold=self.ood_threshold,
        )  # fmt: skip
        return {"model": self.name, "predictions": preds, "timing": self._timing(res, t0)}

    async def zero_shot(
        self, images: list[str] | list[bytes], labels: list[str], template: str, *, base64_encoded: bool,
        top_k: int, return_members: bool, t0: float,
    ) -> dict[str, Any]:  # fmt: skip
        """Images against ``labels`` (prompts ``template.format(label=...)``) -> the ``/zero-shot`` answer body."""
        field = "file" if not base64_encoded else ("images" if len(images) > 1 else "image")
        raw_bytes = sum(len(x) for x in images)
        if raw_bytes > 32 * 1024:
            prepared = await anyio.to_thread.run_sync(
                lambda: self.prepare(images, field, base64_encoded=base64_encoded)
            )
        else:
            prepared = self.prepare(images, field, base64_encoded=base64_encoded)
        text = await self.text_embeddings(labels, template)
        return await self._answer(prepared, list(labels), text, top_k=top_k, return_members=return_members, t0=t0)

    async def predict(
        self, prepared: list[torch.Tensor], *, top_k: int, return_members: bool, t0: float
    ) -> dict[str, Any]:
        """Prepared images of one request against the manifest's fixed ``labels`` -> the ``/predict`` body."""
        if self._fixed is None:
            raise InvalidInput(f"model: {self.name!r} has no fixed labels; send the images to /zero-shot")
        return await self._answer(prepared, self.labels, self._fixed, top_k=top_k, return_members=return_members,
                                  t0=t0)  # fmt: skip

    async def warmup(self) -> None:
        """One image through preprocess, batcher, image encoder and uncertainty (fixed labels embedded at load)."""
        prepared = self.prepare([self.pre.example()], "warmup", base64_encoded=False)
        text = self._fixed if self._fixed is not None else await self.text_embeddings(["a", "b"], self.template)
        labels = self.labels if self._fixed is not None else ["a", "b"]
        await self._answer(prepared, labels, text, top_k=1, return_members=True, t0=time.perf_counter())
        self.ready = True

    async def probe(self) -> None:
        """The warm-up image through the batcher and image encoder, not counted as a prediction."""
        await self.batcher.submit(self.prepare([self.pre.example()], "probe", base64_encoded=False))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        zs = self.manifest.get("zero_shot") or {}
        d["zero_shot"] = {"template": self.template, "embed_dim": zs.get("embed_dim"),
                          "text_cache_size": self.cache.size}  # fmt: skip
        return d


RUNTIMES["zero-shot"] = CLIPZeroShotRuntime
