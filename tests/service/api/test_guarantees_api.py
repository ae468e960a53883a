"""Answers with guarantees (service/core/guarantees.py, docs/api.md "Guarantees"): prediction sets, OOD p-values and the
flag at the request's level, the risk rule's decision, their request parameters and errors, and the metrics; the
same numbers as the builder's code on the same inputs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from service.core.artifact import load_manifest
from service.core.conformal import SetCalibrator, keep_top
from service.core.drift import MAX_PAYOFF
from service.core.preprocess import ImagePreprocessor
from service.core.registry import load_model
from service.core.uncertainty import summarize
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS, make_tiny_artifact
from tests.service.helpers import assert_error, b64, noise_images, png, settings_for

RISKS = {"risks": [0.05, 0.5], "risk": 0.5}  # a tiny random model is right 2/3 of the time: 0.5 is certifiable
CUT = 0.3  # the served MSP threshold: the OOD cut of the risk rules lets most of the tiny model's inputs through


@pytest.fixture(scope="module")
def g_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_artifact(
        tmp_path_factory.mktemp("g") / "vit", "vit", name="tiny-g", guarantees=RISKS, ood_threshold=CUT
    )


@pytest.fixture(scope="module")
def g_client(g_artifact: Path) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(g_artifact))) as c:
        yield c


def _direct(root: Path, images: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The builder-side computation: probabilities and MSP of the eager model, p-values and LAC sets from the file."""
    m = load_manifest(root)
    model = load_model(root / m.model.weights, m.model.config)
    pre = ImagePreprocessor(m.preprocessing, 1 << 20)
    with torch.inference_mode():
        s = summarize(model(torch.stack([pre(png(a)) for a in images])), m.uncertainty.temperature)
    t = load_file(str(root / "guarantees.safetensors"))
    cal = t["ood.scores"].numpy()  # outlier-oriented: -MSP, sorted
    msp = s["msp"].double().numpy()
    p = (1 + (cal[None, :] >= -msp[:, None]).sum(1)) / (len(cal) + 1)
    assert m.guarantees is not None and m.guarantees.conformal.delta == 0.1  # the builder's default: PAC sets
    sets = SetCalibrator.from_tensors(t, delta=m.guarantees.conformal.delta)
    return {
        "probs": s["probs"].double().numpy(),
        "msp": msp,
        "p": p,
        "calibrator": sets,
        "calibrator_ood": set(cal.tolist()),
    }


def test_every_answer_carries_sets_p_values_and_the_risk_decision(g_client, g_artifact):
    images = noise_images(6, seed=5)
    r = g_client.post("/predict", json={"images": [b64(png(a)) for a in images]})
    assert r.status_code == 200, r.text
    want = _direct(g_artifact, images)
    spec = load_manifest(g_artifact).guarantees
    lam = next(t.threshold for t in spec.selective.targets if t.risk == 0.5)
    assert lam is not None  # certified on the calibration split
    for i, p in enumerate(r.json()["predictions"]):
        assert p["ood"]["p_value"] == pytest.approx(want["p"][i], abs=1e-12)
        assert p["ood"]["alpha"] == 0.05 and p["ood"]["flag"] == (want["p"][i] <= 0.05)
        thr = p["ood"]["threshold"]  # the rule the flag applied at this level: p <= 0.05 iff msp below it
        assert thr is not None and -thr in want["calibrator_ood"] and p["ood"]["metric"] == "msp"
        assert p["ood"]["flag"] == (p["ood"]["score"] < thr)
        assert (p["ood"].get("reason") is not None) == p["ood"]["flag"]
        c = p["conformal"]
        raw = want["calibrator"].sets(want["probs"][i : i + 1], 0.1)
        expected = keep_top(raw, want["probs"][i : i + 1])[0][0]  # served sets are never empty
        assert c["alpha"] == 0.1 and c["delta"] == 0.1 and c["method"] == "lac" and c["mondrian"] is False
        assert sorted(c["set"]) == sorted(TINY_LABELS[j] for j in np.flatnonzero(expected))
        assert c["size"] == len(c["set"])
        order = [TINY_LABELS[j] for j in np.argsort(-want["probs"][i], kind="stable")]
        assert c["set"] == [lab for lab in order if lab in c["set"]]  # most probable first
        sel = p["selective"]
        accept = bool(want["msp"][i] >= CUT and want["msp"][i] >= lam)
        assert sel.pop("reason", None) is None if accept else "below" in sel.pop("reason")
        assert sel == {
            "accept": accept,
            "risk": 0.5,
            "certified": True,
            "rule": "certified",
            "suspended": False,
            "threshold": lam,
            "ood_threshold": CUT,
        }
        assert p["ood"]["suspended"] is False and c["suspended"] is False  # no drift alarm


