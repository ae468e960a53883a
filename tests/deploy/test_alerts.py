"""The PrometheusRule: every expression parses as PromQL and uses only metrics and labels the server exports.

Metric names and labels come from the server's registry (`service.metrics.Metrics`) when it is importable,
else from docs/api.md (metrics). Annotation templates may only name labels the expression keeps.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

from tests.deploy.helpers import DEPLOY, kustomize, one

# docs/api.md (metrics): metric -> (type, labels). The server may export more; never fewer.
CONTRACT_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "hydra_request_duration_seconds": ("histogram", frozenset({"endpoint", "status"})),
    "hydra_inference_duration_seconds": ("histogram", frozenset({"model"})),
    "hydra_batch_size": ("histogram", frozenset({"model"})),
    "hydra_queue_depth": ("gauge", frozenset({"model"})),
    "hydra_predictions_total": ("counter", frozenset({"model", "ood"})),
}
# Added with the feedback API (docs/monitoring.md): the alerts and the dashboard use them. Until the server's
# registry has them they count as exported; once it has any, it must have them all, as listed here
# (test_feedback_metrics_once_exported_are_as_listed).
FEEDBACK_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "hydra_feedback_total": ("counter", frozenset({"model", "status"})),
    "hydra_live_quality": ("gauge", frozenset({"model", "figure", "window", "bound"})),
    "hydra_labelled_predictions": ("gauge", frozenset({"model"})),
    "hydra_coverage_target": ("gauge", frozenset({"model"})),
    "hydra_adaptive_alpha": ("gauge", frozenset({"model"})),
    "hydra_harmful_shift_alarm": ("gauge", frozenset({"model"})),
    "hydra_harmful_shift_statistic": ("gauge", frozenset({"model"})),
    "hydra_store_records": ("gauge", frozenset({"outcome"})),
    "hydra_store_up": ("gauge", frozenset()),
}
# Labels Prometheus adds to every scraped series (ServiceMonitor target labels), plus `up`.
TARGET_LABELS = frozenset({"namespace", "pod", "service", "job", "instance", "endpoint", "container"})
SCRAPE_SERIES = {"up": frozenset()}
EQUAL = "MatchOp.Equal"  # promql_parser's name of the `=` matcher
INFERENCE_ENDPOINTS = {
    "/predict",
    "/zero-shot",
    "/v2/models/{model_name}/infer",
    "/v2/models/{model_name}/versions/{model_version}/infer",
}


def server_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Metric name (as written in PromQL: counters with _total) -> (type, label names) of the running server."""
    try:
        from service.metrics import Metrics
    except ImportError:
        return dict(CONTRACT_METRICS)
    out = {}
    for value in vars(Metrics()).values():
        if hasattr(value, "_labelnames") and hasattr(value, "_type"):
            name = value._name + ("_total" if value._type == "counter" else "")
            out[name] = (value._type, frozenset(value._labelnames))
    return out


def exported_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """:func:`server_metrics`, plus :data:`FEEDBACK_METRICS` where the server does not have them yet."""
    return {**FEEDBACK_METRICS, **server_metrics()}


def test_feedback_metrics_once_exported_are_as_listed() -> None:
    metrics = server_metrics()
    there = FEEDBACK_METRICS.keys() & metrics.keys()
    assert there in (set(), FEEDBACK_METRICS.keys()), f"only {sorted(there)} of the feedback metrics are exported"
    for name in there:
        assert metrics[name] == FEEDBACK_METRICS[name], (name, metrics[name])


def test_server_exports_the_contract_metrics() -> None:
    metrics = server_metrics()
    for name, (kind, labels) in CONTRACT_METRICS.items():
        assert name in metrics, f"{name} is not exported"
        assert metrics[name] == (kind, labels), (name, metrics[name])


@functools.cache
def _rules() -> tuple[dict[str, Any], ...]:
    rule = one(kustomize(DEPLOY / "base"), "PrometheusRule")
    return tuple(r for group in rule["spec"]["groups"] for r in group["rules"])


