"""benchmarks/stream.py: its figures against scipy and by hand, the checks of the issue's targets, the replica
simulation's direction, and one short stream through a real server on a tiny artifact."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import stats

from benchmarks import stream as st
from tests.fixtures.tiny_artifact import make_tiny_artifact


def test_accepted_figures_known_answers():
    correct = np.array([True] * 18 + [False] * 2 + [False] * 5)
    accept = np.array([True] * 20 + [False] * 5)  # 20 accepted, 2 of them wrong
    f = st.accepted_figures(correct, accept, 0.05)
    assert (f["accepted"], f["accepted_errors"], f["accept_rate"]) == (20, 2, 0.8)
    assert f["accepted_error"] == pytest.approx(0.1)
    assert f["p_above_risk"] == pytest.approx(1 - stats.binom.cdf(1, 20, 0.05))  # P(X >= 2)
    lo, hi = f["interval"]
    assert lo == pytest.approx(stats.beta.ppf(0.025, 2, 19)) and hi == pytest.approx(stats.beta.ppf(0.975, 3, 18))
    none = st.accepted_figures(correct, np.zeros(25, bool), 0.05)
    assert none["accepted_error"] is None and none["p_above_risk"] == 1.0


def _records(n: int, suspended_from: int | None) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        on = suspended_from is not None and i + 1 >= suspended_from
        would = bool(rng.random() < 0.6)
        out.append(
            {
                "correct": bool(rng.random() < 0.8),
                "confidence": 0.9,
                "flag": False,
                "accept": would and not on,
                "suspended": on,
                "rule": "certified",
                "would_accept": would,
            }
        )
    return out


def test_stream_figures_count_from_the_first_input():
    run = {
        "records": _records(100, 12),
        "withheld": 50.0,
        "drift": {},
        "estimate_reliable_at_end": False,
        "seconds": 1.0,
    }
    f = st.stream_figures(run, 0.05)
    assert f["first_suspended_input"] == 12 and f["suspended_answers"] == 89 and f["inputs"] == 100
    assert f["served"]["accepted"] <= 11 < f["certified_rule_without_alarm"]["accepted"]
    assert f["estimate_gap"] == pytest.approx(0.9 - f["accuracy"])
    clean = st.stream_figures({**run, "records": _records(100, None)}, 0.05)
    assert clean["first_suspended_input"] is None and clean["suspended_answers"] == 0


def _row(modality: str, acc: float, p: float, first: int | None, suspended: int = 0, corruption="noise") -> dict:
    fig = {"accept_rate": 0.5, "accepted_error": 0.05, "p_above_risk": p}
    return {
        "modality": modality,
        "corruption": corruption,
        "accuracy": acc,
        "served": fig,
        "certified_rule_without_alarm": fig,
        "first_suspended_input": first,
        "suspended_answers": suspended,
    }


def test_checks_read_the_targets():
    doc = {
        "models": {"image": {"risk": 0.05}},
        "clean": [_row("image", 0.85, 0.5, None, corruption=None)],
        "shifted": [_row("image", 0.70, 0.5, 15), _row("image", 0.84, 0.001, None)],  # the second costs 1 point
        "labelled": [],
    }
    c = st.checks(doc)
    assert all(c.values()), c
    doc["shifted"].append(_row("image", 0.78, 0.01, 30))  # costs 7 points: its p counts; 10 points not reached
    c = st.checks(doc)
    assert not c["image: every stream costing >= 5 points: error among accepted not above the target (p >= 0.025)"]
    assert c["image: streams costing >= 10 points: first suspension within 20 inputs"]
    doc["shifted"].append(_row("image", 0.6, 0.5, 25))
    assert not st.checks(doc)["image: streams costing >= 10 points: first suspension within 20 inputs"]


def test_each_replicas_own_alarm_suspends_no_unshifted_replica_and_no_more_falsely():
    sim = st.replica_simulation(replicas=(2,), runs=8, seed=1)
    for rows in sim.values():
        one = next(r for r in rows if r.get("shift_reaches") == "one")
        assert one["unshifted_replicas_suspended_own"] == 0.0
        assert one["unshifted_replicas_suspended_shared"] >= one["unshifted_replicas_suspended_own"]
        fa = next(r for r in rows if "false_suspension_runs_shared" in r)
        assert fa["false_suspension_runs_own_per_replica"] <= fa["false_suspension_runs_shared"]
        assert fa["bound_shared"] == pytest.approx(2 * fa["bound_own_per_replica"])


def _png(a: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_a_short_stream_through_a_real_server(tmp_path: Path):
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-stream", guarantees={"risks": [0.5], "risk": 0.5})
    man = json.loads((art / "manifest.json").read_text())
    h, w = man["preprocessing"]["size"]
    rng = np.random.default_rng(0)
    bodies = [{"image": _png(rng.integers(0, 256, (h, w), dtype=np.uint8))} for _ in range(6)]
    y = rng.integers(0, len(man["labels"]), 6)
    res = st.run_stream(art, man, bodies, y, labelled=True)  # adaptive requests, each label sent back
    assert len(res["records"]) == 6 and res["estimate_reliable_at_end"] is True
    assert {r["rule"] for r in res["records"]} == {"online"}
    assert res["online_risk"]["0.5"]["labels_applied"] == 6
    f = st.stream_figures(res, float(man["guarantees"]["selective"]["default_risk"]))
    assert f["inputs"] == 6 and 0.0 <= f["accuracy"] <= 1.0


def test_the_workers_check_pairs_each_stream_with_its_one_worker_run():
    one, two = _row("image", 0.7, 0.5, 20), _row("image", 0.7, 0.5, 22)
    two["workers"] = 2
    doc = {"models": {"image": {"risk": 0.05}}, "clean": [], "shifted": [one, two], "labelled": []}
    assert st.checks(doc)["image: first suspension with 2 workers within 1.1 x one worker's, every stream"]
    two["first_suspended_input"] = 23  # 1.15 x
    assert not st.checks(doc)["image: first suspension with 2 workers within 1.1 x one worker's, every stream"]


def test_a_shifted_stream_suspends_at_the_same_input_with_two_workers(tmp_path: Path):
    """The inputs sent in order over four connections to two workers: one shared alarm suspends at the input one
    worker's does. The shift: the noise images whose OOD p-value is at most 0.05 under the tiny model, in turn."""
    from fastapi.testclient import TestClient

    from service.entrypoints.app import create_app
    from tests.service.helpers import noise_images, settings_for

    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-stream", guarantees={"risks": [0.5], "risk": 0.5})
    man = json.loads((art / "manifest.json").read_text())
    images = [_png(a) for a in noise_images(16, seed=5)]
    with TestClient(create_app(settings_for(art, drift_policy="off"))) as c:
        ps = [c.post("/predict", json={"image": im}).json()["predictions"][0]["ood"]["p_value"] for im in images]
    foreign = [im for im, p in zip(images, ps, strict=True) if p <= 0.05]
    assert foreign, ps
    bodies = [{"image": foreign[i % len(foreign)]} for i in range(120)]
    y = np.zeros(120, dtype=int)
    first = [st.stream_figures(st.run_stream(art, man, bodies, y, workers=n), 0.5) for n in (1, 2)]
    assert first[0]["first_suspended_input"] is not None
    assert first[0]["first_suspended_input"] == first[1]["first_suspended_input"]
    assert first[1]["drift_at_end"]["inputs"] == 120