def test_the_request_chooses_the_levels(g_client, g_artifact):
    img = b64(png(noise_images(1, seed=8)[0]))
    base = g_client.post("/predict", json={"image": img}).json()["predictions"][0]
    wide = g_client.post("/predict", json={"image": img, "alpha": 0.6, "ood_alpha": 0.9}).json()["predictions"][0]
    assert wide["ood"]["p_value"] == base["ood"]["p_value"]  # the p-value does not depend on the level
    assert wide["ood"]["alpha"] == 0.9 and wide["ood"]["flag"] == (base["ood"]["p_value"] <= 0.9)
    assert set(wide["conformal"]["set"]) <= set(base["conformal"]["set"]) and wide["conformal"]["alpha"] == 0.6
    tiny = g_client.post("/predict", json={"image": img, "alpha": 0.001}).json()["predictions"][0]["conformal"]
    assert tiny["below_min_alpha"] is True and sorted(tiny["set"]) == sorted(TINY_LABELS)  # below 1 - 0.1^(1/300)
    strict = g_client.post("/predict", json={"image": img, "risk": 0.05}).json()["predictions"][0]["selective"]
    assert strict.pop("reason").startswith("no rule met the risk target 0.05")
    not_met = {"accept": False, "risk": 0.05, "certified": False, "ood_threshold": CUT}  # not met on the split
    assert strict == {**not_met, "rule": "certified", "suspended": False}
    form = g_client.post(
        "/predict",
        files=[("file", ("a.png", png(noise_images(1, seed=8)[0]), "image/png"))],
        data={"alpha": "0.6", "risk": "0.05"},
    )
    assert form.status_code == 200, form.text
    fp = form.json()["predictions"][0]
    assert fp["conformal"]["set"] == wide["conformal"]["set"] and fp["selective"]["risk"] == 0.05


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"alpha": 0}, "alpha"),
        ({"alpha": 1}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": "0.1"}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"ood_alpha": -0.1}, "ood_alpha"),
        ({"ood_alpha": "a lot"}, "ood_alpha"),
        ({"risk": 0}, "risk"),
        ({"risk": None, "alpha": [0.1]}, "alpha"),
    ],
)
def test_bad_levels_are_422_naming_the_field(g_client, body, fragment):
    r = g_client.post("/predict", json={"image": b64(png(3)), **body})
    assert_error(r, 422, "invalid_input", fragment)


def test_a_risk_the_model_was_not_built_with_lists_the_available_ones(g_client, artifacts):
    r = g_client.post("/predict", json={"image": b64(png(3)), "risk": 0.3})
    assert_error(r, 422, "invalid_input", "risk", "0.3", "[0.05, 0.5]")
    with TestClient(create_app(settings_for(artifacts["vit"]))) as c:  # no calibration split at all
        plain = c.post("/predict", json={"image": b64(png(3))}).json()["predictions"][0]
        assert "conformal" not in plain and "selective" not in plain and "p_value" not in plain["ood"]
        assert_error(
            c.post("/predict", json={"image": b64(png(3)), "risk": 0.5}), 422, "invalid_input", "no calibration split"
        )


def test_models_list_the_guarantees_and_metrics_count_them(g_client):
    (m,) = g_client.get("/v1/models").json()["models"]
    g = m["guarantees"]
    assert g["calibration_size"] == 300 and g["alpha"] == 0.1 and g["ood_alpha"] == 0.05 and g["risk"] == 0.5
    assert set(g["risks"]) == {"0.05", "0.5"} and g["risks"]["0.05"] is None
    assert g["min_alpha"] == pytest.approx(1 - 0.1 ** (1 / 300))  # training-conditional at delta 0.1 (1 / 301 without)
    assert g["set_delta"] == 0.1
    assert g["drift"]["alarm"] is False and g["drift"]["log10_threshold"] == pytest.approx(5.0)  # A = 10^3 / 0.01
    g_client.post("/predict", json={"images": [b64(png(a)) for a in noise_images(4, seed=9)]})
    text = g_client.get("/metrics").text
    assert 'hydra_drift_alarm{model="tiny-g"} 0.0' in text
    assert 'hydra_drift_threshold{model="tiny-g"} 5.0' in text
    assert 'hydra_ood_p_value_bucket{le="0.05",model="tiny-g"}' in text
    assert 'hydra_prediction_set_size_count{model="tiny-g"}' in text
    assert 'hydra_selective_total{accept="' in text