def _pp() -> Any:
    return pytest.importorskip("promql_parser", reason="pip install promql-parser==0.11.0 (dev extra)")


def _selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, op, value)]) of every vector selector in ``expr``."""
    pp = _pp()
    found: list[tuple[str, list[tuple[str, str, str]]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, pp.VectorSelector):
            found.append((node.name, [(m.name, str(m.op), m.value) for m in node.matchers.matchers]))

    pp.walk(pp.parse(expr), visit)
    return found


def _output_labels(node: Any, records: dict[str, str]) -> frozenset[str] | None:
    """Labels an expression's result keeps, when known (None: every label of the input series)."""
    pp = _pp()
    if isinstance(node, pp.ParenExpr):
        return _output_labels(node.expr, records)
    if isinstance(node, pp.NumberLiteral):
        return frozenset()
    if isinstance(node, pp.AggregateExpr):
        if node.modifier is None:
            return frozenset()
        if node.modifier.type == pp.AggModifierType.By:
            return frozenset(node.modifier.labels)
        return None
    if isinstance(node, pp.Call):
        vectors = [a for a in node.args if not isinstance(a, (pp.NumberLiteral, pp.StringLiteral))]
        labels = _output_labels(vectors[0], records) if vectors else frozenset()
        if node.func.name == "histogram_quantile" and labels is not None:
            labels = labels - {"le"}
        return labels
    if isinstance(node, pp.MatrixSelector):
        return _output_labels(node.vector_selector, records)
    if isinstance(node, pp.BinaryExpr):
        if isinstance(node.lhs, pp.NumberLiteral):
            return _output_labels(node.rhs, records)
        return _output_labels(node.lhs, records)
    if isinstance(node, pp.VectorSelector):
        return _output_labels(pp.parse(records[node.name]), records) if node.name in records else None
    return None


def test_every_expression_parses() -> None:
    pp = _pp()
    for rule in _rules():
        pp.parse(str(rule["expr"]))  # raises ValueError with the position of a syntax error
    with pytest.raises(ValueError):
        pp.parse("sum(rate(hydra_predictions_total[5m])")


def test_expressions_use_only_exported_metrics_and_labels() -> None:
    metrics = exported_metrics()
    records = {r["record"] for r in _rules() if "record" in r}
    for rule in _rules():
        name = rule.get("alert") or rule["record"]
        for metric, matchers in _selectors(str(rule["expr"])):
            if metric in records:
                assert not matchers or {m[0] for m in matchers} <= {"namespace", "endpoint"}, name
                continue
            if metric in SCRAPE_SERIES:
                assert {m[0] for m in matchers} <= TARGET_LABELS, name
                continue
            base = re.sub(r"_(bucket|count|sum)$", "", metric)
            assert metric in metrics or (base in metrics and metrics[base][0] == "histogram"), (
                f"{name}: {metric} is not a metric of the server ({sorted(metrics)})"
            )
            labels = (
                metrics.get(metric, metrics.get(base))[1]
                | TARGET_LABELS
                | ({"le"} if metric.endswith("_bucket") else set())
            )
            for label, _, value in matchers:
                assert label in labels, f"{name}: {metric} has no label {label!r}"
                if label == "endpoint" and metric.startswith("hydra_request_duration"):
                    assert set(value.split("|")) <= INFERENCE_ENDPOINTS, f"{name}: endpoint {value!r}"


def test_annotations_name_only_labels_the_expression_keeps() -> None:
    records = {r["record"]: str(r["expr"]) for r in _rules() if "record" in r}
    for rule in _rules():
        if "alert" not in rule:
            continue
        kept = _output_labels(_pp().parse(str(rule["expr"])), records)
        used = set(re.findall(r"\$labels\.([a-zA-Z_]+)", " ".join(rule["annotations"].values())))
        if kept is not None:
            assert used <= kept, (
                f"{rule['alert']}: annotations use {sorted(used - kept)}, expression keeps {sorted(kept)}"
            )


