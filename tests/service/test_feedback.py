"""The feedback loop through the real app (docs/api.md "Feedback and live quality"): predict -> feedback with the
answer's X-Request-ID -> every status, the monitor's figures against a by-hand computation from the answers and
labels sent, /metrics, a restart on the same store, the adaptive sets' known answer, their guarantee on an
adversarial stream, and the refusals (one line, no 5xx). A tiny random image model with guarantees (300
calibration inputs), the store in a tmp SQLite file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from service.core.conformal import SetCalibrator
from service.core.online import AdaptiveConformal, HarmfulShiftAlarm, raw_misses, wilson_interval
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS, make_tiny_artifact
from tests.service.helpers import assert_error, b64, noise_images, png, settings_for

RISKS = {"risks": [0.05, 0.5], "risk": 0.5}  # as test_guarantees_api: 0.5 is certifiable on the tiny model
CAL_ERRORS = 100  # the calibration split's wrong answers (1 in 3 of its 300 labels: the fixture's make-up)
NAME = "tiny-fb"


def artifact(root: Path, errors: int | None = CAL_ERRORS) -> Path:
    """The tiny model with guarantees; ``errors`` written into ``guarantees.calibration`` in place of the builder's
    count (None: left out, as artifacts built before the builder recorded it)."""
    art = make_tiny_artifact(root, "vit", name=NAME, guarantees=RISKS, ood_threshold=0.3)
    path = art / "manifest.json"
    doc = json.loads(path.read_text())
    if errors is None:
        doc["guarantees"]["calibration"].pop("errors", None)
    else:
        doc["guarantees"]["calibration"]["errors"] = errors
    path.write_text(json.dumps(doc, indent=2))
    return art


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return artifact(tmp_path_factory.mktemp("fb") / "vit")


def client(art: Path, state: Path, **overrides: Any) -> TestClient:
    return TestClient(create_app(settings_for(art, store=True, state_dir=str(state), **overrides)))


def predict(c: TestClient, n: int, seed: int, **options: Any) -> tuple[str, list[dict[str, Any]]]:
    """One answer of ``n`` noise images: its X-Request-ID and predictions (every label's probability)."""
    images = [b64(png(a)) for a in noise_images(n, seed=seed)]
    r = c.post("/predict", json={"images": images, "top_k": len(TINY_LABELS), **options})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == r.json()["id"]
    return r.headers["x-request-id"], r.json()["predictions"]


def send(c: TestClient, items: list[tuple[str, int, Any]], **kw: Any) -> list[str]:
    r = c.post(f"/v1/models/{NAME}/feedback", json={"feedback": [dict(id=i, index=j, label=y) for i, j, y in items]})
    assert r.status_code == 200, r.text
    return [x["status"] for x in r.json()["results"]]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name{labels}`` in a Prometheus text answer (labels in any order)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    found = []
    for ln in text.splitlines():
        head, _, value = ln.rpartition(" ")
        base, _, inner = head.partition("{")
        if base == name and set(filter(None, inner.rstrip("}").split(","))) == want:
            found.append(float(value))
    (value,) = found
    return value


def test_every_status_and_the_monitor_equals_a_computation_by_hand(art: Path, tmp_path: Path) -> None:
    """Labels for 12 answers' predictions (one foreign), resent (duplicates), unknown ids, bad labels: each status,
    then accuracy, coverage, accepted error and the OOD flag's precision and recall equal the by-hand figures, with
    their Wilson intervals, in /monitor and /metrics."""
    with client(art, tmp_path) as c:
        rid, preds = predict(c, 12, seed=3)
        truth = [TINY_LABELS[(i * 7) % 4] for i in range(11)] + ["not-a-class"]  # the last input is foreign
        items = [(rid, i, y) for i, y in enumerate(truth)]
        bad = [(rid, 0, "cat"), ("no-such-id", 0, "cat"), (rid, 99, "cat"), (rid, 1, 7), (rid, 2, "  ")]
        expected = ["duplicate", "unknown_id", "unknown_id", "invalid_label", "invalid_label"]
        assert send(c, items + bad) == ["accepted"] * 12 + expected  # a bad label is refused before duplicates
        assert send(c, items) == ["duplicate"] * 12  # idempotent
        rid2, _ = predict(c, 2, seed=4)
        assert send(c, [(rid2, 0, 9), (rid2, 1, "")]) == ["invalid_label", "invalid_label"]
        m = c.get(f"/v1/models/{NAME}/monitor").json()
        text = c.get("/metrics").text

    own = [p for p, y in zip(preds, truth, strict=True) if y in TINY_LABELS]
    correct = sum(p["label"] == y for p, y in zip(preds, truth, strict=True))
    covered = sum(y in p["conformal"]["set"] for p, y in zip(preds, truth, strict=True))
    accepted = [(p, y) for p, y in zip(preds, truth, strict=True) if p["selective"]["accept"]]
    flagged = [y for p, y in zip(preds, truth, strict=True) if p["ood"]["flag"]]
    assert len(own) == 11 and m["labelled"] == 12
    assert m["accuracy"] == pytest.approx(correct / 12) and m["coverage"] == pytest.approx(covered / 12)
    fig = m["windows"]["all"]
    assert fig["accuracy"]["low"] == pytest.approx(wilson_interval(correct, 12)[0])
    assert fig["accepted_error"]["n"] == len(accepted)
    assert fig["accepted_error"]["value"] == (
        pytest.approx(sum(p["label"] != y for p, y in accepted) / len(accepted)) if accepted else None
    )
    assert fig["ood_recall"]["n"] == 1  # the foreign label counts for the flag's recall
    assert fig["ood_recall"]["value"] == (1.0 if preds[11]["ood"]["flag"] else 0.0)
    assert fig["ood_precision"]["n"] == len(flagged)
    # label-free: the mean top-label probability of the 14 answers served
    assert m["windows"]["recent"]["served"] == 14 and m["windows"]["all"]["served"] == 14
    assert m["store"]["backend"] == "sqlite" and m["drift"] is not None
    # /metrics: the new series with those values
    assert metric(text, "hydra_feedback_total", model=NAME, status="accepted") == 12
    assert metric(text, "hydra_feedback_total", model=NAME, status="duplicate") == 13
    assert metric(text, "hydra_feedback_total", model=NAME, status="unknown_id") == 2
    assert metric(text, "hydra_feedback_total", model=NAME, status="invalid_label") == 4
    assert metric(text, "hydra_labelled_predictions", model=NAME) == 12
    assert metric(text, "hydra_live_quality", model=NAME, figure="accuracy", window="all", bound="value") == (
        pytest.approx(correct / 12)
    )
    assert metric(text, "hydra_live_quality", model=NAME, figure="coverage", window="recent", bound="value") == (
        pytest.approx(covered / 12)
    )
    est = metric(text, "hydra_live_quality", model=NAME, figure="estimated_accuracy", window="all", bound="value")
    assert est == pytest.approx(m["estimated_accuracy"])
    assert metric(text, "hydra_coverage_target", model=NAME) == pytest.approx(0.9)
    assert metric(text, "hydra_store_up") == 1
    for outcome in ("dropped_full", "dropped_error", "dropped_closed"):  # written and queued: as the writer went
        assert metric(text, "hydra_store_records", outcome=outcome) == 0


def calibrator(art: Path) -> SetCalibrator:
    return SetCalibrator.from_tensors(load_file(str(art / "guarantees.safetensors")), "conformal.")


def by_hand(art: Path, preds: list[dict[str, Any]], truth: list[int], aci: AdaptiveConformal) -> None:
    """Apply labels to ``aci`` as the monitor must: the set rebuilt at the current alpha_t from the probabilities."""
    cal = calibrator(art)
    for p, y in zip(preds, truth, strict=True):
        probs = np.zeros((1, len(TINY_LABELS)))
        for t in p["top_k"]:
            probs[0, TINY_LABELS.index(t["label"])] = np.float32(t["prob"])
        sets, filled, _ = aci.sets(cal, probs)
        aci.update(raw_misses(sets[:, y], filled))


def test_adaptive_sets_say_so_and_alpha_t_moves_by_the_known_answer(art: Path, tmp_path: Path) -> None:
    """``adaptive: true`` answers carry ``adaptive`` and ``alpha_t``; after n labels with k misses alpha_t is
    alpha_1 + gamma (alpha n - k), k counted by hand on the sets rebuilt from the answers' probabilities; a restart
    on the same store keeps it, the labels and the alarm's state."""
    with client(art, tmp_path) as c:
        rid, preds = predict(c, 16, seed=5, adaptive=True)
        assert all(p["conformal"]["adaptive"] is True for p in preds)
        assert preds[0]["conformal"]["alpha_t"] == pytest.approx(0.1) and preds[0]["conformal"]["alpha"] == 0.1
        truth = [(i * 3 + 1) % 4 for i in range(16)]
        assert send(c, [(rid, i, TINY_LABELS[y]) for i, y in enumerate(truth)]) == ["accepted"] * 16
        first = c.get(f"/v1/models/{NAME}/monitor").json()
        _, after = predict(c, 1, seed=6, adaptive=True)
        split = predict(c, 1, seed=6)[1][0]["conformal"]
    expected = AdaptiveConformal(0.1)
    by_hand(art, preds, truth, expected)
    a = first["adaptive"]
    assert (a["labels_applied"], a["misses"]) == (16, expected.misses)
    assert a["alpha_t"] == pytest.approx(0.1 + 0.01 * (0.1 * 16 - expected.misses))
    assert a["alpha_t"] == pytest.approx(expected.alpha_t)
    assert a["bound"] == pytest.approx((0.9 + 0.01) / (0.01 * 16))
    assert after[0]["conformal"]["alpha_t"] == pytest.approx(expected.alpha_t)  # this replica read it back
    assert "adaptive" not in split and "alpha_t" not in split  # the split conformal set stays the default
    h = first["harmful_shift"]
    alarm = HarmfulShiftAlarm.from_errors(CAL_ERRORS, 300)
    assert h["available"] and h["threshold"] == pytest.approx(alarm.threshold) and h["labelled"] == 16
    with client(art, tmp_path) as c:  # a restart: a new app on the same store file
        again = c.get(f"/v1/models/{NAME}/monitor").json()
        _, later = predict(c, 1, seed=6, adaptive=True)
    assert again["labelled"] == 16 and again["adaptive"] == first["adaptive"]
    assert again["harmful_shift"]["statistic"] == pytest.approx(h["statistic"])
    assert later[0]["conformal"]["alpha_t"] == pytest.approx(expected.alpha_t)


def test_refusals_are_one_line_and_never_5xx(art: Path, tmp_path: Path) -> None:
    """10,001 items, garbage JSON, a wrong shape: 422 with one line; an unknown model 404; with HYDRA_API_KEY set,
    401 without it; with the store off, 409 saying so, and adaptive requests 422."""
    statuses = []
    with client(art, tmp_path, api_key="k") as c:
        auth = {"Authorization": "Bearer k"}
        url = f"/v1/models/{NAME}/feedback"
        r = c.post(url, json={"feedback": [{"id": "x", "index": 0, "label": "cat"}]})
        statuses.append(assert_error(r, 401, "unauthorized") and r.status_code)
        many = {"feedback": [{"id": "x", "index": i, "label": "cat"} for i in range(10_001)]}
        for body, code in (
            (json.dumps(many), 422),
            ("{not json", 422),
            ('{"feedback": [{"id": "x"}]}', 422),
            ('{"feedback": [{"id": "x", "index": true, "label": "cat"}]}', 422),
        ):
            r = c.post(url, content=body, headers={**auth, "Content-Type": "application/json"})
            statuses.append(r.status_code)
            msg = assert_error(r, code, "invalid_input")["error"]["message"]
            assert "\n" not in msg
        r = c.post("/v1/models/nope/feedback", json={"feedback": []}, headers=auth)
        statuses.append(assert_error(r, 404, "not_found") and r.status_code)
        r = c.get(f"/v1/models/{NAME}/monitor")
        statuses.append(assert_error(r, 401, "unauthorized") and r.status_code)
        assert c.get(f"/v1/models/{NAME}/monitor", headers=auth).status_code == 200
    with TestClient(create_app(settings_for(art))) as c:  # the store off (the tests' default)
        r = c.post(f"/v1/models/{NAME}/feedback", json={"feedback": [{"id": "x", "index": 0, "label": "cat"}]})
        assert "HYDRA_STORE=off" in assert_error(r, 409, "conflict")["error"]["message"]
        assert_error(c.get(f"/v1/models/{NAME}/monitor"), 409, "conflict")
        r = c.post("/predict", json={"image": b64(png(7)), "adaptive": True})
        assert_error(r, 422, "invalid_input", "adaptive", "HYDRA_STORE")
        r = c.post("/predict", files=[("file", png(7))], data={"adaptive": "true"})
        assert_error(r, 422, "invalid_input", "adaptive")
    assert all(s < 500 for s in statuses)


def test_a_store_that_cannot_open_leaves_the_server_serving(art: Path, tmp_path: Path) -> None:
    """A state directory that cannot be created: predictions still answer, feedback is 503 not_ready with
    Retry-After."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with client(art, blocker / "state") as c:
        rid, _ = predict(c, 1, seed=1)
        r = c.post(f"/v1/models/{NAME}/feedback", json={"feedback": [{"id": rid, "index": 0, "label": "cat"}]})
        if r.status_code == 200:  # the store opens lazily: its writer reports the failure on first use
            assert r.json()["results"][0]["status"] in ("accepted", "unknown_id")
        else:
            assert_error(r, 503, "not_ready")
            assert int(r.headers["retry-after"]) >= 1
        assert c.get("/readyz").status_code == 200


def test_an_artifact_without_calibration_errors_reports_the_alarm_unavailable(tmp_path: Path) -> None:
    art = artifact(tmp_path / "vit", errors=None)
    with client(art, tmp_path / "state") as c:
        h = c.get(f"/v1/models/{NAME}/monitor").json()["harmful_shift"]
        text = c.get("/metrics").text
    assert h["available"] is False and "guarantees.calibration.errors" in h["reason"]
    assert not math.isnan(metric(text, "hydra_adaptive_alpha", model=NAME))


def test_the_open_inference_protocol_takes_adaptive_and_records_its_answers(art: Path, tmp_path: Path) -> None:
    """The parameter ``adaptive`` of an OIP request serves the adaptive set (the one /predict serves with it); the
    answer is recorded under its X-Request-ID, so feedback finds it; a non-boolean value is refused."""
    img = b64(png(noise_images(1, seed=30)[0]))
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [img]}]}
    with client(art, tmp_path) as c:
        r = c.post(f"/v2/models/{NAME}/infer", json={**body, "parameters": {"adaptive": True}})
        assert r.status_code == 200, r.text
        oip_set = next(o["data"] for o in r.json()["outputs"] if o["name"] == "prediction_set")
        rest = c.post("/predict", json={"image": img, "adaptive": True}).json()["predictions"][0]["conformal"]
        assert [TINY_LABELS[j] for j, x in enumerate(oip_set) if x] == sorted(rest["set"], key=TINY_LABELS.index)
        assert r.json()["parameters"] == {"adaptive": True, "alpha_t": pytest.approx(rest["alpha_t"])}
        plain = c.post(f"/v2/models/{NAME}/infer", json=body)
        assert plain.status_code == 200 and "parameters" not in plain.json()  # the split set: nothing to say
        assert send(c, [(r.headers["x-request-id"], 0, "cat")]) == ["accepted"]
        bad = c.post(f"/v2/models/{NAME}/infer", json={**body, "parameters": {"adaptive": "yes"}})
        assert bad.status_code == 400 and "parameters.adaptive" in bad.json()["error"]  # the OIP's error body


def test_adaptive_sets_keep_their_bound_on_an_adversarial_stream_through_the_server(art: Path, tmp_path: Path) -> None:
    """The online guarantee end to end: T single-image requests with ``adaptive: true``, each labelled by feedback
    before the next. First the top label (always covered), then the least likely one, which the split set never
    holds: the split sets' miscoverage on this stream is far off alpha, while the served adaptive sets keep Gibbs and
    Candes' deterministic bound ``|misses / T - alpha| <= (max(alpha_1, 1 - alpha_1) + gamma) / (gamma T)``. Every
    served set equals the one an ACI run by hand builds from the same answers and labels."""
    T, alpha = 400, 0.1
    cal, aci, split = calibrator(art), AdaptiveConformal(alpha), AdaptiveConformal(alpha)
    served_misses = split_misses = 0
    with client(art, tmp_path) as c:
        for t in range(T):
            rid, (p,) = predict(c, 1, seed=1000 + t, adaptive=True)
            probs = np.zeros((1, len(TINY_LABELS)))
            for x in p["top_k"]:
                probs[0, TINY_LABELS.index(x["label"])] = np.float32(x["prob"])
            y = int(probs.argmax()) if t < T // 2 else int(probs.argmin())
            sets, filled, level = aci.sets(cal, probs)
            assert p["conformal"]["alpha_t"] == pytest.approx(level)
            assert set(p["conformal"]["set"]) == {TINY_LABELS[j] for j in np.flatnonzero(sets[0])}
            miss = bool(raw_misses(sets[:, y], filled)[0])
            aci.update([miss])
            served_misses += miss
            s_sets, s_filled, _ = split.sets(cal, probs)  # split conformal: alpha_t never moves
            split_misses += bool(raw_misses(s_sets[:, y], s_filled)[0])
            assert send(c, [(rid, 0, TINY_LABELS[y])]) == ["accepted"]
        a = c.get(f"/v1/models/{NAME}/monitor").json()["adaptive"]
    bound = (max(alpha, 1 - alpha) + aci.gamma) / (aci.gamma * T)
    assert (a["labels_applied"], a["misses"]) == (T, served_misses)
    assert a["bound"] == pytest.approx(bound)
    assert abs(served_misses / T - alpha) <= bound
    assert abs(split_misses / T - alpha) > bound  # the stream is one the split guarantee does not cover
