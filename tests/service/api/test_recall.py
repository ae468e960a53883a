"""Answers recalled when the drift alarm goes on (docs/api.md "Answers recalled"): through a real app, the answers
given between the estimated start of the shift and the alarm are listed by request ID, counted, marked in the
prediction log, and kept in the prediction store across a restart."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from fastapi.testclient import TestClient

from service.entrypoints.app import create_app
from tests.service.api.test_guarantees_api import _drift_artifact, _like_calibration, _metric
from tests.service.helpers import b64, png, settings_for


def _shift(c: TestClient, name: str) -> tuple[dict[str, int], list[str]]:
    """96 inputs like the calibration data, then one white frame per request (each its own X-Request-ID) until the
    alarm is on: ``{id: input number}`` of the white frames and the ids whose answers were suspended."""
    ok = [b64(png(a)) for a in _like_calibration(32, seed=21)]
    for k in range(3):
        c.post("/predict", json={"images": ok}, headers={"X-Request-ID": f"calm-{k}"})
    blank, numbers, suspended = b64(png(255)), {}, []
    for k in range(60):
        rid = f"shift-{k:02d}"
        p = c.post("/predict", json={"image": blank}, headers={"X-Request-ID": rid}).json()["predictions"][0]
        numbers[rid] = 97 + k
        if p["selective"]["suspended"]:
            suspended.append(rid)
            if len(suspended) == 3:
                break
    return numbers, suspended


def test_the_answers_between_the_change_point_and_the_alarm_are_recalled(tmp_path: Path, caplog):
    name = "tiny-recall"
    with TestClient(create_app(settings_for(_drift_artifact(tmp_path / "vit", name)))) as c:
        with caplog.at_level(logging.WARNING, logger="hydra.predictions"):
            numbers, suspended = _shift(c, name)
        state = c.get(f"/v1/models/{name}/drift").json()
        assert state["alarm"] is True
        (episode,) = state["history"]
        (rec,) = state["recalled"]
        assert rec["started_at"] == episode["started_at"] == state["alarm_at"]
        # the white frames start at input 97: the change point is within a few inputs of it (a calm input just
        # before with a small p-value may open the leading bet's run)
        assert rec["changed_at"] == episode["changed_at"] and 97 - 5 <= rec["changed_at"] <= 97 + 3
        # every answer given before the alarm, from the change point on, and nothing else
        calm = {(f"calm-{t // 32}", t % 32): t + 1 for t in range(96)}
        white = {(rid, 0): t for rid, t in numbers.items()}
        window = {k: t for k, t in {**calm, **white}.items() if rec["changed_at"] <= t < rec["started_at"]}
        assert {(a["id"], a["index"]): a["input"] for a in rec["answers"]} == window
        want = sorted(rid for rid, _ in window)
        assert want and not set(want) & set(suspended)
        assert rec["listed"] == len(window) and rec["dropped"] == 0 and rec["incomplete"] is False
        (summary,) = c.get("/v1/models").json()["models"][0]["guarantees"]["drift"]["recalled"]
        assert summary == {k: v for k, v in rec.items() if k != "answers"}  # the model list: the counts only
        text = c.get("/metrics").text
        total = sum(
            _metric(text, f'hydra_drift_recalled_total{{accepted="{v}",model="{name}"}}') for v in ("true", "false")
        )
        assert total == len(want)
        marked = [r for r in caplog.records if getattr(r, "recalled", False)]
        assert sorted(r.id for r in marked) == want and all(r.alarm_at == rec["started_at"] for r in marked)


def test_the_store_keeps_a_recall_across_a_restart(tmp_path: Path):
    name = "tiny-recall-store"
    art = _drift_artifact(tmp_path / "vit", name)
    settings = settings_for(art, store=True, state_dir=str(tmp_path / "state"))
    with TestClient(create_app(settings)) as c:
        _shift(c, name)
        first = c.get(f"/v1/models/{name}/drift").json()["recalled"]
        assert len(first) == 1 and first[0]["listed"] >= 1
        for _ in range(100):  # the store is written in the background
            stored = c.app.state.hydra.runtimes[name].monitor.stored_recalls()
            if stored and stored[0]["listed"] == first[0]["listed"]:
                break
            time.sleep(0.05)
    with TestClient(create_app(settings)) as c:  # a restart: the alarm starts over, the store remembers
        state = c.get(f"/v1/models/{name}/drift").json()
        assert state["episodes"] == 0 and state["alarm"] is False
        (kept,) = state["recalled"]
        assert kept["run"] == first[0]["run"] and [a["id"] for a in kept["answers"]] == [
            a["id"] for a in first[0]["answers"]
        ]
