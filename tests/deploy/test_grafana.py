"""The Grafana dashboard (deploy/grafana/hydra-serve.json): a valid dashboard whose every query parses as PromQL and
names only metrics and labels the server exports (``service.metrics.SPECS``), and the ConfigMap that ships it.

Metrics added with the feedback API count as exported while ``SPECS`` lacks them: they are
``tests.deploy.test_alerts.FEEDBACK_METRICS``, which must all be in ``SPECS`` as soon as any is.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import pytest
from prometheus_client import Counter, Histogram

from service.metrics import SPECS
from tests.deploy.helpers import DEPLOY, kustomize, one
from tests.deploy.test_alerts import FEEDBACK_METRICS, SCRAPE_SERIES, TARGET_LABELS, _selectors

DASHBOARD = DEPLOY / "grafana" / "hydra-serve.json"
# Grafana's interval variables, replaced by a duration before parsing (PromQL has no variables)
GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "6h"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODEL_QUERY = "label_values(hydra_model_info, model)"
# the values of the feedback metrics' enumerated labels (the feedback API's fixed names)
LABEL_VALUES = {
    "figure": {"accuracy", "coverage", "accepted_error", "ood_precision", "ood_recall", "estimated_accuracy"},
    "window": {"recent", "all"},
    "bound": {"value", "low", "high"},
    "outcome": {"written", "queued", "dropped_full", "dropped_error", "dropped_closed"},
    "status": {"accepted", "duplicate", "unknown_id", "invalid_label"},
    "ood": {"true", "false"},
}


def spec_series() -> dict[str, frozenset[str]]:
    """Every series name the server exports (``SPECS``, as Prometheus writes them) -> its label names."""
    out: dict[str, frozenset[str]] = {}
    for spec in SPECS.values():
        labels = frozenset(spec.labels)
        if spec.kind is Counter:
            out[spec.name.removesuffix("_total") + "_total"] = labels
        elif spec.kind is Histogram:
            out |= {spec.name + "_bucket": labels | {"le"}, spec.name + "_sum": labels, spec.name + "_count": labels}
        else:
            out[spec.name] = labels
    return out


def exported_series() -> dict[str, frozenset[str]]:
    """:func:`spec_series`, the feedback API's metrics where ``SPECS`` lacks them yet, and Prometheus' ``up``."""
    feedback = {name: labels for name, (_, labels) in FEEDBACK_METRICS.items()}
    return {**feedback, **SCRAPE_SERIES, **spec_series()}


@functools.cache
def _dashboard_text() -> str:
    return DASHBOARD.read_text()


def dashboard() -> dict[str, Any]:
    return json.loads(_dashboard_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included, in order."""
    out = []
    for p in dash["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def promql(expr: str) -> str:
    """A panel's query as PromQL: Grafana's interval variables replaced by durations."""
    for var, duration in GRAFANA_RANGES.items():
        expr = expr.replace(var, duration).replace("${" + var[1:] + "}", duration)
    return expr


def query_problems(dash: dict[str, Any]) -> list[str]:
    """What is wrong with the dashboard's queries: a query that does not parse, a metric the server does not export,
    a label it does not have, a value outside a label's fixed values."""
    series, problems = exported_series(), []
    for p in panels(dash):
        for t in p.get("targets", []):
            where = f"panel {p.get('id')} ({p.get('title')!r}) {t.get('refId')}"
            try:
                found = _selectors(promql(t["expr"]))
            except ValueError as e:
                problems.append(f"{where}: does not parse: {e}")
                continue
            for metric, matchers in found:
                if metric not in series:
                    problems.append(f"{where}: {metric} is not a metric of the server")
                    continue
                for label, _, value in matchers:
                    if label not in series[metric] | TARGET_LABELS:
                        problems.append(f"{where}: {metric} has no label {label!r}")
                    elif label in LABEL_VALUES and not set(value.split("|")) <= LABEL_VALUES[label]:
                        problems.append(f"{where}: {metric}{{{label}}} has no value {value!r}")
    return problems


def test_the_feedback_metrics_are_in_specs_as_soon_as_any_is() -> None:
    names = {n: n.removesuffix("_total") if FEEDBACK_METRICS[n][0] == "counter" else n for n in FEEDBACK_METRICS}
    spec_names = {spec.name.removesuffix("_total") for spec in SPECS.values()}
    there = {n for n, base in names.items() if base in spec_names}
    assert there in (set(), set(FEEDBACK_METRICS)), f"only {sorted(there)} of the feedback metrics are in SPECS"
    series = spec_series()
    for name in there:
        assert series[name] == FEEDBACK_METRICS[name][1], (name, series[name])


def test_is_a_grafana_dashboard() -> None:
    dash = dashboard()
    assert dash["title"] and dash["uid"] == "hydra-serve" and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    assert model["query"]["query"] == model["definition"] == MODEL_QUERY
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t.get("datasource", DATASOURCE) == DATASOURCE, (p["title"], t)


def test_every_query_names_exported_metrics_and_labels() -> None:
    assert query_problems(dashboard()) == []
    found = re.fullmatch(r"label_values\((\w+), (\w+)\)", MODEL_QUERY)  # the model variable's query
    assert found is not None and found[2] in spec_series()[found[1]]


@pytest.mark.parametrize(
    "expr, problem",
    [
        ('rate(hydra_predictions_total{model=~"$model"}[$__rate_interval]', "does not parse"),
        ('hydra_drift_alarms{model=~"$model"}', "not a metric of the server"),
        ('sum(hydra_store_records{model=~"$model"})', "has no label 'model'"),
        ('hydra_live_quality{figure="precision"}', "has no value 'precision'"),
        ('rate(hydra_inference_duration_seconds_bucket{le="0.1"}[5m])', None),
    ],
)
def test_the_check_catches_mistakes(expr: str, problem: str | None) -> None:
    dash = copy.deepcopy(dashboard())
    next(p for p in dash["panels"] if p["type"] != "row")["targets"][0]["expr"] = expr
    problems = query_problems(dash)
    assert (problem is None and not problems) or (len(problems) == 1 and problem in problems[0]), problems


def test_the_issue_panels_are_there() -> None:
    """Latency p50 and p99, throughput, the OOD rate, drift, live quality, both alarms, feedback and the store."""
    exprs = [promql(t["expr"]) for p in panels(dashboard()) for t in p.get("targets", [])]
    used = {(m, frozenset((k, v) for k, _, v in ms)) for e in exprs for m, ms in _selectors(e)}
    metrics = {m for m, _ in used}
    assert metrics >= {
        "hydra_request_duration_seconds_bucket",
        "hydra_predictions_total",
        "hydra_drift_statistic",
        "hydra_drift_threshold",
        "hydra_drift_alarm",
        "hydra_drift_episodes_total",
        "hydra_harmful_shift_alarm",
        "hydra_harmful_shift_statistic",
        "hydra_coverage_target",
        "hydra_adaptive_alpha",
        "hydra_labelled_predictions",
        "hydra_feedback_total",
        "hydra_store_records",
        "hydra_store_up",
    }, sorted(metrics)
    quantiles = {float(q) for e in exprs for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)}
    assert quantiles >= {0.5, 0.99}
    assert ("hydra_predictions_total", frozenset({("model", "$model"), ("ood", "true")})) in used  # the OOD rate
    figures = set()
    for m, labels in used:
        if m == "hydra_live_quality":
            figures |= set(dict(labels)["figure"].split("|"))
    assert figures == LABEL_VALUES["figure"]


def test_the_configmap_ships_the_dashboard() -> None:
    cm = one(kustomize(DEPLOY / "grafana"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's dashboard sidecar looks for
    assert cm["metadata"]["name"] == "hydra-serve-dashboard"  # no hash suffix: a new version replaces the old
    assert json.loads(cm["data"]["hydra-serve.json"]) == dashboard()
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    kv.validate(cm, "1.30.0", strict=True)
