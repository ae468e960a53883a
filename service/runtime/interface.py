"""What every runtime shares: the :class:`Runtime` base, what it is asked (:class:`Query`) and what it answers
(:class:`Outcome`: per-input uncertainty, :class:`ItemResult`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch
from safetensors.torch import load_file

from ..core.artifact import DEFAULT_TEMPLATE, ArtifactError, Manifest, artifact_version
from ..core.drift import DriftFeed, DriftMonitor
from ..core.errors import InvalidInput
from ..core.guarantees import Answer, load_guarantees, outlier_oriented
from ..core.online_risk import OnlineRisk
from ..core.ood import PER_MEMBER_SCORES, OODStats, ensemble_scores, ood_from_tensors
from ..core.preprocess import ImagePreprocessor, TextPreprocessor, decode_base64
from ..core.uncertainty import OOD_METRICS, ood_flag, ood_score, summarize
from ..metrics import Metrics
from ..settings import Settings
from ..store import PredictionStore
from .batching import Batcher, BatchLimits, BatchResult
from .monitor import STALE_S, LiveMonitor
from .plan import Plan

__all__ = [
    "ItemResult",
    "Outcome",
    "Query",
    "Runtime",
    "load_ood_stats",
    "preprocess_images",
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
    scores: dict[str, float] | None = None  # every OOD score computed for this input (return_scores)
    # the guarantees (models with a calibration split; Runtime.outcome sets them for the request's levels)
    p_value: float | None = None  # conformal OOD p-value; ood_flag is then p_value <= ood_alpha
    ood_alpha: float | None = None
    flag_threshold: float | None = None  # the score threshold equivalent to p_value <= ood_alpha (None: never)
    prediction_set: np.ndarray | None = None  # (C,) bool, never empty
    set_alpha: float | None = None
    below_min_alpha: bool = False
    set_filled: bool = False  # no label passed the set's threshold: the set is the prediction alone
    accept: bool | None = None  # the risk rule of target ``risk``
    risk: float | None = None
    alpha_t: float | None = None  # the set is the adaptive one, built at this level (request option adaptive)
    # the drift alarm's word on the guarantees (HYDRA_DRIFT_POLICY): suspended while it is on (None: no guarantees)
    suspended: bool | None = None
    alarm_at: int | None = None  # the input at which the alarm went on, while it is on
    rule: str | None = None  # which accept rule decided: "certified" (the build's) or "online" (adaptive requests)
    rule_threshold: float | None = None  # that rule's confidence threshold now (None: it accepts nothing)
    abstain: str | None = None  # why the answer is not accepted whatever its confidence (the alarm), None else


@dataclass
class Outcome:
    """One request through the model: a result per input, in order, over ``labels``, and its batch timings."""

    results: list[ItemResult]
    labels: list[str]  # the model's own labels, or a zero-shot request's
    batch: BatchResult


@dataclass(frozen=True)
class Query:
    """What a request asks of a runtime besides its inputs."""

    top_k: int = 5
    return_members: bool = False
    # zero-shot: the request's candidate labels and prompt template; None: the model's own labels (/predict)
    labels: list[str] | None = None
    template: str = DEFAULT_TEMPLATE
    return_scores: bool = False  # add every OOD score computed to the answer
    alpha: float | None = None  # the prediction sets' miscoverage (None: the model's default)
    ood_alpha: float | None = None  # the OOD flag's level (None: the model's default)
    risk: float | None = None  # the risk target of selective.accept (None: the model's default)
    monitor: bool = True  # feed the drift test (False: the server's own warm-up and probe inputs)
    adaptive: bool = False  # the prediction sets of the online (adaptive) method (service.runtime.monitor)


def summarize_rows(
    logits: torch.Tensor,
    temperature: float,
    metric: str,
    threshold: float,
    features: torch.Tensor | None = None,
    stats: OODStats | None = None,
    layer_features: torch.Tensor | None = None,
) -> list[ItemResult]:
    """Member logits ``(B, M, C)`` (and features ``(B, M, D)``, layer features ``(B, M, L-1, d)``) -> one
    :class:`ItemResult` per input.

    The uncertainty comes from :mod:`service.core.uncertainty`; with the artifact's OOD statistics ``stats`` every
    score of :func:`service.core.ood.ensemble_scores` is computed too, and ``metric`` may name any of them.
    """
    s = summarize(logits, temperature)
    all_scores = (
        ensemble_scores(logits, features, stats, temperature, summary=s, layer_features=layer_features)
        if stats is not None
        else None
    )
    score = all_scores[metric] if all_scores is not None else ood_score(s, metric)  # float64 with statistics
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
    if all_scores is not None:
        per_input = {k: v.tolist() for k, v in all_scores.items()}
        for i, r in enumerate(out):
            r.scores = {k: float(v[i]) for k, v in per_input.items()}
    return out


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


class Runtime(abc.ABC):
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
        self.drift = (
            DriftFeed(self.guarantees.monitor(), on_update=self._drift_metrics) if self.guarantees is not None else None
        )
        self._children: dict[tuple[str, ...], Any] = {}  # labelled metric children, looked up once
        # (alarm_at, labels the online rules had then) of the last drift alarm episode an answer saw
        self._alarm_mark: tuple[int | None, int] = (None, 0)
        self._drift_episodes = 0  # alarm episodes already counted in hydra_drift_episodes_total
        if self.drift is not None and metrics is not None:
            self._drift_metrics(self.drift.monitor)
            metrics.drift_threshold.labels(self.name).set(self.drift.monitor.log10_threshold)
        limits = BatchLimits(settings.max_batch, settings.max_wait_ms / 1000, settings.max_queue, settings.batch_fill)
        self.batcher = Batcher(
            self.name,
            self._run,
            limits,
            metrics=metrics,
            unhealthy_after=settings.unready_after_failures,
            on_health=self._health_changed,
        )
        self.ready = False
        self._prober: asyncio.Task | None = None
        self.monitor: LiveMonitor | None = None  # the live monitor over the prediction store (attach_monitor)

    def attach_monitor(self, store: PredictionStore) -> LiveMonitor:
        """Record this model's answers in ``store`` and monitor them (:mod:`service.runtime.monitor`)."""
        spec = self.manifest.guarantees
        errors = spec.calibration.get("errors") if spec is not None else None
        errors = errors if isinstance(errors, int) and not isinstance(errors, bool) else None
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

    def sets_hold(self, query: Query) -> bool:
        """Whether the prediction sets and risk rules hold for this request (the calibration's labels)."""
        return True

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

    def _guarantees(self, results: list[ItemResult], query: Query) -> None:
        """Each result's OOD p-value and flag at the request's level, prediction set and risk decision, and what the
        drift alarm says of them now (:meth:`_alarm_now`, this request's inputs taken into it first, unless the
        policy is ``off``). The guarantees' metrics need none of the answer: they are updated after it."""
        g = self.guarantees
        assert g is not None
        scores = [r.ood_score for r in results]
        ood_alpha = g.ood_alpha if query.ood_alpha is None else query.ood_alpha
        alpha = g.alpha if query.alpha is None else query.alpha
        risk = g.risk if query.risk is None else query.risk
        probs = None
        if self.sets_hold(query):  # (B, C) float64
            probs = results[0].probs[None, :] if len(results) == 1 else np.stack([r.probs for r in results])
            probs = probs.astype(np.float64, copy=False)
        ans = g.answer(scores, probs, alpha, risk)
        p_list, sets, accepted = ans.p_values, ans.sets, ans.accepts
        alarm_at = self._alarm_now(scores, query)
        alpha_t, rule, lam, abstain = None, "certified", g.rules[risk], None
        withheld = 0
        if query.adaptive and self.monitor is not None and probs is not None:  # check_query: sets hold
            sets, filled, alpha_t = self.monitor.adaptive_sets(probs)
            ans = Answer(p_list, sets, False, filled, accepted, ans.eligible)
            online = self.monitor.online_rule(risk)
            if online is not None:  # None: an artifact built before the online rules (no calibration confidences)
                rule = "online"
                accepted, lam, abstain = self._online(online, probs, ans.eligible, alarm_at)
        if rule == "certified" and alarm_at is not None and accepted is not None and self._abstains:
            withheld = sum(accepted)
            accepted = [False] * len(results)
            abstain = (
                f"the drift alarm is on since input {alarm_at}: the traffic is not like the calibration split, so the "
                "certified rule does not hold now and accepts nothing until the alarm clears (adaptive requests get "
                "the online rule, once labels come back through the feedback route)"
            )
        cut = g.flag_threshold(ood_alpha)
        suspended = alarm_at is not None
        for i, r in enumerate(results):
            r.p_value, r.ood_alpha, r.ood_flag, r.flag_threshold = p_list[i], ood_alpha, p_list[i] <= ood_alpha, cut
            r.suspended, r.alarm_at = suspended, alarm_at
            if sets is not None and accepted is not None and ans.filled is not None:
                r.prediction_set, r.set_alpha, r.below_min_alpha = sets[i], alpha, ans.below_min_alpha
                r.set_filled = bool(ans.filled[i])
                r.accept, r.risk, r.alpha_t = accepted[i], risk, alpha_t
                r.rule, r.rule_threshold, r.abstain = rule, lam, abstain
        record = (scores if query.monitor and self._lazy_drift else None, p_list, sets, accepted)
        try:  # after the answer: the loop runs it once this request's task yields (while the model runs others)
            asyncio.get_running_loop().call_soon(self._record, *record, risk, suspended, withheld)
        except RuntimeError:  # no event loop (a direct call): now
            self._record(*record, risk, suspended, withheld)

    @property
    def _lazy_drift(self) -> bool:
        """Whether the drift alarm is fed after the answer, in chunks (policy ``off``: no answer reads it)."""
        return self.settings.drift_policy == "off"

    def _alarm_now(self, scores: list[float], query: Query) -> int | None:
        """The input at which the drift alarm went on, if it is on now and the policy lets it speak (None: off, or
        ``HYDRA_DRIFT_POLICY=off``). This request's scores go into the alarm first (not the server's own warm-up and
        probe inputs), so the answer that turns it on is the first it suspends."""
        if self.drift is None or self._lazy_drift:
            return None
        g = self.guarantees
        assert g is not None
        if query.monitor:
            self.drift.add(outlier_oriented(np.asarray(scores, dtype=np.float64), g.metric))
        at = self.drift.flush().alarm_at
        if at is not None and self.monitor is not None and self._alarm_mark[0] != at:
            # a new episode: the online rule takes labels from here (its copy read again now, in the background)
            rules = self.monitor.state.risk
            self._alarm_mark = (at, max((r.labelled for r in rules.values()), default=0))
            self.monitor.refresh()
        return at

    @property
    def _abstains(self) -> bool:
        """Whether answers abstain from accepting while the drift alarm is on (``HYDRA_DRIFT_POLICY=abstain``)."""
        return self.settings.drift_policy == "abstain"

    def _online(
        self, rule: OnlineRisk, probs: np.ndarray, eligible: list[bool] | None, alarm_at: int | None
    ) -> tuple[list[bool], float | None, str | None]:
        """The online accept rule ``rule`` on ``probs (B, C)``: ``(accepts, its confidence threshold, why it
        abstains)``. Under the drift alarm (policy ``abstain``) it accepts only once labels came back since the alarm
        went on, and only from a copy of the shared state read within :data:`~service.runtime.monitor.STALE_S`
        seconds: a prediction store that is down keeps the answers abstaining."""
        g, mon = self.guarantees, self.monitor
        assert g is not None and g.ranks is not None and mon is not None
        b = probs.shape[0]
        lam = g.ranks.threshold(rule.level)
        if alarm_at is not None and self._abstains:
            since = f"the drift alarm is on since input {alarm_at}"
            if mon.age > STALE_S:
                why = (
                    f"{since}, and the online rule's state could not be read from the prediction store for "
                    f"{mon.age:.0f} s: nothing is accepted until it can"
                )
                return [False] * b, lam, why
            if rule.labelled <= self._alarm_mark[1]:
                why = f"{since}, and no label has come back since: nothing is accepted until labels do"
                return [False] * b, lam, why
        accepts = rule.accepts(g.ranks.rank(probs.max(axis=1)), eligible).tolist()
        return accepts, lam, None

    def _record(
        self,
        scores: list[float] | None,
        p: list[float],
        sets: np.ndarray | None,
        accepted: list[bool] | None,
        risk: float,
        suspended: bool = False,
        withheld: int = 0,
    ) -> None:
        """The drift test fed when no answer reads it (``scores``; None for the server's own warm-up and probe inputs,
        and when :meth:`_alarm_now` fed it already) and the guarantees' metrics: p-values, set sizes, accept
        decisions, answers given while the alarm suspended the guarantees (``withheld`` of them would have been
        accepted)."""
        g = self.guarantees
        if g is None:
            return
        if scores is not None and self.drift is not None:
            self.drift.add(outlier_oriented(np.asarray(scores, dtype=np.float64), g.metric))
        if self.metrics is None:
            return
        p_hist = self._child("ood_p_value")
        for v in p:
            p_hist.observe(v)
        if sets is not None and accepted is not None:
            size_hist = self._child("set_size")
            for n_labels in sets.sum(axis=1).tolist():
                size_hist.observe(n_labels)
            n_acc = sum(accepted)
            if n_acc:
                self._child("selective", str(risk), "true").inc(n_acc)
            if len(accepted) - n_acc:
                self._child("selective", str(risk), "false").inc(len(accepted) - n_acc)
        if suspended:
            if withheld:
                self._child("suspended", "true").inc(withheld)
            if len(p) - withheld:
                self._child("suspended", "false").inc(len(p) - withheld)

    def _child(self, metric: str, *labels: str) -> Any:
        """The metric ``metric`` of this model with the further ``labels`` (prometheus_client's lookup costs
        microseconds a call, so each child is looked up once)."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            assert self.metrics is not None
            child = self._children[key] = getattr(self.metrics, metric).labels(self.name, *labels)
        return child

    def _drift_metrics(self, monitor: DriftMonitor) -> None:
        """The drift gauges and episode counter after the monitor advanced (or was reset)."""
        if self.metrics is not None:
            self._child("drift_alarm").set(1 if monitor.alarm else 0)
            self._child("drift_statistic").set(monitor.log10_statistic)
            self._child("drift_inputs").set(monitor.count)
            started = monitor.episodes_total - self._drift_episodes
            self._child("drift_episodes").inc(started)  # 0 too: the series exists from start-up
            self._drift_episodes += started

    def refresh_drift(self) -> None:
        """Take the buffered inputs into the drift alarm, so that its metrics are those of every input served (a
        ``/metrics`` scrape; fewer than ``DriftFeed.every`` inputs wait there, so this is short)."""
        if self.drift is not None:
            self.drift.flush()

    def reset_drift(self) -> dict[str, Any]:
        """Restart the drift alarm's statistic (after an investigation): an open alarm episode closes, the history and
        the input count go on."""
        if self.drift is None:
            raise InvalidInput(
                f"model {self.name!r} has no drift test (it was built without a calibration split)", status=409
            )
        before = self.drift_state()
        self.drift.reset()
        return {"model": self.name, "before": before, "after": self.drift_state()}

    def drift_state(self) -> dict[str, Any] | None:
        """The drift alarm now (:meth:`service.core.drift.DriftMonitor.state`), every input served included."""
        if self.drift is None:
            return None
        return self.drift.flush().state()

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
            "drift": self.drift_state(),
        }

    def _count(self, results: list[ItemResult]) -> None:
        if self.metrics is not None:
            n_ood = sum(r.ood_flag for r in results)
            if n_ood:
                self.metrics.predictions.labels(self.name, "true").inc(n_ood)
            if len(results) - n_ood:
                self.metrics.predictions.labels(self.name, "false").inc(len(results) - n_ood)
