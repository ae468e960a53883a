"""Prometheus metrics of the server (docs/api.md), in a registry of their own per app (tests build many apps).

Every metric is one row of :data:`SPECS` (its attribute on :class:`Metrics`, type, name, help text, labels,
buckets, and for a gauge how several workers' values combine); :class:`Metrics` registers them in that order.

With several workers (``HYDRA_WORKERS``; :mod:`service.entrypoints.workers`) the supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` before a worker imports prometheus_client, whose multiprocess mode then keeps every value
in files there, and :meth:`Metrics.render` of any worker gives one view of all of them: counters and histograms summed
over the workers (those that died included: counts only grow), each gauge combined as its ``mode`` says over the live
workers (a queue depth summed, an alarm the largest, readiness the smallest). Counters then have no ``_created`` series.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["BATCH_BUCKETS", "CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "SPECS", "Metrics"]

# seconds: sub-millisecond (tiny models, health checks) to tens of seconds (big batches on CPU)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# OOD p-values: the usual levels, so a dashboard reads the share below each (on ID traffic: at most the level)
P_VALUE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
SET_SIZE_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 20, 50, 100, 1000)


@dataclass(frozen=True)
class Spec:
    """One metric: its type, name, help text, label names and (histograms) bucket bounds."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    mode: str = "livemax"  # a gauge's combination over several workers (prometheus_client's multiprocess_mode)


MODEL = ("model",)
# the attribute of each metric on Metrics -> what it is, in the order they are registered (and rendered)
SPECS: dict[str, Spec] = {
    "request_duration": Spec(
        Histogram,
        "hydra_request_duration_seconds",
        "HTTP request latency, from first byte in to response sent.",
        ("endpoint", "status"),
        LATENCY_BUCKETS,
    ),
    "inference_duration": Spec(
        Histogram,
        "hydra_inference_duration_seconds",
        "Time of one batch through the model (collate, forward, uncertainty).",
        MODEL,
        LATENCY_BUCKETS,
    ),
    "batch_size": Spec(Histogram, "hydra_batch_size", "Inputs per model forward pass.", MODEL, BATCH_BUCKETS),
    "queue_depth": Spec(Gauge, "hydra_queue_depth", "Inputs waiting for a batch.", MODEL, mode="livesum"),
    "predictions": Spec(Counter, "hydra_predictions_total", "Predictions answered, by OOD flag.", ("model", "ood")),
    "queue_wait": Spec(
        Histogram, "hydra_queue_wait_seconds", "Time an input waited before its batch started.", MODEL, LATENCY_BUCKETS
    ),
    "batch_errors": Spec(
        Counter, "hydra_batch_errors_total", "Model batches that raised (their requests got 500 internal).", MODEL
    ),
    "model_info": Spec(
        Gauge,
        "hydra_model_info",
        "Loaded models (value 1) with their version, backend, device and precision.",
        ("model", "version", "family", "task", "backend", "device", "precision"),
    ),
    "ready": Spec(
        Gauge, "hydra_ready", "1 while /readyz answers 200: every model loaded, warmed up and healthy.", mode="livemin"
    ),
    "model_healthy": Spec(
        Gauge,
        "hydra_model_healthy",
        "0 after HYDRA_UNREADY_AFTER_FAILURES failed batches in a row, until a batch runs.",
        MODEL,
        mode="livemin",
    ),
    "in_flight": Spec(
        Gauge, "hydra_requests_in_flight", "HTTP requests received and not yet answered.", mode="livesum"
    ),
    # the guarantees (artifacts with a calibration split: docs/api.md "Guarantees")
    "drift_alarm": Spec(
        Gauge,
        "hydra_drift_alarm",
        "1 while the drift alarm is on: the statistic reached the alarm level and has not fallen below 1 since "
        "(it clears by itself once traffic is back to normal), else 0.",
        MODEL,
        mode="livemostrecent",  # one alarm shared by the workers: the value last read of it
    ),
    "drift_statistic": Spec(
        Gauge,
        "hydra_drift_statistic",
        "log10 of the drift alarm's CUSUM statistic (on at hydra_drift_threshold, off below 0).",
        MODEL,
        mode="livemostrecent",
    ),
    "drift_threshold": Spec(
        Gauge,
        "hydra_drift_threshold",
        "log10 A: the drift statistic's alarm level (A inputs: the least mean run length to a false alarm).",
        MODEL,
    ),
    "drift_inputs": Spec(
        Gauge, "hydra_drift_inputs", "Inputs the drift alarm has seen since start-up.", MODEL, mode="livemostrecent"
    ),
    "drift_episodes": Spec(
        Counter, "hydra_drift_episodes", "Drift alarm episodes started (the alarm going on) since start-up.", MODEL
    ),
    "drift_recalled": Spec(
        Counter,
        "hydra_drift_recalled",
        "Answers recalled when the drift alarm went on (given between the estimated start of the shift and the "
        "alarm), by whether they were accepted.",
        ("model", "accepted"),
    ),
    "ood_p_value": Spec(
        Histogram, "hydra_ood_p_value", "Conformal OOD p-values of served inputs.", MODEL, P_VALUE_BUCKETS
    ),
    "set_size": Spec(
        Histogram,
        "hydra_prediction_set_size",
        "Labels in the conformal prediction sets answered.",
        MODEL,
        SET_SIZE_BUCKETS,
    ),
    "selective": Spec(
        Counter,
        "hydra_selective_total",
        "Answers with a risk target, by whether the certified rule accepted them.",
        ("model", "risk", "accept"),
    ),
    "suspended": Spec(
        Counter,
        "hydra_guarantees_suspended_total",
        "Answers given while the drift alarm suspended the guarantees (HYDRA_DRIFT_POLICY abstain or mark), by "
        "whether the certified rule's accept was withheld (abstain: it would have accepted, the answer did not).",
        ("model", "withheld"),
    ),
    # live quality from the feedback labels (docs/monitoring.md; docs/api.md "Feedback and live quality")
    "feedback": Spec(Counter, "hydra_feedback_total", "Feedback items received, by their status.", ("model", "status")),
    "live_quality": Spec(
        Gauge,
        "hydra_live_quality",
        "Live quality figures: realised accuracy, coverage, error among accepted answers, the OOD flag's precision "
        "and recall (labelled answers), label-free estimated accuracy (served answers); over the recent window or "
        "all, as the value and its 95 % interval bounds (NaN: no answer yet).",
        ("model", "figure", "window", "bound"),
    ),
    "labelled_predictions": Spec(
        Gauge, "hydra_labelled_predictions", "Predictions labelled by feedback and applied to the monitor.", MODEL
    ),
    "coverage_target": Spec(
        Gauge, "hydra_coverage_target", "1 - alpha: the coverage the default prediction sets promise.", MODEL
    ),
    "adaptive_alpha": Spec(
        Gauge, "hydra_adaptive_alpha", "alpha_t: the level the adaptive (online) prediction sets are built at.", MODEL
    ),
    "harmful_shift_alarm": Spec(
        Gauge,
        "hydra_harmful_shift_alarm",
        "1 once the harmful-shift test found the labelled answers' risk above the source risk plus its tolerance.",
        MODEL,
    ),
    "harmful_shift_statistic": Spec(
        Gauge,
        "hydra_harmful_shift_statistic",
        "log10 of the harmful-shift test's capital (the alarm fires at log10(1 / delta_test)).",
        MODEL,
    ),
    "store_records": Spec(
        Gauge,
        "hydra_store_records",
        "Prediction records of the store's writer since start-up: written, queued now, or dropped (queue full, "
        "database error, store closed).",
        ("outcome",),
        mode="livesum",
    ),
    "store_up": Spec(
        Gauge, "hydra_store_up", "1 while the prediction store's last database operation succeeded.", mode="livemin"
    ),
}


