"""Prometheus metrics of the server (docs/api.md), in a registry of their own per app (tests build many apps)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics", "LATENCY_BUCKETS", "BATCH_BUCKETS", "CONTENT_TYPE_LATEST"]

# seconds: sub-millisecond (tiny models, health checks) to tens of seconds (big batches on CPU)
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# OOD p-values: the usual levels, so a dashboard reads the share below each (on ID traffic: at most the level)
P_VALUE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
SET_SIZE_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 20, 50, 100, 1000)


class Metrics:
    """The server's metrics; ``render()`` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_duration = Histogram(
            "hydra_request_duration_seconds", "HTTP request latency, from first byte in to response sent.",
            ["endpoint", "status"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inference_duration = Histogram(
            "hydra_inference_duration_seconds", "Time of one batch through the model (collate, forward, uncertainty).",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "hydra_batch_size", "Inputs per model forward pass.", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("hydra_queue_depth", "Inputs waiting for a batch.", ["model"], registry=r)
        self.predictions = Counter(
            "hydra_predictions_total", "Predictions answered, by OOD flag.", ["model", "ood"], registry=r
        )
        self.queue_wait = Histogram(
            "hydra_queue_wait_seconds", "Time an input waited before its batch started.", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_errors = Counter(
            "hydra_batch_errors_total", "Model batches that raised (their requests got 500 internal).", ["model"],
            registry=r,
        )  # fmt: skip
        self.model_info = Gauge(
            "hydra_model_info", "Loaded models (value 1) with their version, backend, device and precision.",
            ["model", "version", "family", "task", "backend", "device", "precision"], registry=r,
        )  # fmt: skip
        self.ready = Gauge(
            "hydra_ready", "1 while /readyz answers 200: every model loaded, warmed up and healthy.", registry=r
        )
        self.model_healthy = Gauge(
            "hydra_model_healthy", "0 after HYDRA_UNREADY_AFTER_FAILURES failed batches in a row, until a batch runs.",
            ["model"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("hydra_requests_in_flight", "HTTP requests received and not yet answered.", registry=r)
        # the guarantees (artifacts with a calibration split: docs/api.md "Guarantees")
        self.drift_alarm = Gauge(
            "hydra_drift_alarm", "1 once the drift test has rejected exchangeability with the calibration data "
            "(latched until reset or restart), else 0.", ["model"], registry=r,
        )  # fmt: skip
        self.drift_statistic = Gauge(
            "hydra_drift_statistic", "log10 of the drift test martingale (the alarm fires at log10(1/delta)).",
            ["model"], registry=r,
        )  # fmt: skip
        self.drift_threshold = Gauge(
            "hydra_drift_threshold", "log10(1/delta): the drift statistic's alarm level.", ["model"], registry=r
        )
        self.drift_inputs = Gauge(
            "hydra_drift_inputs", "Inputs the drift test has seen since its start (start-up or reset).", ["model"],
            registry=r,
        )  # fmt: skip
        self.ood_p_value = Histogram(
            "hydra_ood_p_value", "Conformal OOD p-values of served inputs.", ["model"], buckets=P_VALUE_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.set_size = Histogram(
            "hydra_prediction_set_size", "Labels in the conformal prediction sets answered.", ["model"],
            buckets=SET_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.selective = Counter(
            "hydra_selective_total", "Answers with a risk target, by whether the certified rule accepted them.",
            ["model", "risk", "accept"], registry=r,
        )  # fmt: skip
        # registered by the first zero-shot model (service.runtime.zeroshot.text_cache_counter): a server without
        # one does not list it
        self.zero_shot_text_cache: Counter | None = None

    def render(self) -> bytes:
        return generate_latest(self.registry)
