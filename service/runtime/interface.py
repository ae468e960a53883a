"""What every runtime shares: the :class:`Runtime` base, what it is asked (:class:`Query`) and what it answers
(:class:`Outcome`: per-input uncertainty, :class:`ItemResult`; both in :mod:`service.runtime.results`), with the
guarantees' path of :mod:`service.runtime.guarded`.

A runtime is one loaded artifact behind one batcher: the request side decodes and
preprocesses the inputs (:meth:`Runtime.prepare`), the worker thread runs the model
on a batch (``_run``), and :meth:`Runtime.outcome` turns the member logits ``(B, M, C)``
of one request into one :class:`ItemResult` per input (an :class:`Outcome`). A runtime knows
nothing of HTTP: each protocol builds its own body from the outcome (:mod:`service.api.answers`
for ``/predict`` and ``/zero-shot``, :mod:`service.api.oip` for the Open Inference Protocol).

Health lives here too: after ``HYDRA_UNREADY_AFTER_FAILURES`` failed batches in a row a
runtime is not ``healthy`` (``/readyz`` 503) and runs a probe batch every
``HYDRA_PROBE_INTERVAL_S`` seconds until one succeeds.

This module knows no concrete runtime; :mod:`service.runtime` holds the registry.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from safetensors.torch import load_file

from service.core.artifact import ArtifactError, Manifest, artifact_version
from service.core.drift import DriftFeed
from service.core.errors import InvalidInput
from service.core.guarantees import load_guarantees
from service.core.ood import PER_MEMBER_SCORES, OODStats, ensemble_scores, ood_from_tensors
from service.core.preprocess import ImagePreprocessor, TextPreprocessor, decode_base64
from service.core.uncertainty import OOD_METRICS, ood_flag, ood_score, summarize
from service.fleet import shared_file
from service.metrics import Metrics
from service.runtime.batching import Batcher, BatchLimits
from service.runtime.guarded import GuaranteedAnswers
from service.runtime.monitor import LiveMonitor
from service.runtime.plan import Plan
from service.runtime.results import ItemResult, Outcome, Query
from service.settings import Settings
from service.store import PredictionStore

__all__ = [
    "ItemResult",
    "Outcome",
    "Query",
    "Runtime",
    "load_ood_stats",
    "preprocess_images",
    "fill_scores",
    "summarize_rows",
]

log = logging.getLogger("hydra.runtime")


def summarize_rows(
    logits: torch.Tensor,
    temperature: float,
    metric: str,
    threshold: float,
    features: torch.Tensor | None = None,
    stats: OODStats | None = None,
    layer_features: torch.Tensor | None = None,
    every_score: bool = True,
) -> list[ItemResult]:
    """Member logits ``(B, M, C)`` (and features ``(B, M, D)``, layer features ``(B, M, L-1, d)``) -> one
    :class:`ItemResult` per input.

    The uncertainty comes from :mod:`service.core.uncertainty`; with the artifact's OOD statistics ``stats`` every
    score of :func:`service.core.ood.ensemble_scores` is computed too (``ItemResult.scores``), and ``metric`` may name
    any of them. ``every_score`` False: only the served one (the batch's work when no request asks for the others);
    each result keeps its rows of the outputs (``ItemResult.outputs``) for :func:`fill_scores`.
    """
    s = summarize(logits, temperature)
    only = None if every_score else metric
    scores = (
        ensemble_scores(logits, features, stats, temperature, summary=s, layer_features=layer_features, only=only)
        if stats is not None
        else None
    )
    score = scores[metric] if scores is not None else ood_score(s, metric)  # float64 with statistics
    flag = ood_flag(score, metric, threshold)
    probs = s["probs"].numpy()  # (B, C)
    mp = s["member_probs"].numpy()  # (B, M, C)
    # one Python list per column (B,), in ItemResult's order: a float per input, not a tensor element each
    names = ("prediction", "msp", "entropy", "expected_entropy", "mutual_information", "disagreement")
    cols = [s[k].tolist() for k in names]
    rows = zip(probs, mp, *cols, score.tolist(), flag.tolist(), strict=True)
    out = [
        ItemResult(p, m, int(pred), msp, ent, exp_ent, mi, dis, float(sc), bool(fl))
        for p, m, pred, msp, ent, exp_ent, mi, dis, sc, fl in rows
    ]
    if scores is not None and every_score:
        per_input = {k: v.tolist() for k, v in scores.items()}
        for i, r in enumerate(out):
            r.scores = {k: float(v[i]) for k, v in per_input.items()}
    elif stats is not None:
        for i, r in enumerate(out):
            r.outputs = (
                logits[i],
                None if features is None else features[i],
                None if layer_features is None else layer_features[i],
            )
    return out


def fill_scores(results: list[ItemResult], stats: OODStats | None, temperature: float) -> None:
    """Every OOD score of the results that have only the served one (``return_scores`` asked for them), computed on
    their rows of the outputs as :func:`summarize_rows` would have: the same numbers."""
    todo = [r for r in results if r.scores is None and r.outputs is not None]
    if stats is None or not todo:
        return
    logits = torch.stack([r.outputs[0] for r in todo])  # type: ignore[index]
    rows = [r.outputs[1] for r in todo]  # type: ignore[index]
    features = None if rows[0] is None else torch.stack(rows)
    layers = [r.outputs[2] for r in todo]  # type: ignore[index]
    layer_features = None if layers[0] is None else torch.stack(layers)
    scores = ensemble_scores(logits, features, stats, temperature, layer_features=layer_features)
    per_input = {k: v.tolist() for k, v in scores.items()}
    for i, r in enumerate(todo):
        r.scores = {k: float(v[i]) for k, v in per_input.items()}


def preprocess_images(
    pre: ImagePreprocessor, raw: Sequence[str | bytes], field: str, *, base64_encoded: bool
) -> list[torch.Tensor]:
    """Decode (base64 when sent in JSON) and preprocess the images of one request -> ``(C, H, W)`` tensors.

    Errors name the input: ``field`` for one image sent as a single value, ``field[i]`` otherwise.
    """
    out = []
    many = len(raw) > 1 or field.endswith("s")
    for i, x in enumerate(raw):
        where = f"{field}[{i}]" if many else field
        data = decode_base64(cast(str, x), where) if base64_encoded else cast(bytes, x)  # JSON: text; else bytes
        out.append(pre(data, where))
    return out


def load_ood_stats(root: Path, manifest: Manifest) -> OODStats | None:
    """The artifact's OOD statistics (manifest ``ood``; None without it), checked against the model's shape: class
    Gaussians of a classifier, or (``ood.label_free``, zero-shot) one Gaussian of the ID images per member."""
    spec = manifest.ood
    if spec is None:
        return None
    path = root / spec.file
    try:
        stats = ood_from_tensors(load_file(str(path)))
    except (OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{path}: unreadable OOD statistics ({e})") from e
    missing = [s for s in spec.scores if s in PER_MEMBER_SCORES and s not in stats.norms]
    if missing:
        raise ArtifactError(f"{path}: no norms for the scores {missing} the manifest lists")
    if "mahalanobis_layers" in spec.scores:
        if stats.layers is None or list(stats.layers.ids) != list(spec.layers or []):
            raise ArtifactError(
                f"{path}: the layer statistics of mahalanobis_layers do not match ood.layers {spec.layers}"
            )
        if stats.layers.members != manifest.members:
            raise ArtifactError(
                f"{path}: layer statistics for {stats.layers.members} members, the model has {manifest.members}"
            )
    g = stats.gaussians
    classes = 1 if spec.label_free else len(manifest.labels or [])  # zero-shot: one Gaussian of ID images
    if g is not None and (g.members != manifest.members or g.means.shape[1] != classes):
        raise ArtifactError(
            f"{path}: statistics for {g.members} members and {g.means.shape[1]} classes, the model has "
            f"{manifest.members} and {classes}"
        )
    return stats


class Runtime(GuaranteedAnswers, abc.ABC):
    """One loaded artifact behind one batcher. Subclasses set ``task`` and implement the abstract methods."""

    task: ClassVar[str]
    pre: ImagePreprocessor | TextPreprocessor  # the inputs' decoding and preprocessing (set by the subclass)

    def __init__(self, root: Path, manifest: Manifest, settings: Settings, metrics: Metrics | None) -> None:
        self.root = root
        self.manifest = manifest
        self.settings = settings
        self.metrics = metrics
        self.name: str = manifest.name
        try:
            self.version: str = artifact_version(manifest)
        except ArtifactError as e:
            raise ArtifactError(f"{root}: {e}") from None
        self.family: str = manifest.family
        self.members: int = manifest.members
        unc = manifest.uncertainty
        self.temperature = unc.temperature
        self.ood_metric: str = unc.ood_score
        self.ood_threshold = unc.ood_threshold
        if self.ood_metric not in OOD_METRICS:
            raise ArtifactError(f"{root}: uncertainty.ood_score {self.ood_metric!r} is not in {sorted(OOD_METRICS)}")
        if not self.temperature > 0:
            raise ArtifactError(f"{root}: uncertainty.temperature must be > 0, got {self.temperature}")
        self.plan: Plan | None = None
        self.guarantees = load_guarantees(root, manifest)  # sets, p-values, risk rules (None: not built with them)
        # the drift alarm, fed from the request path in chunks (service.core.drift.DriftFeed: the statistic is that of
        # every score fed at once; every read of its state, a /metrics scrape included, takes the buffer in first)
        # with several workers, one alarm for all of them (service.core.drift_shared), in the supervisor's folder
        shared = shared_file(f"drift-{self.name}-{self.version}.state")
        self.drift = (
            DriftFeed(self.guarantees.monitor(shared), on_update=self._drift_metrics)
            if self.guarantees is not None
            else None
        )
        self.drift_error: str | None = None  # why the shared drift state cannot be read (answers abstain meanwhile)
        self._init_recall(shared)
        self._children: dict[tuple[str, ...], Any] = {}  # labelled metric children, looked up once
        # (alarm_at, labels the online rules had then) of the last drift alarm episode an answer saw
        self._alarm_mark: tuple[int | None, int] = (None, 0)
        self._drift_episodes = 0  # alarm episodes already counted in hydra_drift_episodes_total
        if self.drift is not None and metrics is not None:
            self._drift_metrics(self.drift.monitor)
            metrics.drift_threshold.labels(self.name).set(self.drift.monitor.log10_threshold)
            for accepted in ("true", "false"):  # the recall counters exist from start-up, at 0
                self._child("drift_recalled", accepted)
        limits = BatchLimits(settings.max_batch, settings.max_wait_ms / 1000, settings.max_queue, settings.batch_fill)
        self.batcher = Batcher(
            self.name,
            self._run,
            limits,
            metrics=metrics,
            unhealthy_after=settings.unready_after_failures,
            on_health=self._health_changed,
            in_flight=(lambda: metrics.requests_in_flight) if metrics is not None else None,
        )
        self.ready = False
        self._prober: asyncio.Task | None = None
        self.monitor: LiveMonitor | None = None  # the live monitor over the prediction store (attach_monitor)

    def attach_monitor(self, store: PredictionStore) -> LiveMonitor:
        """Record this model's answers in ``store`` and monitor them (:mod:`service.runtime.monitor`)."""
        spec = self.manifest.guarantees
        errors = spec.calibration_errors if spec is not None else None
        self.monitor = LiveMonitor(store, self.name, self.version, self.guarantees, errors, self.metrics)
        return self.monitor

    @property
    @abc.abstractmethod
    def modality(self) -> str:
        """``image`` or ``text``: the inputs this runtime takes."""

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """``(C, H, W)`` of one preprocessed image for an image model (``pixel_values``), None for a text model."""
        pre = self.pre
        return (pre.channels, *pre.size) if isinstance(pre, ImagePreprocessor) else None

    @property
    def labels(self) -> list[str]:
        """The artifact's own labels (the classes of ``/predict``)."""
        return list(self.manifest.labels or [])

    def answers(self, task: str) -> bool:
        """Whether this runtime answers the endpoint of ``task`` (``classification``: ``/predict``,
        ``zero-shot``: ``/zero-shot``). Default: its own task only."""
        return task == self.task

    def resolve(self) -> None:
        """Check the settings against the artifact before loading (cheap; e.g. set ``self.plan``).

        Raises :class:`~service.core.backends.BackendConfigError` for a backend / device / precision that cannot
        serve it, so that a bad configuration refuses start-up before the port is bound. Default: nothing.
        """
        return None

    @abc.abstractmethod
    def load(self) -> None:
        """Build the backend(s) and set ``self.plan`` (blocking: reads weights / exports)."""

    @abc.abstractmethod
    def prepare(self, raw: Sequence[str | bytes], field: str, *, base64_encoded: bool) -> list[Any]:
        """Decode and preprocess the inputs of one request (raises :class:`~service.core.errors.InvalidInput` & co.
        naming the input). Runs on the event loop or in a request thread: one bad input fails only its request."""

    @abc.abstractmethod
    def _run(self, items: list[Any]) -> list[Any]:
        """Worker thread: prepared inputs (at most ``max_batch``) -> one result per input."""

    @abc.abstractmethod
    async def _outcome(self, prepared: list[Any], query: Query) -> Outcome:
        """Prepared inputs of one request -> its results, through the batcher."""

    async def outcome(self, prepared: list[Any], query: Query) -> Outcome:
        """Prepared inputs of one request -> its results, counted in ``hydra_predictions_total``; with guarantees,
        the request's sets, p-values and risk decisions, and the drift test fed."""
        self.check_query(query)
        out = await self._outcome(prepared, query)
        if self.guarantees is not None:
            self._guarantees(out.results, query)
        self._count(out.results)
        return out

    def check_query(self, query: Query) -> None:
        """Refuse levels the model cannot serve (422 naming the value and what is accepted)."""
        g = self.guarantees
        if query.risk is not None and (g is None or query.risk not in g.rules):
            targets = sorted(g.rules) if g is not None else []
            raise InvalidInput(
                f"risk: {query.risk} is not a target this model was built with; available: "
                f"{targets if targets else 'none (the model has no calibration split)'}",
                status=422,
            )
        if query.adaptive and (g is None or self.monitor is None or not self.sets_hold(query)):
            why = "it has no calibration split" if g is None else "the prediction store is off (HYDRA_STORE)"
            raise InvalidInput(f"adaptive: model {self.name!r} serves no adaptive sets: {why}", status=422)
        if query.adaptive and query.alpha is not None and g is not None and query.alpha != g.alpha:
            raise InvalidInput(f"adaptive: the adaptive sets track the model's alpha {g.alpha:g}; leave alpha out")

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
        """Start the batcher's worker (after :meth:`load`)."""
        self.batcher.start()
        if self.metrics is not None:
            self.metrics.model_healthy.labels(self.name).set(1)

    async def close(self) -> None:
        """Stop probing, answer what is queued, stop the worker."""
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
            "version": self.version,
            "family": self.family,
            "task": self.task,
            "modality": self.modality,
            "members": self.members,
            "labels": self.labels,
            "backend": plan.backend if plan else "none",
            "device": plan.device if plan else "none",
            "precision": plan.precision if plan else "none",
            "max_batch": self.settings.max_batch,
            "uncertainty": {
                "temperature": self.temperature,
                "ood_score": self.ood_metric,
                "ood_threshold": self.ood_threshold,
                "tpr": self.manifest.uncertainty.tpr,
            },
            "guarantees": self._describe_guarantees(),
        }

    def _describe_guarantees(self) -> dict[str, Any] | None:
        """What a client may ask for: the defaults, the certified risk targets, the smallest alpha; the drift test."""
        g = self.guarantees
        if g is None:
            return None
        return {
            "calibration_size": g.n,
            "method": g.sets.method,
            "alpha": g.alpha,
            "min_alpha": g.min_alpha,
            "mondrian": g.mondrian,
            "set_delta": g.sets.delta,
            "ood_alpha": g.ood_alpha,
            "risk": g.risk,
            "delta": g.delta,
            "risks": {str(k): v for k, v in sorted(g.rules.items())},
            "drift": self.drift_state(answers=False),
        }

    def _count(self, results: list[ItemResult]) -> None:
        if self.metrics is not None:
            n_ood = sum(r.ood_flag for r in results)
            if n_ood:
                self.metrics.predictions.labels(self.name, "true").inc(n_ood)
            if len(results) - n_ood:
                self.metrics.predictions.labels(self.name, "false").inc(len(results) - n_ood)