class Metrics:
    """The server's metrics, one attribute per row of :data:`SPECS`; ``render()`` gives the Prometheus text format."""

    request_duration: Histogram
    inference_duration: Histogram
    batch_size: Histogram
    queue_depth: Gauge
    predictions: Counter
    queue_wait: Histogram
    batch_errors: Counter
    model_info: Gauge
    ready: Gauge
    model_healthy: Gauge
    in_flight: Gauge
    drift_alarm: Gauge
    drift_statistic: Gauge
    drift_threshold: Gauge
    drift_inputs: Gauge
    drift_episodes: Counter
    drift_recalled: Counter
    ood_p_value: Histogram
    set_size: Histogram
    selective: Counter
    suspended: Counter
    feedback: Counter
    live_quality: Gauge
    labelled_predictions: Gauge
    coverage_target: Gauge
    adaptive_alpha: Gauge
    harmful_shift_alarm: Gauge
    harmful_shift_statistic: Gauge
    store_records: Gauge
    store_up: Gauge

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for attr, spec in SPECS.items():
            extra: dict[str, Any] = {} if spec.buckets is None else {"buckets": spec.buckets}
            if spec.kind is Gauge:
                extra["multiprocess_mode"] = spec.mode
            setattr(self, attr, spec.kind(spec.name, spec.help, spec.labels, registry=self.registry, **extra))
        # the HTTP requests in flight in this process now (the gauge's value, readable without its lock): the batcher
        # runs a lone request at once (service.runtime.batching)
        self.requests_in_flight = 0
        # registered by the first zero-shot model (service.runtime.zeroshot.text_cache_counter): a server without
        # one does not list it
        self.zero_shot_text_cache: Counter | None = None

    def render(self) -> bytes:
        """The Prometheus text: this process's metrics, or with several workers every worker's (module docstring)."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not path:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        return generate_latest(registry)