def _like_calibration(n: int, seed: int) -> list[np.ndarray]:
    """Images whose normalised pixels are standard normal (clipped at 2): the tiny artifact's calibration inputs."""
    z = np.random.default_rng(seed).standard_normal((n, 16, 16))
    return [np.clip(np.round((0.5 + 0.25 * x) * 255), 0, 255).astype(np.uint8) for x in z]


def _drift_artifact(root: Path, name: str) -> Path:
    """A tiny image model serving a Mahalanobis score: white frames are far from its calibration inputs."""
    return make_tiny_artifact(
        root, "vit", name=name, guarantees=RISKS, ood=True, ood_score="mahalanobis", ood_threshold=None
    )


def _drift_now(c: TestClient) -> dict:
    return c.get("/v1/models").json()["models"][0]["guarantees"]["drift"]


def _metric(text: str, line: str) -> float:
    """The value of the sample ``line`` (name and labels) in a Prometheus text answer."""
    (value,) = [ln.rsplit(" ", 1)[1] for ln in text.splitlines() if ln.startswith(line + " ")]
    return float(value)


def test_a_few_odd_inputs_do_not_trip_the_alarm_and_a_scrape_sees_every_input(tmp_path):
    """The smoke test of the production alert: traffic like the calibration inputs with 5 white frames inside it
    (each far outside: OOD p-value 1/301) leaves the alarm off; /metrics shows the state of every input served at
    scrape time (the buffered inputs taken in), not a stale one."""
    name = "tiny-burst"
    with TestClient(create_app(settings_for(_drift_artifact(tmp_path / "vit", name)))) as c:
        ok = [b64(png(a)) for a in _like_calibration(32, seed=12)]
        blank = b64(png(255))
        c.post("/predict", json={"images": ok})
        for _ in range(5):  # one odd input per request, as a client would send them
            p = c.post("/predict", json={"image": blank}).json()["predictions"][0]
            assert p["ood"]["flag"] is True  # the per-request flag covers single odd inputs
        c.post("/predict", json={"images": ok[:3]})
        text = c.get("/metrics").text
        assert _metric(text, f'hydra_drift_inputs{{model="{name}"}}') == 40  # 32 + 5 + 3: nothing left buffered
        assert _metric(text, f'hydra_drift_alarm{{model="{name}"}}') == 0
        assert _metric(text, f'hydra_drift_episodes_total{{model="{name}"}}') == 0
        state = _drift_now(c)
        assert state["alarm"] is False and state["episodes"] == 0 and state["history"] == []
        # the burst left a trace, a decade or more below A (5 inputs multiply it by at most MAX_PAYOFF^5 = 10^4)
        assert 0 < state["log10_statistic"] <= 5 * math.log10(MAX_PAYOFF) + 1e-9 < state["log10_threshold"] - 0.99


def test_drift_alarm_fires_on_sustained_foreign_traffic_and_clears_after_it(tmp_path):
    """Traffic like the calibration inputs keeps the alarm quiet; a stream of white frames turns it on, and the metric
    follows; once the traffic is like the calibration inputs again it goes off by itself, and the episode is in the
    history. The warm-up input is not traffic."""
    name = "tiny-drift"
    with TestClient(create_app(settings_for(_drift_artifact(tmp_path / "vit", name)))) as c:
        assert _drift_now(c)["inputs"] == 0
        ok = [b64(png(a)) for a in _like_calibration(32, seed=11)]
        for _ in range(3):
            c.post("/predict", json={"images": ok})
        state = _drift_now(c)
        assert state["inputs"] == 96 and state["alarm"] is False
        blank = b64(png(255))
        for _ in range(20):
            c.post("/predict", json={"images": [blank] * 16})
            if _drift_now(c)["alarm"]:
                break
        state = _drift_now(c)
        assert state["alarm"] is True and 96 < state["alarm_at"] <= 96 + 32  # about 13 white frames in a row
        text = c.get("/metrics").text
        assert _metric(text, f'hydra_drift_alarm{{model="{name}"}}') == 1
        assert _metric(text, f'hydra_drift_episodes_total{{model="{name}"}}') == 1
        for k in range(40):
            c.post("/predict", json={"images": [b64(png(a)) for a in _like_calibration(32, seed=100 + k)]})
            if not _drift_now(c)["alarm"]:
                break
        state = _drift_now(c)
        assert state["alarm"] is False and state["episodes"] == 1
        (episode,) = state["history"]
        assert episode["started_at"] < episode["cleared_at"] <= state["inputs"] and episode["cleared_by"] == "traffic"
        assert episode["peak_log10_statistic"] >= state["log10_threshold"]
        assert _metric(c.get("/metrics").text, f'hydra_drift_alarm{{model="{name}"}}') == 0


