"""A loaded artifact: preprocess -> batcher -> backend -> uncertainty -> response fields.

:func:`open_runtime` reads and verifies an artifact (every file's sha256) and
returns the :class:`Runtime` of its ``task``, found in :data:`RUNTIMES`, with its
backend chosen (:mod:`service.backends`) but not loaded; :meth:`Runtime.load`
then reads the weights (:func:`load_runtime` does both). Classification is :class:`ClassifierRuntime`;
a zero-shot runtime (CLIP: image encoder ``(B, M, D)``, text encoder ``(L, M, D)``,
logit scale) is one subclass of :class:`ZeroShotRuntime` registered under
``"zero-shot"``: the app routes ``/zero-shot`` to it without other changes, and
:func:`format_predictions` turns its ``(B, M, L)`` logits into answers like any other.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from .artifact import ArtifactError, load_manifest, verify_files
from .backends import Backend, BackendConfigError, Plan, load_backend, resolve_plan
from .batching import Batcher, BatchResult
from .metrics import Metrics
from .preprocess import ImagePreprocessor, TextPreprocessor, decode_base64, make_preprocessor
from .settings import Settings
from .uncertainty import OOD_METRICS, ood_flag, ood_score, summarize

__all__ = [
    "RUNTIMES",
    "ClassifierRuntime",
    "ItemResult",
    "Runtime",
    "ZeroShotRuntime",
    "format_predictions",
    "load_runtime",
    "open_runtime",
    "summarize_rows",
]

log = logging.getLogger("hydra.runtime")


@dataclass
class ItemResult:
    """Uncertainty of one input, from its member logits ``(M, C)``."""

    probs: np.ndarray  # (C,) ensemble probabilities
    member_probs: np.ndarray  # (M, C)
    prediction: int
    msp: float
    entropy: float
    expected_entropy: float
    mutual_information: float
    disagreement: float
    ood_score: float
    ood_flag: bool


def summarize_rows(logits: torch.Tensor, temperature: float, metric: str, threshold: float) -> list[ItemResult]:
    """Member logits ``(B, M, C)`` -> one :class:`ItemResult` per input, via :mod:`service.uncertainty`."""
    s = summarize(logits, temperature)
    score = ood_score(s, metric)
    flag = ood_flag(score, metric, threshold)
    probs = s["probs"].numpy()
    mp = s["member_probs"].numpy()
    cols = {k: s[k].tolist() for k in ("prediction", "msp", "entropy", "expected_entropy", "mutual_information",
                                         "disagreement")}  # fmt: skip
    scores, flags = score.tolist(), flag.tolist()
    return [
        ItemResult(probs[i], mp[i], int(cols["prediction"][i]), cols["msp"][i], cols["entropy"][i],
                   cols["expected_entropy"][i], cols["mutual_information"][i], cols["disagreement"][i],
                   float(scores[i]), bool(flags[i]))  # fmt: skip
        for i in range(len(probs))
    ]


def format_predictions(
    results: list[ItemResult],
    labels: list[str],
    *,
    top_k: int,
    return_members: bool,
    metric: str,
    threshold: float,
) -> list[dict[str, Any]]:
    """The ``predictions`` list of CONTRACT.md §2; ``top_k`` is clamped to ``len(labels)``."""
    k = max(1, min(int(top_k), len(labels)))
    out = []
    for r in results:
        order = np.argsort(-r.probs, kind="stable")[:k]
        pred: dict[str, Any] = {
            "label": labels[r.prediction],
            "label_index": r.prediction,
            "confidence": float(r.probs[r.prediction]),
            "top_k": [{"label": labels[j], "prob": float(r.probs[j])} for j in order],
            "uncertainty": {
                "msp": r.msp,
                "entropy": r.entropy,
                "expected_entropy": r.expected_entropy,
                "mutual_information": r.mutual_information,
                "disagreement": r.disagreement,
            },
            "ood": {"flag": r.ood_flag, "score": r.ood_score, "metric": metric, "threshold": threshold},
        }
        if return_members:
            idx = r.member_probs.argmax(-1)
            pred["members"] = [
                {"label": labels[int(j)], "confidence": float(r.member_probs[m, j])} for m, j in enumerate(idx)
            ]
        out.append(pred)
    return out


class Runtime(abc.ABC):
    """One loaded artifact behind one batcher. Subclasses set ``task`` and implement ``_run``/``warmup``.

    Health: after ``HYDRA_UNREADY_AFTER_FAILURES`` failed batches in a row the runtime is not ``healthy``
    (``/readyz`` 503) and runs :meth:`probe` every ``HYDRA_PROBE_INTERVAL_S`` seconds until a batch succeeds.
    """

    task: ClassVar[str]

    def __init__(self, root: Path, manifest: dict[str, Any], settings: Settings, metrics: Metrics | None) -> None:
        self.root = root
        self.manifest = manifest
        self.settings = settings
        self.metrics = metrics
        self.name: str = manifest["name"]
        self.family: str = manifest["family"]
        self.members: int = int(manifest["members"])
        unc = manifest["uncertainty"]
        self.temperature = float(unc["temperature"])
        self.ood_metric = str(unc["ood_score"])
        self.ood_threshold = float(unc["ood_threshold"])
        if self.ood_metric not in OOD_METRICS:
            raise ArtifactError(f"{root}: uncertainty.ood_score {self.ood_metric!r} is not in {sorted(OOD_METRICS)}")
        if not self.temperature > 0:
            raise ArtifactError(f"{root}: uncertainty.temperature must be > 0, got {self.temperature}")
        self.plan: Plan | None = None
        self.batcher = Batcher(
            self.name, self._run, max_batch=settings.max_batch, max_wait_s=settings.max_wait_ms / 1000,
            max_queue=settings.max_queue, metrics=metrics, unhealthy_after=settings.unready_after_failures,
            on_health=self._health_changed,
        )  # fmt: skip
        self.ready = False
        self._prober: asyncio.Task | None = None

    @property
    @abc.abstractmethod
    def modality(self) -> str:
        """``image`` or ``text``: the inputs ``/predict`` routes to this runtime."""

    @property
    def labels(self) -> list[str]:
        return list(self.manifest.get("labels") or [])

    def resolve(self) -> None:
        """Check the settings against the artifact before loading (cheap; e.g. set ``self.plan``).

        Raises :class:`BackendConfigError` for a backend / device / precision that cannot serve it, so
        that a bad configuration refuses start-up before the port is bound. Default: nothing to check.
        """
        return None

    @abc.abstractmethod
    def load(self) -> None:
        """Build the backend(s) and set ``self.plan`` (blocking: reads weights / exports)."""

    @abc.abstractmethod
    def _run(self, items: list[Any]) -> list[Any]:
        """Worker thread: prepared inputs (at most ``max_batch``) -> one result per input."""

    @abc.abstractmethod
    async def warmup(self) -> None:
        """One batch through the full path (preprocess, batcher, backend, uncertainty)."""

    @property
    def healthy(self) -> bool:
        """False after ``HYDRA_UNREADY_AFTER_FAILURES`` failed batches in a row, until a batch runs again."""
        return self.batcher.healthy

    async def probe(self) -> None:
        """One batch through the model while it is unhealthy (default: :meth:`warmup`)."""
        await self.warmup()

    def start(self) -> None:
        self.batcher.start()
        if self.metrics is not None:
            self.metrics.model_healthy.labels(self.name).set(1)

    async def close(self) -> None:
        self.ready = False
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        await self.batcher.close()

    def _health_changed(self, healthy: bool) -> None:
        """Batcher callback (event loop): start probing when the model fails, stop when it runs again."""
        if self.metrics is not None:
            self.metrics.model_healthy.labels(self.name).set(1 if healthy else 0)
        if not healthy and (self._prober is None or self._prober.done()):
            loop = asyncio.get_running_loop()
            self._prober = loop.create_task(self._probe_until_healthy(), name=f"probe-{self.name}")

    async def _probe_until_healthy(self) -> None:
        interval = self.settings.probe_interval_s
        log.error("%s: not ready; a probe batch runs every %.3g s until one succeeds", self.name, interval)
        while not self.batcher.healthy and self.batcher.running:
            await asyncio.sleep(interval)
            if self.batcher.healthy or not self.batcher.running:
                break
            try:
                await self.probe()
            except Exception as e:  # the batcher logged the cause; keep probing
                log.warning("%s: probe batch failed (%s); next in %.3g s", self.name, type(e).__name__, interval)
        if self.batcher.healthy:
            log.warning("%s: ready again", self.name)

    def describe(self) -> dict[str, Any]:
        """The ``/v1/models`` entry."""
        plan = self.plan
        return {
            "name": self.name,
            "family": self.family,
            "task": self.task,
            "modality": self.modality,
            "members": self.members,
            "labels": self.labels,
            "backend": plan.backend if plan else "none",
            "device": plan.device if plan else "none",
            "precision": plan.precision if plan else "none",
            "max_batch": self.settings.max_batch,
            "uncertainty": {"temperature": self.temperature, "ood_score": self.ood_metric,
                            "ood_threshold": self.ood_threshold, "tpr": self.manifest["uncertainty"].get("tpr")},
        }  # fmt: skip

    def _timing(self, res: BatchResult, t0: float) -> dict[str, float]:
        return {
            "queue_ms": round(res.queue_s * 1000, 3),
            "inference_ms": round(res.inference_s * 1000, 3),
            "total_ms": round((time.perf_counter() - t0) * 1000, 3),
        }

    def _count(self, results: list[ItemResult]) -> None:
        if self.metrics is not None:
            n_ood = sum(r.ood_flag for r in results)
            if n_ood:
                self.metrics.predictions.labels(self.name, "true").inc(n_ood)
            if len(results) - n_ood:
                self.metrics.predictions.labels(self.name, "false").inc(len(results) - n_ood)


class ClassifierRuntime(Runtime):
    """``task: classification``: images (vit) or texts (bert) -> member logits ``(B, M, C)`` over ``labels``."""

    task = "classification"

    def __init__(self, root: Path, manifest: dict[str, Any], settings: Settings, metrics: Metrics | None) -> None:
        super().__init__(root, manifest, settings, metrics)
        prep = manifest["preprocessing"]
        try:
            self.pre: ImagePreprocessor | TextPreprocessor = make_preprocessor(prep, root, settings.max_image_pixels)
        except (ValueError, KeyError, OSError) as e:
            raise ArtifactError(f"{root}: bad preprocessing in the manifest: {e}") from e
        cfg = manifest["model"]["config"]
        if isinstance(self.pre, TextPreprocessor) and self.pre.max_length > int(cfg.get("max_position", 1 << 30)):
            raise ArtifactError(
                f"{root}: preprocessing.max_length {self.pre.max_length} exceeds the model's "
                f"max_position {cfg['max_position']}"
            )
        if int(cfg.get("num_classes", len(self.labels))) != len(self.labels):
            raise ArtifactError(f"{root}: {len(self.labels)} labels but the model has {cfg['num_classes']} classes")
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
        log.info("%s: %s on %s, %s (%s)", self.name, self.plan.backend, self.plan.device, self.plan.precision,
                 self.plan.reason)  # fmt: skip

    # -- request side (event loop or a request thread): one bad input fails only its request
    def prepare(self, raw: list[str] | list[bytes], field: str, *, base64_encoded: bool) -> list[Any]:
        """Decode and preprocess the inputs of one request (raises :class:`InvalidInput` & co. naming the input)."""
        out = []
        many = len(raw) > 1 or field.endswith("s")
        for i, x in enumerate(raw):
            where = f"{field}[{i}]" if many else field
            if isinstance(self.pre, ImagePreprocessor):
                data = decode_base64(x, where) if base64_encoded else x
                out.append(self.pre(data, where))
            else:
                out.append(x)
        if isinstance(self.pre, TextPreprocessor):
            out = self.pre.encode(out)
        return out

    # -- worker thread
    def _run(self, items: list[Any]) -> list[ItemResult]:
        assert self.backend is not None
        logits = self.backend(self.pre.collate(items))  # (B, M, C)
        if logits.dim() != 3 or logits.shape[0] != len(items) or logits.shape[2] != len(self.labels):
            raise RuntimeError(
                f"{self.name}: model output {tuple(logits.shape)}, expected (B={len(items)}, M, C={len(self.labels)})"
            )
        return summarize_rows(logits, self.temperature, self.ood_metric, self.ood_threshold)

    async def predict(self, prepared: list[Any], *, top_k: int, return_members: bool, t0: float) -> dict[str, Any]:
        """Prepared inputs of one request -> the ``/predict`` answer body."""
        res = await self.batcher.submit(prepared)
        self._count(res.results)
        preds = format_predictions(
            res.results, self.labels, top_k=top_k, return_members=return_members, metric=self.ood_metric,
            threshold=self.ood_threshold,
        )  # fmt: skip
        return {"model": self.name, "predictions": preds, "timing": self._timing(res, t0)}

    async def warmup(self) -> None:
        prepared = self.prepare([self.pre.example()], "warmup", base64_encoded=False)
        await self.predict(prepared, top_k=1, return_members=True, t0=time.perf_counter())
        self.ready = True

    async def probe(self) -> None:
        """The warm-up input through the batcher and backend, not counted as a prediction."""
        await self.batcher.submit(self.prepare([self.pre.example()], "probe", base64_encoded=False))


class ZeroShotRuntime(Runtime):
    """``task: zero-shot`` (CLIP family): images against labels given per request.

    A subclass loads an image encoder (``(B, M, D)`` normalised embeddings), a
    text encoder (``(L, M, D)``) and the logit scale; member logits are
    ``scale * einsum("bmd,lmd->bml")`` and go through :func:`summarize_rows` and
    :func:`format_predictions` with the request's labels. Register it with
    ``RUNTIMES["zero-shot"] = TheSubclass``.
    """

    task = "zero-shot"

    @property
    def modality(self) -> str:
        return "image"

    @abc.abstractmethod
    async def zero_shot(
        self, images: list[str] | list[bytes], labels: list[str], template: str, *, base64_encoded: bool,
        top_k: int, return_members: bool, t0: float,
    ) -> dict[str, Any]:
        """Images against ``labels`` (prompts ``template.format(label=...)``) -> the ``/zero-shot`` answer body."""


# task -> runtime class; a new task is one more entry ("zero-shot": service.zeroshot registers itself, below)
RUNTIMES: dict[str, type[Runtime]] = {"classification": ClassifierRuntime}


def load_runtime(root: str | Path, settings: Settings, metrics: Metrics | None = None) -> Runtime:
    """Read, verify and load the artifact at ``root`` (blocking). Raises :class:`ArtifactError` naming the file."""
    rt = open_runtime(root, settings, metrics)
    rt.load()
    return rt


def open_runtime(root: str | Path, settings: Settings, metrics: Metrics | None = None) -> Runtime:
    """Read and verify the artifact at ``root`` (manifest, every file's size and sha256) and check the settings
    against it, without loading the model (:meth:`Runtime.load`). Raises :class:`ArtifactError` naming the file,
    :class:`BackendConfigError` for settings that cannot serve it."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"{root}: artifact directory does not exist (HYDRA_ARTIFACTS)")
    manifest = load_manifest(root)
    verify_files(root, manifest)
    if manifest["task"] == "classification" and not isinstance(manifest.get("model"), dict):
        raise ArtifactError(f"{root / 'manifest.json'}: manifest lacks the 'model' block (config, weights, inputs)")
    cls = RUNTIMES.get(manifest["task"])
    if cls is None:
        raise ArtifactError(
            f"{root}: task {manifest['task']!r} has no runtime in this server (known: {sorted(RUNTIMES)})"
        )
    rt = cls(root, manifest, settings, metrics)
    rt.resolve()
    return rt


# the zero-shot runtime (CLIP) imports this module and adds RUNTIMES["zero-shot"]; imported last so that
# every name above exists whichever module is imported first
from . import zeroshot as _zeroshot  # noqa: E402, F401
