"""Request IDs, trace context, structured logs, OpenTelemetry tracing and model versions (docs/api.md, "Request IDs
and tracing", "Logs", "Model versions")."""

from __future__ import annotations

import io
import json
import logging
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from service import settings as settings_module
from service.core.artifact import ArtifactError, artifact_version, load_manifest, parse_manifest, write_manifest
from service.core.jsonlog import json_formatter
from service.entrypoints.app import create_app
from service.logs import RequestContextFilter, configure_logging
from service.settings import Settings
from service.tracing import request_id, trace_id
from tests.service.helpers import assert_error, b64, png, settings_for
from tests.service.test_zeroshot import zs_artifact  # noqa: F401 (the tiny zero-shot artifact fixture)

ROOT = Path(__file__).resolve().parents[2]
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
TEXT = "a sentence the logs must never contain"


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """What the ``hydra`` loggers write, as JSON lines (the handler ``HYDRA_LOG_FORMAT=json`` installs)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(json_formatter())
    handler.addFilter(RequestContextFilter())
    logger = logging.getLogger("hydra")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def lines(out: io.StringIO, logger: str | None = None) -> list[dict]:
    found = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    return [x for x in found if logger is None or x["logger"] == logger]


# ----------------------------------------------------------------------------- request IDs
@pytest.mark.parametrize(
    ("header", "kept"),
    [
        (None, False),
        ("abc-123", True),
        ("req:7/x@y+z=1.2_3", True),
        ("has space", False),
        ("x" * 129, False),
        ("new\nline", False),
        ("", False),
    ],
)
def test_request_id_is_the_clients_when_sane(header: str | None, kept: bool):
    got = request_id(None if header is None else header.encode())
    if kept:
        assert got == header
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", got) and uuid.UUID(got).version == 4


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (TRACEPARENT, TRACE),
        (TRACEPARENT.upper(), None),
        (f"ff-{TRACE}-00f067aa0ba902b7-01", None),
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        ("garbage", None),
        (None, None),
    ],
)
def test_traceparent_trace_id(value: str | None, want: str | None):
    assert trace_id(None if value is None else value.encode()) == want


def test_every_answer_carries_the_request_id(client: TestClient, artifacts: dict[str, Path], monkeypatch):
    r = client.post("/predict", json={"text": "hello there"}, headers={"X-Request-ID": "client-42"})
    assert r.headers["x-request-id"] == "client-42" and r.json()["id"] == "client-42"
    r = client.post("/predict", json={"text": "hello there"})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]) and r.json()["id"] == r.headers["x-request-id"]
    oip = client.post(
        "/v2/models/tiny-bert/infer",
        json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]},
        headers={"X-Request-ID": "oip-1"},
    )
    assert oip.headers["x-request-id"] == "oip-1" and oip.json()["id"] == "oip-1"
    for r in (client.get("/healthz"), client.get("/metrics"), client.get("/nowhere"), client.post("/predict")):
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.status_code
    app = create_app(settings_for(artifacts["vit"], api_key="k", max_body_bytes=1024))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/v1/models", headers={"X-Request-ID": "denied-1"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "denied-1"
        r = c.post("/predict", content=b"x" * 2048, headers={"Authorization": "Bearer k", "X-Request-ID": "big-1"})
        assert r.status_code == 413 and r.headers["x-request-id"] == "big-1"

        def broken(*a, **kw):
            raise ValueError("boom")

        monkeypatch.setattr("service.api.requests.check_limits", broken)
        r = c.post("/predict", json={"image": b64(png(3))}, headers={"Authorization": "Bearer k", "X-Request-ID": "e"})
        assert_error(r, 500, "internal")
        assert r.headers["x-request-id"] == "e"  # answered by the error middleware, still tagged


def test_zero_shot_answers_carry_id_and_version(zs_artifact: Path):  # noqa: F811 (fixture below)
    with TestClient(create_app(settings_for(zs_artifact))) as c:
        r = c.post(
            "/zero-shot",
            json={"image": b64(png(5, mode="RGB")), "labels": ["a", "b"]},
            headers={"X-Request-ID": "zs-1"},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "zs-1" and body["model_version"] == artifact_version(load_manifest(zs_artifact))
        assert list(body)[:3] == ["id", "model", "model_version"]


# ----------------------------------------------------------------------------- logs
def test_json_access_line_per_request(artifacts: dict[str, Path], json_log: io.StringIO):
    app = create_app(settings_for(artifacts["bert"], log_format="json"))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/predict", json={"texts": [TEXT, "fine"]}, headers={"traceparent": TRACEPARENT})
        c.get("/healthz", headers={"X-Request-ID": "probe-1"})
        oip = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["ok"]}]}
        c.post("/v2/models/tiny-bert/infer", json=oip, headers={"X-Request-ID": "oip-2"})
        c.post("/predict", json={"image": "!!"}, headers={"X-Request-ID": "bad-1"})
    access = lines(json_log, "hydra.access")
    assert len(access) == 4, access
    first = access[0]
    version = artifact_version(load_manifest(artifacts["bert"]))
    assert first["level"] == "INFO" and first["message"] == "request" and "time" in first
    assert (first["request_id"], first["trace_id"]) == (r.headers["x-request-id"], TRACE)
    assert (first["method"], first["endpoint"], first["status"]) == ("POST", "/predict", 200)
    assert (first["model"], first["model_version"], first["inputs"]) == ("tiny-bert", version, 2)
    preds = r.json()["predictions"]
    assert first["ood_flagged"] == sum(p["ood"]["flag"] for p in preds)
    assert first["max_mutual_information"] == pytest.approx(max(p["uncertainty"]["mutual_information"] for p in preds))
    assert first["latency_ms"] > 0
    probe = access[1]
    assert (probe["request_id"], probe["endpoint"], probe["status"], probe["trace_id"]) == (
        "probe-1",
        "/healthz",
        200,
        None,
    )
    assert "model" not in probe
    assert (access[2]["endpoint"], access[2]["model"], access[2]["inputs"]) == (
        "/v2/models/{model_name}/infer",
        "tiny-bert",
        1,
    )
    # refused before the model ran (texts sent to an image model... here: no image model at all)
    assert (access[3]["status"], access[3]["request_id"]) == (400, "bad-1") and "model" not in access[3]
    assert TEXT not in json_log.getvalue() and not lines(json_log, "hydra.predictions")


def test_prediction_lines_hold_no_input(artifacts: dict[str, Path], json_log: io.StringIO):
    app = create_app(settings_for(artifacts["bert"], log_format="json", log_predictions=True))
    with TestClient(app) as c:
        r = c.post("/predict", json={"texts": [TEXT, "another one"]}, headers={"X-Request-ID": "p-1"})
    preds = r.json()["predictions"]
    logged = [x for x in lines(json_log, "hydra.predictions") if x["request_id"] == "p-1"]
    assert [x["index"] for x in logged] == [0, 1]
    for x, p in zip(logged, preds, strict=True):
        assert (x["label"], x["ood_flag"], x["model"]) == (p["label"], p["ood"]["flag"], "tiny-bert")
        assert x["confidence"] == pytest.approx(p["confidence"])
        for key in ("msp", "entropy", "expected_entropy", "mutual_information", "disagreement"):
            assert x[key] == pytest.approx(p["uncertainty"][key]), key
        assert x["ood_score"] == pytest.approx(p["ood"]["score"])
    assert TEXT not in json_log.getvalue()


def test_text_logs_keep_the_access_line_at_debug(artifacts: dict[str, Path], caplog: pytest.LogCaptureFixture):
    app = create_app(settings_for(artifacts["bert"], log_level="debug"))
    with caplog.at_level(logging.DEBUG, logger="hydra"), TestClient(app) as c:
        c.post("/predict", json={"text": "hello"}, headers={"X-Request-ID": "t-1"})
    (rec,) = [r for r in caplog.records if r.name == "hydra.access" and getattr(r, "request_id", None) == "t-1"]
    assert rec.levelno == logging.DEBUG and "POST /predict -> 200" in rec.getMessage() and "t-1" in rec.getMessage()


def test_lines_logged_while_answering_carry_the_ids(artifacts, json_log: io.StringIO, monkeypatch):
    def broken(*a, **kw):
        raise ValueError("boom")

    app = create_app(settings_for(artifacts["vit"], log_format="json"))
    with TestClient(app, raise_server_exceptions=False) as c:
        monkeypatch.setattr("service.api.requests.check_limits", broken)
        headers = {"X-Request-ID": "err-1", "traceparent": TRACEPARENT}
        assert c.post("/predict", json={"image": b64(png(1))}, headers=headers).status_code == 500
    (err,) = [x for x in lines(json_log, "hydra.service") if x["message"].startswith("unhandled error")]
    assert (err["level"], err["request_id"], err["trace_id"]) == ("ERROR", "err-1", TRACE)
    assert "ValueError: boom" in err["exc_info"]
    assert all(x["request_id"] is None for x in lines(json_log, "hydra.service") if "warmed up" in x["message"])


def test_configure_logging_json_and_text(capsys: pytest.CaptureFixture):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging(Settings(log_format="json", log_level="info"))
        logging.getLogger("hydra.test").warning("hello %s", "there", extra={"model": "m"})
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert {k: line[k] for k in ("level", "logger", "message", "model")} == {
            "level": "WARNING",
            "logger": "hydra.test",
            "message": "hello there",
            "model": "m",
        }
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", line["time"]) and line["request_id"] is None
        configure_logging(Settings(log_format="TEXT"))
        logging.getLogger("hydra.test").warning("plain")
        assert capsys.readouterr().err.strip().endswith("WARNING hydra.test: plain")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    with pytest.raises(ValidationError):
        Settings(log_format="xml")


# ----------------------------------------------------------------------------- OpenTelemetry
def test_opentelemetry_spans_continue_the_callers_trace(artifacts: dict[str, Path], json_log: io.StringIO):
    pytest.importorskip("opentelemetry.instrumentation.fastapi", reason="pip install 'hydra-serve[otel]'")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.tracing import instrument

    assert getattr(create_app(settings_for(artifacts["bert"], otel=True)), "_is_instrumented_by_opentelemetry", 0)
    assert not getattr(create_app(settings_for(artifacts["bert"])), "_is_instrumented_by_opentelemetry", False)
    app = create_app(settings_for(artifacts["bert"], log_format="json"))
    exporter = InMemorySpanExporter()
    instrument(app, exporter)
    with TestClient(app) as c:
        assert c.post("/predict", json={"text": "hi"}, headers={"traceparent": TRACEPARENT}).status_code == 200
        c.get("/healthz")
        c.post("/predict", json={"text": "hi"}, headers={"X-Request-ID": "own-trace"})
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind.name == "SERVER"]
    assert len(servers) == 2, [s.name for s in spans]  # the probe is not traced
    assert format(servers[0].context.trace_id, "032x") == TRACE and servers[0].attributes["http.route"] == "/predict"
    access = lines(json_log, "hydra.access")
    assert access[0]["trace_id"] == TRACE
    # no traceparent: the trace is the server's span's, and it reaches the logs
    own = next(x for x in access if x["request_id"] == "own-trace")
    assert own["trace_id"] == format(servers[1].context.trace_id, "032x") != TRACE


def test_otel_setting_needs_the_package(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(settings_module, "_installed", lambda module: False)
    with pytest.raises(ValidationError, match=re.escape("pip install 'hydra-serve[otel]'")):
        Settings(otel=True)
    assert Settings(otel=False).otel is False


# ----------------------------------------------------------------------------- model versions
def rewrite(root: Path, **changes) -> None:
    doc = json.loads((root / "manifest.json").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            doc.setdefault(section, {})[field] = value
        else:
            doc[section] = value
    doc.pop("files")
    write_manifest(root, parse_manifest(doc))


def test_version_is_a_hash_of_the_manifest_unless_recorded(artifact_copy):
    root = artifact_copy("bert")
    hashed = artifact_version(load_manifest(root))
    assert re.fullmatch(r"[0-9a-f]{12}", hashed) and artifact_version(load_manifest(root)) == hashed
    rewrite(root, uncertainty__ood_threshold=0.3)  # what the model answers changed: another version
    assert artifact_version(load_manifest(root)) != hashed
    rewrite(root, build__version="2025.06.1")
    assert artifact_version(load_manifest(root)) == "2025.06.1"
    rewrite(root, version="v7")  # the top-level field wins
    assert artifact_version(load_manifest(root)) == "v7"
    with pytest.raises(ArtifactError, match="manifest field version"):
        rewrite(root, version="has space")
    m = load_manifest(root)
    bad = m.model_copy(update={"version": None, "build": {**(m.build or {}), "version": "a/b"}})
    with pytest.raises(ArtifactError, match="build.version 'a/b' is not a version"):
        artifact_version(bad)


def test_version_everywhere(artifact_copy):
    root = artifact_copy("bert")
    rewrite(root, version="2.1.0")
    with TestClient(create_app(settings_for(root))) as c:
        assert c.get("/v1/models").json()["models"][0]["version"] == "2.1.0"
        assert c.post("/predict", json={"text": "hi"}).json()["model_version"] == "2.1.0"
        assert c.get("/v2/models/tiny-bert").json()["versions"] == ["2.1.0"]
        assert c.get("/v2/models/tiny-bert/versions/2.1.0/ready").status_code == 200
        metrics = c.get("/metrics").text
    (info,) = [f for f in text_string_to_metric_families(metrics) if f.name == "hydra_model_info"]
    (sample,) = info.samples
    assert sample.value == 1 and sample.labels["version"] == "2.1.0" and sample.labels["model"] == "tiny-bert"
    assert {"model", "version", "family", "backend", "precision"} <= set(sample.labels)


def test_a_bad_recorded_version_refuses_start(artifact_copy):
    root = artifact_copy("vit")
    rewrite(root, build__version="not ok!")
    with pytest.raises(Exception, match="build.version 'not ok!' is not a version"):
        with TestClient(create_app(settings_for(root))):
            pass


# ----------------------------------------------------------------------------- docs
def test_every_setting_is_documented():
    doc = (ROOT / "docs" / "api.md").read_text()
    table = {m for m in re.findall(r"^\| `(HYDRA_[A-Z_]+)` \|", doc, re.M)}
    fields = {f"HYDRA_{name.upper()}" for name in Settings.model_fields}
    assert fields == table, f"undocumented: {sorted(fields - table)}; not settings: {sorted(table - fields)}"
    for name in ("/v2/models/{name}/infer", "X-Request-ID", "traceparent", "model_version", "hydra_model_info"):
        assert name in doc, name