def test_output_labels_known_answers() -> None:
    pp = _pp()
    assert _output_labels(pp.parse('sum by (a, le) (rate(x_bucket{e="1"}[5m]))'), {}) == {"a", "le"}
    q = "histogram_quantile(0.99, sum by (a, le) (rate(x_bucket[5m]))) > 2"
    assert _output_labels(pp.parse(q), {}) == {"a"}
    assert _output_labels(pp.parse("sum(x) / sum(y) > 0.1"), {}) == frozenset()
    assert _output_labels(pp.parse("r > 1"), {"r": "sum by (b) (x)"}) == {"b"}
    assert _output_labels(pp.parse("up == 0"), {}) is None


def test_the_issue_alerts_exist() -> None:
    """p99 latency, OOD rate and overload (503) alerts, on the metrics the issue names."""
    rules = _rules()
    records = {r["record"]: str(r["expr"]) for r in rules if "record" in r}
    exprs = {r["alert"]: str(r["expr"]) for r in rules if "alert" in r}

    def expanded(expr: str) -> str:
        for name, body in records.items():
            expr = expr.replace(name, f"({body})")
        return expr

    def selectors(alert: str) -> list[tuple[str, dict[str, str]]]:
        return [(m, {k: v for k, _, v in ms}) for m, ms in _selectors(expanded(exprs[alert]))]

    latency = selectors("HydraServeLatencyP99High")
    assert "histogram_quantile(0.99" in expanded(exprs["HydraServeLatencyP99High"]).replace(" ", "")
    assert [m for m, _ in latency] == ["hydra_request_duration_seconds_bucket"]
    ood = selectors("HydraServeOODRateHigh")
    assert ("hydra_predictions_total", {"ood": "true"}) in ood and ("hydra_predictions_total", {}) in ood
    overload = selectors("HydraServeOverloaded")
    assert any(m == "hydra_request_duration_seconds_count" and lab.get("status") == "503" for m, lab in overload)
    # every inference route counts, the Open Inference Protocol's too
    for alert in ("HydraServeLatencyP99High", "HydraServeOverloaded"):
        for _, labels in selectors(alert):
            assert set(labels["endpoint"].split("|")) == INFERENCE_ENDPOINTS, alert


def test_the_feedback_alerts_exist() -> None:
    """The harmful-shift alarm, and the recent label-free accuracy estimate's upper bound under a floor."""
    rules = {r["alert"]: r for r in _rules() if "alert" in r}
    shift = rules["HydraServeHarmfulShift"]
    assert [m for m, _ in _selectors(str(shift["expr"]))] == ["hydra_harmful_shift_alarm"]
    assert str(shift["expr"]).replace(" ", "").endswith("==1")
    low = rules["HydraServeEstimatedAccuracyLow"]
    ((metric, matchers),) = _selectors(str(low["expr"]))
    want = {("figure", "estimated_accuracy"), ("window", "recent"), ("bound", "high")}
    assert metric == "hydra_live_quality" and {(k, v) for k, op, v in matchers if op == EQUAL} == want
    node = _pp().parse(str(low["expr"]))  # (aggregate) < floor
    assert str(node.op) == "<" and isinstance(node.rhs, _pp().NumberLiteral) and 0 < node.rhs.val < 1


def test_inference_endpoints_are_the_servers_routes() -> None:
    try:
        from service.entrypoints.app import app
    except ImportError as e:
        pytest.skip(f"service.entrypoints.app not importable ({e})")
    paths = {getattr(r, "path", None) for r in app.routes if "POST" in getattr(r, "methods", ())}
    paths.discard("/v1/models/{model_name}/drift/reset")  # an operator's call after an investigation, not inference
    paths.discard("/v1/models/{model_name}/feedback")  # labels for answers given (the feedback API), not inference
    assert INFERENCE_ENDPOINTS == paths, paths
