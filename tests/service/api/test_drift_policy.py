"""The drift alarm and the answers (docs/api.md "The drift alarm and the answers", HYDRA_DRIFT_POLICY): while the
alarm is on no answer is certified; with ``abstain`` (the default) nothing is accepted but by the online rule of an
adaptive request, once labels came back since the alarm; ``mark`` answers as without the alarm with the guarantees
marked suspended; ``off`` changes nothing. The Open Inference Protocol and /metrics say the same, the answers resume
when the alarm clears, a store that is down keeps them abstaining, and a bad policy refuses start-up in one line.

A tiny image model serving a Mahalanobis score (test_guarantees_api's drift artifact): white frames are far from its
calibration inputs, so about a dozen of them in a row turn the alarm on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from service.core.artifact import parse_manifest, write_manifest
from service.entrypoints import cli as entry
from service.entrypoints.app import create_app
from service.runtime import monitor as monitor_module
from service.settings import Settings, settings_errors
from service.store import StoreUnavailable
from tests.fixtures.tiny_artifact import TINY_LABELS
from tests.service.api.test_guarantees_api import _drift_artifact, _drift_now, _like_calibration, _metric
from tests.service.helpers import b64, png, settings_for

BLANK = b64(png(255))


@pytest.fixture(scope="module")
def drift_art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _drift_artifact(tmp_path_factory.mktemp("policy") / "vit", "tiny-policy")


def _ok(n: int, seed: int) -> list[str]:
    return [b64(png(a)) for a in _like_calibration(n, seed=seed)]


def _predict(c: TestClient, images: list[str], **options: Any) -> tuple[str, list[dict[str, Any]]]:
    r = c.post("/predict", json={"images": images, **options})
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()["predictions"]


def _turn_on(c: TestClient) -> int:
    """White frames, one per request, until an answer says the alarm is on; the input it went on at."""
    for _ in range(40):
        _, (p,) = _predict(c, [BLANK])
        if p["selective"]["suspended"]:
            state = _drift_now(c)
            assert state["alarm"] is True and p["selective"]["alarm_at"] == state["alarm_at"] == state["inputs"]
            return int(state["alarm_at"])  # the answer that turned it on is the first it suspends
    raise AssertionError("the alarm did not go on within 40 white frames")


def _hold_on(c: TestClient) -> None:
    """More white frames: the statistic at its cap, so that the requests of a test do not clear the alarm."""
    for _ in range(2):
        _predict(c, [BLANK] * 32)
    assert _drift_now(c)["log10_statistic"] > _drift_now(c)["log10_threshold"] + 1.5


def _turn_off(c: TestClient) -> None:
    for k in range(60):
        _predict(c, _ok(32, seed=300 + k))
        if not _drift_now(c)["alarm"]:
            return
    raise AssertionError("the alarm did not clear")


@pytest.fixture
def abstaining(drift_art: Path) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(drift_art))) as c:
        yield c


def test_under_the_alarm_no_answer_is_accepted_or_certified_and_it_resumes_when_it_clears(abstaining):
    c = abstaining
    ok = _ok(32, seed=21)
    _, before = _predict(c, ok)
    assert any(p["selective"]["accept"] for p in before)  # the certified rule accepts some of these
    assert all(p["selective"]["certified"] and not p["selective"]["suspended"] for p in before)
    at = _turn_on(c)
    rid, under = _predict(c, ok)
    for p, b in zip(under, before, strict=True):
        s = p["selective"]
        assert s["accept"] is False and s["certified"] is False and s["suspended"] is True and s["alarm_at"] == at
        assert s["rule"] == "certified" and s["reason"].startswith(f"the drift alarm is on since input {at}")
        assert p["ood"]["suspended"] is True and p["conformal"]["suspended"] is True
        assert p["label"] == b["label"] and p["conformal"]["set"] == b["conformal"]["set"]  # only the decision moved
    text = c.get("/metrics").text
    withheld = sum(b["selective"]["accept"] for b in before)
    assert _metric(text, 'hydra_guarantees_suspended_total{model="tiny-policy",withheld="true"}') >= withheld
    # the Open Inference Protocol says the same
    body = {"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": ok[:2]}]}
    v2 = c.post("/v2/models/tiny-policy/infer", json=body).json()
    outs = {o["name"]: o["data"] for o in v2["outputs"]}
    assert outs["suspended"] == [True, True] and outs["accept"] == [False, False]
    assert v2["parameters"] == {"guarantees_suspended": True, "drift_alarm_at": at}
    _turn_off(c)
    _, after = _predict(c, ok)
    assert [p["selective"]["accept"] for p in after] == [p["selective"]["accept"] for p in before]
    assert all(p["selective"]["certified"] and not p["selective"]["suspended"] for p in after)
    assert all(p["ood"]["suspended"] is False for p in after)
    v2 = c.post("/v2/models/tiny-policy/infer", json=body).json()
    assert "parameters" not in v2 and {o["name"]: o["data"] for o in v2["outputs"]}["suspended"] == [False, False]


@pytest.mark.parametrize("policy", ["mark", "off"])
def test_mark_answers_as_without_the_alarm_and_says_so_off_changes_nothing(drift_art, policy):
    ok = _ok(32, seed=22)
    with TestClient(create_app(settings_for(drift_art, drift_policy="off"))) as reference:
        _, want = _predict(reference, ok)
    with TestClient(create_app(settings_for(drift_art, drift_policy=policy))) as c:
        for _ in range(3):
            _predict(c, [BLANK] * 16)
        assert _drift_now(c)["alarm"] is True
        at = _drift_now(c)["alarm_at"]
        _, got = _predict(c, ok)
        text = c.get("/metrics").text
    assert [p["selective"]["accept"] for p in got] == [p["selective"]["accept"] for p in want]
    for p in got:
        s = p["selective"]
        if policy == "off":
            assert s["suspended"] is False and s["certified"] is True and "alarm_at" not in s
            assert p["ood"]["suspended"] is False
        else:
            assert s["suspended"] is True and s["certified"] is False and s["alarm_at"] == at
            assert s["reason"].startswith(f"the drift alarm is on since input {at}: the certificate does not hold")
            assert p["conformal"]["suspended"] is True
    suspended = 'hydra_guarantees_suspended_total{model="tiny-policy",withheld="false"}'
    assert (suspended in text) == (policy == "mark")


def test_adaptive_requests_accept_under_the_alarm_only_by_the_online_rule_after_labels(drift_art, tmp_path):
    """No label since the alarm: nothing is accepted. Labels for answers given under it: the online rule decides,
    with its threshold in the answer, and the monitor shows the rule the labels moved."""
    with TestClient(create_app(settings_for(drift_art, store=True, state_dir=str(tmp_path)))) as c:
        ok = _ok(12, seed=23)
        _, plain = _predict(c, ok, adaptive=True)
        assert all(p["selective"]["rule"] == "online" and p["selective"]["certified"] for p in plain)
        _turn_on(c)
        _hold_on(c)
        rid, under = _predict(c, ok, adaptive=True)
        for p in under:
            s = p["selective"]
            assert s["accept"] is False and s["rule"] == "online" and s["suspended"] is True
            assert "no label has come back since" in s["reason"]
        labels = [{"id": rid, "index": i, "label": p["label"]} for i, p in enumerate(under)]  # all right
        r = c.post("/v1/models/tiny-policy/feedback", json={"feedback": labels})
        assert [x["status"] for x in r.json()["results"]] == ["accepted"] * len(under)
        _, online = _predict(c, ok, adaptive=True)
        mon = c.get("/v1/models/tiny-policy/monitor").json()
        _, fixed = _predict(c, ok)  # a request without adaptive: still nothing accepted
    rule = mon["online_risk"]["0.5"]
    assert rule["labels_applied"] == len(under) and rule["errors"] == 0
    lam = rule["threshold"]
    assert lam is not None and rule["accepted"] > 0
    for p in online:
        s = p["selective"]
        assert s["rule"] == "online" and s["suspended"] is True and s["threshold"] == pytest.approx(lam)
        eligible = p["ood"]["score"] <= s["ood_threshold"]
        assert s["accept"] == (eligible and p["confidence"] >= lam)
    assert any(p["selective"]["accept"] for p in online)
    assert all(p["selective"]["suspended"] and not p["selective"]["accept"] for p in fixed)
    assert mon["estimate"]["reliable"] is False and mon["estimated_accuracy"] is None
    assert mon["windows"]["recent"]["estimated_accuracy"]["value"] is None
    assert "drift alarm is on" in mon["estimate"]["reason"]


def test_a_store_that_is_down_under_the_alarm_keeps_the_answers_abstaining(drift_art, tmp_path, monkeypatch):
    with TestClient(create_app(settings_for(drift_art, store=True, state_dir=str(tmp_path)))) as c:
        ok = _ok(32, seed=24)
        _turn_on(c)
        _hold_on(c)
        rid, under = _predict(c, ok, adaptive=True)
        labels = [{"id": rid, "index": i, "label": p["label"]} for i, p in enumerate(under)]
        c.post("/v1/models/tiny-policy/feedback", json={"feedback": labels})
        _, online = _predict(c, ok, adaptive=True)
        assert any(p["selective"]["accept"] for p in online)
        rt = c.app.state.hydra.runtimes["tiny-policy"]
        mon = rt.monitor

        def down(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable("the database is down", 1)

        monkeypatch.setattr(mon.store, "get_state", down)
        monkeypatch.setattr(monitor_module, "STALE_S", 0.0)
        monkeypatch.setattr("service.runtime.guarded.STALE_S", 0.0)
        mon._read_at -= 10.0  # the last successful read is old now
        _, stale = _predict(c, ok, adaptive=True)
    for p in stale:
        assert p["selective"]["accept"] is False
        assert "could not be read from the prediction store" in p["selective"]["reason"]


def test_the_answers_of_the_labels_feed_the_online_rule_in_label_order(drift_art, tmp_path):
    """The online rule of each target moved by the labels exactly as :class:`OnlineRisk` applies them by hand."""
    from service.core.online_risk import OnlineRisk

    with TestClient(create_app(settings_for(drift_art, store=True, state_dir=str(tmp_path)))) as c:
        rid, preds = _predict(c, _ok(24, seed=25))
        truth = [TINY_LABELS[i % len(TINY_LABELS)] for i in range(24)]
        r = c.post(
            "/v1/models/tiny-policy/feedback",
            json={"feedback": [{"id": rid, "index": i, "label": y} for i, y in enumerate(truth)]},
        )
        assert r.status_code == 200
        mon = c.get("/v1/models/tiny-policy/monitor").json()
        g = c.app.state.hydra.runtimes["tiny-policy"].guarantees
    conf = np.array([p["confidence"] for p in preds])
    wrong = np.array([p["label"] != y for p, y in zip(preds, truth, strict=True)])
    eligible = g.eligible(np.array([p["ood"]["score"] for p in preds]))
    for key, lam in g.rules.items():
        ref = OnlineRisk.starting_at(key, lam, g.ranks)
        ref.update(g.ranks.rank(conf), wrong, eligible)
        got = mon["online_risk"][str(key)]
        assert (got["accepted"], got["errors"], got["labels_applied"]) == (ref.accepted, ref.errors, 24)
        assert got["level"] == pytest.approx(ref.level)


def test_an_unknown_policy_refuses_start_up_in_one_line(monkeypatch, capsys):
    with pytest.raises(ValidationError) as e:
        Settings(drift_policy="sometimes")
    (line,) = settings_errors(e.value)
    assert line == "HYDRA_DRIFT_POLICY must be one of abstain, mark, off; got 'sometimes'"
    assert Settings(drift_policy=" Mark ").drift_policy == "mark"
    for key in [k for k in __import__("os").environ if k.startswith("HYDRA_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HYDRA_DRIFT_POLICY", "sometimes")
    assert entry.main([]) == entry.EXIT_SETTINGS
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["invalid HYDRA_* settings: HYDRA_DRIFT_POLICY must be one of abstain, mark, off; got 'sometimes'"]


def test_an_artifact_built_before_the_online_rules_keeps_the_certified_rule(tmp_path):
    """No calibration confidences in its guarantees file: adaptive requests get the certified rule (as before the
    online rules), which the alarm suspends as any other; the monitor lists no online rule."""
    art = _drift_artifact(tmp_path / "vit", "tiny-policy")
    tensors = load_file(str(art / "guarantees.safetensors"))
    del tensors["selective.confidences"]
    save_file(tensors, str(art / "guarantees.safetensors"))
    doc = json.loads((art / "manifest.json").read_text())
    doc.pop("files")
    write_manifest(art, parse_manifest(doc))
    with TestClient(create_app(settings_for(art, store=True, state_dir=str(tmp_path / "state")))) as c:
        ok = _ok(12, seed=26)
        _, plain = _predict(c, ok)
        _, adaptive = _predict(c, ok, adaptive=True)
        assert [p["selective"] for p in adaptive] == [p["selective"] for p in plain]
        assert all(p["selective"]["rule"] == "certified" for p in adaptive)
        assert c.get("/v1/models/tiny-policy/monitor").json()["online_risk"] == {}
        _turn_on(c)
        _hold_on(c)
        _, under = _predict(c, ok, adaptive=True)
    assert all(not p["selective"]["accept"] and "drift alarm is on" in p["selective"]["reason"] for p in under)