def test_drift_state_and_the_authenticated_reset(tmp_path):
    """GET /v1/models/{name}/drift shows the alarm; POST .../drift/reset restarts its statistic, for an authenticated
    caller only: 403 on a server without HYDRA_API_KEY, 401 without the key, 404 for a model without a drift test."""
    root = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-reset", guarantees=RISKS, ood_threshold=CUT)
    with TestClient(create_app(settings_for(root))) as open_server:
        assert_error(open_server.post("/v1/models/tiny-reset/drift/reset"), 403, "forbidden", "HYDRA_API_KEY")
    key = {"Authorization": "Bearer s3cret"}
    with TestClient(create_app(settings_for(root, api_key="s3cret"))) as c:
        c.post("/predict", json={"images": [b64(png(a)) for a in noise_images(5, seed=2)]}, headers=key)
        state = c.get("/v1/models/tiny-reset/drift", headers=key).json()
        assert state["model"] == "tiny-reset" and state["inputs"] == 5 and state["alarm"] is False
        assert state["delta"] == 0.01 and state["arl"] == 1e5 and state["history"] == []
        assert_error(c.post("/v1/models/tiny-reset/drift/reset"), 401, "unauthorized")
        assert_error(c.post("/v1/models/nope/drift/reset", headers=key), 404, "not_found", "tiny-reset")
        r = c.post("/v1/models/tiny-reset/drift/reset", headers=key)
        assert r.status_code == 200 and r.json()["before"]["inputs"] == 5
        after = r.json()["after"]
        assert after["inputs"] == 5 and after["log10_statistic"] == 0.0 and after["alarm"] is False  # count goes on
        assert c.get("/v1/models/tiny-reset/drift", headers=key).json()["log10_statistic"] == 0.0


def test_open_inference_protocol_outputs_and_parameters(g_client, g_artifact):
    """The guarantees as named OIP outputs, at the request's parameters; bad levels are 422."""
    img = b64(png(noise_images(1, seed=8)[0]))
    meta = g_client.get("/v2/models/tiny-g").json()
    names = {o["name"]: o for o in meta["outputs"]}
    assert {"ood_p_value", "prediction_set", "accept"} <= set(names) and names["prediction_set"]["shape"] == [-1, 4]
    body = {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [img]}],
        "parameters": {"alpha": 0.6, "ood_alpha": 0.9, "risk": 0.05},
    }
    r = g_client.post("/v2/models/tiny-g/infer", json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
    rest = g_client.post("/predict", json={"image": img, "alpha": 0.6, "ood_alpha": 0.9, "risk": 0.05}).json()
    p = rest["predictions"][0]
    assert out["ood_p_value"][0] == pytest.approx(p["ood"]["p_value"], rel=1e-6)
    assert out["ood_flag"] == [p["ood"]["flag"]] and out["accept"] == [p["selective"]["accept"]]
    assert [lab for lab, x in zip(TINY_LABELS, out["prediction_set"], strict=True) if x] == sorted(
        p["conformal"]["set"], key=TINY_LABELS.index
    )
    for bad in ({"alpha": 0}, {"ood_alpha": "high"}, {"risk": True}):
        r = g_client.post("/v2/models/tiny-g/infer", json={**body, "parameters": bad})
        assert r.status_code == 422 and list(bad)[0] in r.json()["error"], r.text
    r = g_client.post("/v2/models/tiny-g/infer", json={**body, "parameters": {"risk": 0.3}})
    assert r.status_code == 422 and "[0.05, 0.5]" in r.json()["error"]


@pytest.mark.parametrize("mondrian", [False, True])
def test_the_per_request_path_computes_what_the_array_functions_compute(g_artifact, mondrian):
    """Guarantees.answer (Python scalars, no checks: the served path) gives the p-values, sets and accept decisions
    of p_values / prediction_sets / accepts, ties and NaN scores included."""
    from dataclasses import replace

    from service.core.guarantees import load_guarantees

    g = load_guarantees(g_artifact, load_manifest(g_artifact))
    g = replace(g, mondrian=mondrian)
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(len(TINY_LABELS)), size=64)
    scores = np.concatenate([rng.uniform(0, 1, 60), -g.ood_scores[:3], [np.nan]])  # calibration values: ties
    for alpha in (0.1, 0.3):
        for risk in sorted(g.rules):
            ans = g.answer(scores.tolist(), probs, alpha, risk)
            np.testing.assert_array_equal(np.asarray(ans.p_values), g.p_values(scores))
            ref_sets, ref_below, ref_filled = g.prediction_sets(probs, alpha)
            assert np.array_equal(ans.sets, ref_sets) and ans.below_min_alpha == ref_below
            assert np.array_equal(ans.filled, ref_filled)
            assert ans.accepts == g.accepts(probs, scores, risk).tolist()
