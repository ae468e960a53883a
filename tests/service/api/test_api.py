"""The HTTP API against tiny artifacts: every endpoint, JSON and multipart, the answers checked against the model
run directly, every error code of the contract, auth, metrics, batching under concurrency, backend failures."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.api import v1
from service.api.schemas import PredictResponse
from service.core.artifact import load_manifest
from service.core.registry import load_model
from service.core.uncertainty import ood_flag, ood_score, summarize
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS, make_tiny_artifact
from tests.service.core.test_preprocess import huge_png_header
from tests.service.helpers import assert_error, b64, noise_images, png, settings_for

TEXTS = ["I love this phone", "terrible service, never again", "the match ended in a draw", "stocks fell sharply today"]


def direct(artifact: Path, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused model run directly (eager, fp32) and summarised with the artifact's temperature and threshold."""
    m = load_manifest(artifact)
    model = load_model(artifact / m.model.weights, m.model.config)
    with torch.inference_mode():
        logits = model(*[inputs[k] for k in m.model.inputs])
    unc = m.uncertainty
    s = summarize(logits, unc.temperature)
    s["score"] = ood_score(s, unc.ood_score)
    s["flag"] = ood_flag(s["score"], unc.ood_score, unc.ood_threshold)
    return s


def check_against(preds: list[dict], s: dict[str, torch.Tensor], labels: list[str], metric: str, threshold: float):
    assert len(preds) == len(s["probs"])
    for i, p in enumerate(preds):
        probs = s["probs"][i]
        k = int(s["prediction"][i])
        assert p["label_index"] == k and p["label"] == labels[k]
        assert p["confidence"] == pytest.approx(float(probs[k]), abs=1e-5)
        order = torch.argsort(probs, descending=True)[: len(p["top_k"])]
        assert [t["label"] for t in p["top_k"]] == [labels[j] for j in order]
        assert [t["prob"] for t in p["top_k"]] == pytest.approx(probs[order].tolist(), abs=1e-5)
        for key in ("msp", "entropy", "expected_entropy", "mutual_information", "disagreement"):
            assert p["uncertainty"][key] == pytest.approx(float(s[key][i]), abs=1e-5), key
        ood = {k: v for k, v in p["ood"].items() if k != "reason"}  # a flagged input may say why (its own test)
        assert ood == {
            "flag": bool(s["flag"][i]),
            "score": pytest.approx(float(s["score"][i]), abs=1e-5),
            "metric": metric,
            "threshold": threshold,
        }
        if "members" in p:
            mp = s["member_probs"][i]  # (M, C)
            assert [m["label"] for m in p["members"]] == [labels[j] for j in mp.argmax(-1)]
            assert [m["confidence"] for m in p["members"]] == pytest.approx(mp.max(-1).values.tolist(), abs=1e-5)


# ----------------------------------------------------------------------------- endpoints
def test_health_ready_models_metrics_docs(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {
        "status": "ready",
        "models": ["tiny-vit", "tiny-bert"],
        "building": [],
        "failed": [],
    }
    models = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    for name, family, modality in (("tiny-vit", "vit", "image"), ("tiny-bert", "bert", "text")):
        m = models[name]
        assert (m["family"], m["task"], m["modality"], m["members"]) == (family, "classification", modality, 3)
        assert m["labels"] == TINY_LABELS
        assert (m["backend"], m["device"], m["precision"]) == ("onnx", "cpu", "fp32")  # fp32: ONNX on CPU
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/predict"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)
    assert "PredictResponse" in spec["components"]["schemas"] and "ErrorResponse" in spec["components"]["schemas"]
    assert "/zero-shot" in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_docs_page_loads_its_assets_from_the_server_itself(client):
    """/docs works offline: Swagger UI's script, style sheet and icon are URLs of this server (from the pinned
    fastapi-offline package), each answered 200 with its type; nothing points to another host. ReDoc is off."""
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    urls = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert len(urls) == 3 and all(u.startswith("/docs/assets/") for u in urls), urls
    assert "http://" not in r.text and "https://" not in r.text  # nothing from another host
    types = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert asset.headers["content-type"].startswith(types[Path(url).suffix]) and len(asset.content) > 100
    assert "SwaggerUIBundle" in client.get(next(u for u in urls if u.endswith(".js"))).text
    assert "'/openapi.json'" in r.text and '"validatorUrl": null' in r.text  # no validator badge from outside
    assert_error(client.get("/redoc"), 404, "not_found")


def test_openapi_declares_the_contract_error_body_only(client):
    """Every declared error answer is the contract's envelope (ErrorResponse), never FastAPI's HTTPValidationError;
    the multipart bodies require a file part and take the JSON options, the guarantees' levels included."""
    spec = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(spec) and "ValidationError" not in spec["components"]["schemas"]
    for path, item in spec["paths"].items():
        for method, op in item.items():
            for status, answer in op["responses"].items():
                if int(status) >= 400:
                    schema = answer["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    assert "422" not in spec["paths"]["/v1/models/{model_name}/drift"]["get"]["responses"]  # a string can't fail
    for path in ("/predict", "/zero-shot"):
        form = spec["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert form["required"] == ["file"] and form["additionalProperties"] is False
        assert {"file", "model", "top_k", "return_members", "return_scores", "alpha", "ood_alpha", "risk"} <= set(
            form["properties"]
        )
        for key in ("alpha", "ood_alpha", "risk"):
            assert form["properties"][key]["exclusiveMinimum"] == 0 and form["properties"][key]["exclusiveMaximum"] == 1
    assert {"labels", "template"} <= set(
        spec["paths"]["/zero-shot"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    )


def test_multipart_takes_the_guarantees_levels(client):
    """alpha, ood_alpha and risk are form fields too: checked as in JSON (a bad value, or a risk the model was not
    built with, is 422 naming the field)."""
    f = [("file", ("a.png", png(4), "image/png"))]
    assert client.post("/predict", files=f, data={"alpha": "0.2", "ood_alpha": "0.1"}).status_code == 200
    assert_error(client.post("/predict", files=f, data={"alpha": "1.5"}), 422, "invalid_input", "alpha")
    assert_error(client.post("/predict", files=f, data={"ood_alpha": "zero"}), 422, "invalid_input", "ood_alpha")
    assert_error(client.post("/predict", files=f, data={"risk": "0.05"}), 422, "invalid_input", "risk")


def test_image_json_matches_the_model_run_directly(client, artifacts):
    imgs = noise_images(3, seed=1)
    r = client.post("/predict", json={"images": [b64(png(a)) for a in imgs], "top_k": 3, "return_members": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-vit" and set(body["timing"]) == {"queue_ms", "inference_ms", "total_ms"}
    x = torch.stack([torch.from_numpy((a.astype(np.float32) / 255 - 0.5) / 0.25)[None] for a in imgs])
    s = direct(artifacts["vit"], {"pixel_values": x})
    assert all(len(p["top_k"]) == 3 and len(p["members"]) == 3 for p in body["predictions"])
    check_against(body["predictions"], s, TINY_LABELS, "msp", 0.45)
    # the uncertainty decomposition holds on the answers too
    for p in body["predictions"]:
        u = p["uncertainty"]
        assert u["mutual_information"] == pytest.approx(u["entropy"] - u["expected_entropy"], abs=1e-5)


def test_text_json_matches_the_model_run_directly(client, artifacts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(artifacts["bert"] / "tokenizer"))
    r = client.post("/predict", json={"texts": TEXTS, "return_members": True, "top_k": 2})
    assert r.status_code == 200, r.text
    enc = tok(TEXTS, padding=True, truncation=True, max_length=48, return_tensors="pt")
    s = direct(artifacts["bert"], dict(enc))
    check_against(r.json()["predictions"], s, TINY_LABELS, "msp", 0.45)
    one = client.post("/predict", json={"text": TEXTS[1]}).json()["predictions"]
    assert len(one) == 1 and "members" not in one[0] and len(one[0]["top_k"]) == 4  # top_k 5 clamped to 4 labels
    assert one[0]["confidence"] == pytest.approx(float(s["msp"][1]), abs=1e-5)


def test_multipart_and_data_urls_equal_json(client):
    imgs = [png(a) for a in noise_images(2, seed=2)]
    as_json = client.post("/predict", json={"images": [b64(i) for i in imgs], "top_k": 2}).json()
    files = [("file", (f"{i}.png", data, "image/png")) for i, data in enumerate(imgs)]
    as_form = client.post("/predict", files=files, data={"top_k": "2", "return_members": "false"}).json()
    as_url = client.post("/predict", json={"images": ["data:image/png;base64," + b64(i) for i in imgs], "top_k": 2})
    for other in (as_form, as_url.json()):
        assert other["model"] == as_json["model"]
        for a, b in zip(as_json["predictions"], other["predictions"], strict=True):
            assert a["label"] == b["label"] and a["top_k"] == b["top_k"] and a["ood"] == b["ood"]
    named = client.post("/predict", files=files[:1], data={"model": "tiny-vit", "return_members": "true"}).json()
    assert len(named["predictions"]) == 1 and len(named["predictions"][0]["members"]) == 3


def test_metrics_count_what_was_served(artifacts):
    app = create_app(settings_for(artifacts["vit"]))
    with TestClient(app) as c:
        preds = []
        for seed in range(3):
            r = c.post("/predict", json={"images": [b64(png(a)) for a in noise_images(2, seed=seed)]})
            preds += r.json()["predictions"]
        c.post("/predict", json={"image": "%%%"})
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    for name in (
        "hydra_request_duration_seconds",
        "hydra_inference_duration_seconds",
        "hydra_batch_size",
        "hydra_queue_depth",
        "hydra_predictions",
    ):
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    n_ood = sum(p["ood"]["flag"] for p in preds)
    warm = 1  # the warm-up prediction counts too
    total = sum(v for (n, lab), v in samples.items() if n == "hydra_predictions_total" and ("model", "tiny-vit") in lab)
    assert total == len(preds) + warm
    flagged = samples.get(("hydra_predictions_total", (("model", "tiny-vit"), ("ood", "true"))), 0)
    assert n_ood <= flagged <= n_ood + warm
    key = ("hydra_request_duration_seconds_count", (("endpoint", "/predict"), ("status", "200")))
    assert samples[key] == 3
    assert samples[("hydra_request_duration_seconds_count", (("endpoint", "/predict"), ("status", "400")))] == 1
    assert samples[("hydra_batch_size_sum", (("model", "tiny-vit"),))] == 2 * 3 + warm
    assert samples[("hydra_queue_depth", (("model", "tiny-vit"),))] == 0
    buckets = [s.labels["le"] for s in families["hydra_request_duration_seconds"].samples if "le" in s.labels]
    assert "0.0005" in buckets and "10.0" in buckets


# ----------------------------------------------------------------------------- batching under concurrency
def test_fifty_concurrent_requests_equal_one_by_one(artifacts):
    """Requests batched together (padding texts of different lengths) answer as they do alone."""
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"], max_wait_ms=30, max_batch=16))
    imgs = [b64(png(a)) for a in noise_images(25, seed=3)]
    texts = [" ".join(TEXTS[: 1 + i % 4])[: 10 + 7 * i] for i in range(25)]
    bodies = [{"image": i, "return_members": True} for i in imgs] + [{"text": t, "return_members": True} for t in texts]
    with TestClient(app) as c:
        alone = [c.post("/predict", json=b).json() for b in bodies]
        with ThreadPoolExecutor(max_workers=50) as pool:
            together = list(pool.map(lambda b: c.post("/predict", json=b), bodies))
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    assert all(r.status_code == 200 for r in together)
    for a, r in zip(alone, together, strict=True):
        b = r.json()
        assert a["model"] == b["model"]
        pa, pb = a["predictions"][0], b["predictions"][0]
        assert pa["label"] == pb["label"] and pa["ood"]["flag"] == pb["ood"]["flag"]
        for x, y in zip(pa["top_k"], pb["top_k"], strict=True):
            assert x["label"] == y["label"] and x["prob"] == pytest.approx(y["prob"], abs=1e-5)
        for key, v in pa["uncertainty"].items():
            assert pb["uncertainty"][key] == pytest.approx(v, abs=1e-5)
        assert [m["label"] for m in pa["members"]] == [m["label"] for m in pb["members"]]
    sizes = {s.labels["model"]: s.value for s in families["hydra_batch_size"].samples if s.name.endswith("_sum")}
    counts = {s.labels["model"]: s.value for s in families["hydra_batch_size"].samples if s.name.endswith("_count")}
    for model in ("tiny-vit", "tiny-bert"):
        # 1 warm-up + 25 alone + 25 concurrent inputs; the concurrent ones shared batches
        assert sizes[model] == 51
        assert counts[model] < 1 + 25 + 25, "no batching happened"


class _Poisoned:
    """Wraps a backend: raises (with internals in the message) on batches holding an all-white image."""

    def __init__(self, inner, always: bool = False) -> None:
        self.inner, self.always, self.calls = inner, always, 0

    def outputs(self, inputs):
        self.calls += 1
        white = (inputs["pixel_values"] == 2.0).flatten(1).all(1)  # (255/255 - 0.5) / 0.25
        if self.always or white.any():
            raise RuntimeError("CUDA error at /secret/path/kernel.cu:42")
        return self.inner.outputs(inputs)


def test_backend_exception_fails_only_its_requests_and_server_stays_ready(artifacts):
    app = create_app(settings_for(artifacts["vit"], max_wait_ms=300, max_batch=16))
    good = [b64(png(a)) for a in noise_images(5, seed=4)]
    with TestClient(app) as c:
        expected = [c.post("/predict", json={"image": g}).json()["predictions"] for g in good]
        rt = app.state.hydra.runtimes["tiny-vit"]
        rt.backend = _Poisoned(rt.backend)
        bodies = [{"image": g} for g in good] + [{"image": b64(png(255))}]
        with ThreadPoolExecutor(max_workers=6) as pool:
            res = list(pool.map(lambda b: c.post("/predict", json=b), bodies))
        assert rt.backend.calls >= 2  # one shared batch, then one request at a time
        for r, want in zip(res[:5], expected, strict=True):
            assert r.status_code == 200 and r.json()["predictions"][0]["label"] == want[0]["label"]
        body = assert_error(res[5], 500, "internal")
        assert "secret" not in res[5].text and "CUDA" not in res[5].text
        rt.backend.always = True
        assert_error(c.post("/predict", json={"image": good[0]}), 500, "internal")
        assert c.get("/readyz").status_code == 200  # a failing batch does not take the server down
        rt.backend.always = False
        assert c.post("/predict", json={"image": good[0]}).status_code == 200
    assert body["error"]["message"]


def test_unexpected_exception_in_a_handler_is_a_contract_500(artifacts, monkeypatch):
    app = create_app(settings_for(artifacts["vit"]))

    def broken(*a, **kw):
        raise ValueError("internal detail /etc/shadow")

    with TestClient(app, raise_server_exceptions=False) as c:
        monkeypatch.setattr("service.api.requests.check_limits", broken)
        r = c.post("/predict", json={"image": b64(png(3))})
    assert_error(r, 500, "internal")
    assert "shadow" not in r.text


def test_answer_is_the_built_response_serialised_once(artifacts, monkeypatch):
    """The body is the answer the runtime's outcome built (plain data, written once with orjson), as
    ``application/json``: exactly what the documented response model dumps without its unset fields. A string that
    spells "null" goes through; a non-finite float, which JSON cannot hold (orjson would write null), is a 500
    ``internal``, never a null."""
    from service.api import answers

    app = create_app(settings_for(artifacts["vit"]))
    with TestClient(app, raise_server_exceptions=False) as c:
        build, built = answers.predict_answer, []

        def keep(*args, edit=lambda answer: None, **kwargs):
            answer = build(*args, **kwargs)
            edit(answer)
            built.append(answer)
            return answer

        monkeypatch.setattr(v1, "predict_answer", keep)
        r = c.post("/predict", json={"image": b64(png(5)), "top_k": 2})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == built[-1] and "members" not in r.json()["predictions"][0]
        assert PredictResponse.model_validate(r.json()).model_dump(exclude_none=True) == r.json()
        assert "null" not in r.text and int(r.headers["content-length"]) == len(r.content)
        null_id = lambda x: x.update(id="null")
        monkeypatch.setattr(v1, "predict_answer", lambda *a, **k: keep(*a, edit=null_id, **k))
        r = c.post("/predict", json={"image": b64(png(5))})
        assert r.status_code == 200 and r.json() == built[-1] and r.json()["id"] == "null"
        nan = lambda x: x["predictions"][0]["uncertainty"].update(entropy=float("nan"))
        monkeypatch.setattr(v1, "predict_answer", lambda *a, **k: keep(*a, edit=nan, **k))
        assert_error(c.post("/predict", json={"image": b64(png(5))}), 500, "internal")
        # the same through FastAPI's route (a multipart request): one handler for both
        monkeypatch.setattr(v1, "predict_answer", keep)
        r = c.post("/predict", files=[("file", ("a.png", png(5), "image/png"))])
        assert r.status_code == 200 and r.json() == built[-1]


# ----------------------------------------------------------------------------- the three backends
def test_three_backends_give_the_same_answers_through_the_api(artifacts):
    imgs = [b64(png(a)) for a in noise_images(4, seed=5)]
    answers = {}
    for backend in ("torch", "torchscript", "onnx"):
        app = create_app(settings_for(artifacts["vit"], artifacts["bert"], backend=backend, precision="fp32"))
        with TestClient(app) as c:
            described = {m["name"]: m for m in c.get("/v1/models").json()["models"]}
            assert {m["backend"] for m in described.values()} == {backend}
            answers[backend] = (
                c.post("/predict", json={"images": imgs, "return_members": True}).json()["predictions"],
                c.post("/predict", json={"texts": TEXTS, "return_members": True}).json()["predictions"],
            )
    for backend in ("torchscript", "onnx"):
        for got, want in zip(answers[backend], answers["torch"], strict=True):
            for p, q in zip(got, want, strict=True):
                assert p["label"] == q["label"] and p["ood"]["flag"] == q["ood"]["flag"]
                assert p["confidence"] == pytest.approx(q["confidence"], abs=1e-5)
                for key in p["uncertainty"]:
                    assert p["uncertainty"][key] == pytest.approx(q["uncertainty"][key], abs=1e-5)
                assert p["members"] == [
                    {"label": m["label"], "confidence": pytest.approx(m["confidence"], abs=1e-5)} for m in q["members"]
                ]


def test_bf16_eager_backend_serves_and_reports_it(artifacts):
    app = create_app(settings_for(artifacts["vit"], backend="torch", precision="bf16"))
    with TestClient(app) as c:
        (m,) = c.get("/v1/models").json()["models"]
        assert (m["backend"], m["precision"]) == ("torch", "bf16")
        r = c.post("/predict", json={"image": b64(png(9))})
        assert r.status_code == 200 and 0 < r.json()["predictions"][0]["confidence"] <= 1


# ----------------------------------------------------------------------------- errors
BAD_JSON = [
    # (body, status, code, fragments)
    (b"{not json", 400, "invalid_input", ["malformed JSON"]),
    (b"", 400, "invalid_input", ["empty request body"]),
    (b"[1, 2]", 422, "invalid_input", ["invalid request"]),
    (b'{"texts": "abc"}', 422, "invalid_input", ["texts"]),
    (b'{"texts": []}', 422, "invalid_input", ["texts"]),
    (b'{"text": ""}', 422, "invalid_input", ["text"]),
    (b'{"text": "a", "image": "aGk="}', 422, "invalid_input", ["exactly one of text, texts, image, images"]),
    (b"{}", 422, "invalid_input", ["exactly one"]),
    (b'{"text": "a", "colour": "red"}', 422, "invalid_input", ["colour: unknown field"]),
    (b'{"text": "a", "top_k": 0}', 422, "invalid_input", ["top_k"]),
    (b'{"text": "a", "top_k": "3"}', 422, "invalid_input", ["top_k"]),
    (b'{"text": "a", "return_members": "yes"}', 422, "invalid_input", ["return_members"]),
    (b'{"text": "   "}', 400, "invalid_input", ["text: empty text"]),
    (b'{"texts": ["ok", "\\t"]}', 400, "invalid_input", ["texts[1]: empty text"]),
    (b'{"image": "!!!not-base64"}', 400, "invalid_input", ["image: not valid base64"]),
    (b'{"images": ["aGVsbG8gd29ybGQ="]}', 400, "invalid_input", ["images[0]: not a decodable image"]),
    (b'{"text": "a", "model": "nope"}', 400, "invalid_input", ["unknown model 'nope'"]),
    (b'{"text": "a", "model": "tiny-vit"}', 400, "invalid_input", ["takes image inputs, not text"]),
]


@pytest.mark.parametrize(("body", "status", "code", "fragments"), BAD_JSON)
def test_bad_json_requests(client, body, status, code, fragments):
    r = client.post("/predict", content=body, headers={"content-type": "application/json"})
    assert_error(r, status, code, *fragments)


def test_limits_on_items_and_text_length(client):
    s = client.app.state.hydra.settings
    assert_error(
        client.post("/predict", json={"texts": ["a"] * (s.max_items + 1)}),
        400,
        "invalid_input",
        f"{s.max_items + 1} inputs",
        "HYDRA_MAX_ITEMS",
    )
    assert_error(
        client.post("/predict", json={"text": "x" * (s.max_text_chars + 1)}),
        400,
        "invalid_input",
        "HYDRA_MAX_TEXT_CHARS",
    )
    assert client.post("/predict", json={"text": "x" * s.max_text_chars}).status_code == 200  # truncated to 48 tokens


def test_images_refused_by_kind(client):
    assert_error(client.post("/predict", json={"image": b64(png(1, fmt="GIF"))}), 415, "unsupported_media_type", "GIF")
    bomb = huge_png_header(20_000, 20_000)
    assert_error(client.post("/predict", json={"image": b64(bomb)}), 413, "payload_too_large", "HYDRA_MAX_IMAGE_PIXELS")
    truncated = png(noise_images(1)[0])[:80]
    assert_error(
        client.post("/predict", files=[("file", ("t.png", truncated, "image/png"))]), 400, "invalid_input", "file"
    )


def test_content_types(client):
    assert_error(
        client.post("/predict", content=b"hello", headers={"content-type": "text/plain"}),
        415,
        "unsupported_media_type",
        "text/plain",
        "application/json",
    )
    assert_error(client.post("/predict", content=b"hello"), 415, "unsupported_media_type", "(none)")
    assert_error(
        client.post("/zero-shot", content=b"<x/>", headers={"content-type": "application/xml"}),
        415,
        "unsupported_media_type",
    )


def test_multipart_errors(client):
    f = [("file", ("a.png", png(4), "image/png"))]
    assert_error(client.post("/predict", data={"top_k": "2"}, files={"x": ("", b"")}), 422, "invalid_input", "x")
    assert_error(client.post("/predict", files=f, data={"colour": "red"}), 422, "invalid_input", "colour")
    assert_error(client.post("/predict", files=f, data={"top_k": "many"}), 422, "invalid_input", "top_k")
    assert_error(client.post("/predict", files=f, data={"top_k": "0"}), 422, "invalid_input", "top_k")
    broken = b"--b\r\n\r\n--b--\r\n"  # a part without Content-Disposition
    r = client.post("/predict", content=broken, headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input"
    assert_error(
        client.post("/predict", data={"file": "not a file"}, files={"z": ("z", b"")}), 400, "invalid_input", "file"
    )


def test_not_found_and_method_not_allowed(client):
    assert_error(client.get("/nope"), 404, "not_found", "/nope")
    assert_error(client.get("/predict"), 405, "method_not_allowed", "GET")
    assert_error(client.delete("/healthz"), 405, "method_not_allowed")


def test_fastapi_validation_errors_use_the_contract_body(artifacts):
    app = create_app(settings_for(artifacts["vit"]))

    @app.get("/probe")
    async def probe(n: int) -> dict:
        return {"n": n}

    c = TestClient(app)  # no lifespan needed
    assert c.get("/probe?n=3").json() == {"n": 3}
    assert_error(c.get("/probe?n=three"), 422, "invalid_input", "n:")
    assert_error(c.get("/probe"), 422, "invalid_input", "n:")


def test_body_size_limit(artifacts):
    app = create_app(settings_for(artifacts["vit"], max_body_bytes=2048))
    big = {"image": b64(png(noise_images(1, size=64)[0]))}
    assert len(big["image"]) > 2048
    with TestClient(app) as c:
        assert_error(c.post("/predict", json=big), 413, "payload_too_large", "HYDRA_MAX_BODY_BYTES")

        def chunks():  # no Content-Length: the streamed size is counted
            for _ in range(8):
                yield b" " * 512

        r = c.post("/predict", content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, "payload_too_large", "HYDRA_MAX_BODY_BYTES")
        files = [("file", ("a.png", b"\x89PNG" + b"0" * 4000, "image/png"))]
        assert_error(c.post("/predict", files=files), 413, "payload_too_large")
        assert c.post("/predict", json={"image": b64(png(1))}).status_code == 200


def test_routing_between_models(artifacts, tmp_path):
    other = make_tiny_artifact(tmp_path / "vit2", "vit", name="tiny-vit-2", seed=5, exports=())
    app = create_app(settings_for(artifacts["vit"], other, artifacts["bert"]))
    with TestClient(app) as c:
        assert_error(
            c.post("/predict", json={"image": b64(png(1))}), 400, "invalid_input", "several models", "tiny-vit-2"
        )
        a = c.post("/predict", json={"image": b64(png(1)), "model": "tiny-vit"}).json()
        b = c.post("/predict", json={"image": b64(png(1)), "model": "tiny-vit-2"}).json()
        assert (a["model"], b["model"]) == ("tiny-vit", "tiny-vit-2")
        assert a["predictions"][0]["top_k"] != b["predictions"][0]["top_k"]
        assert c.post("/predict", json={"text": "routed by modality"}).json()["model"] == "tiny-bert"
        assert {m["backend"] for m in c.get("/v1/models").json()["models"]} == {"onnx", "torch"}  # no ONNX: torch


def test_zero_shot_without_a_zero_shot_model(client):
    body = {"image": b64(png(1)), "labels": ["cat", "dog"]}
    assert_error(client.post("/zero-shot", json=body), 400, "invalid_input", "no zero-shot model is loaded")
    files = [("file", ("a.png", png(1), "image/png"))]
    r = client.post("/zero-shot", files=files, data={"labels": '["cat", "dog"]'})
    assert_error(r, 400, "invalid_input", "no zero-shot model is loaded")
    assert_error(client.post("/zero-shot", json={**body, "labels": ["cat"]}), 422, "invalid_input", "labels")
    assert_error(
        client.post("/zero-shot", json={**body, "template": "no placeholder"}), 422, "invalid_input", "{label}"
    )
    assert_error(client.post("/zero-shot", json={**body, "labels": ["cat", "cat"]}), 422, "invalid_input", "duplicate")
    assert_error(
        client.post("/zero-shot", json={**body, "model": "tiny-vit"}), 400, "invalid_input", "classification model"
    )


def test_overloaded_queue_answers_503_with_retry_after(artifacts):
    app = create_app(settings_for(artifacts["vit"], max_batch=2, max_wait_ms=0, max_queue=2, max_items=2))
    running, gate = threading.Event(), threading.Event()
    with TestClient(app) as c:
        rt = app.state.hydra.runtimes["tiny-vit"]
        inner = rt.backend

        def blocked(inputs):
            running.set()
            gate.wait(10)
            return inner.outputs(inputs)

        rt.backend = SimpleNamespace(outputs=blocked)
        two = {"images": [b64(png(1))] * 2}
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(c.post, "/predict", json=two)  # taken into a batch: blocks the worker
            assert running.wait(10)
            second = pool.submit(c.post, "/predict", json=two)  # waits in the queue: 2 inputs, the limit
            for _ in range(1000):
                if rt.batcher.depth == 2:
                    break
                time.sleep(0.01)
            r = c.post("/predict", json={"image": b64(png(1))})  # 2 + 1 > HYDRA_MAX_QUEUE
            assert_error(r, 503, "overloaded", "HYDRA_MAX_QUEUE")
            assert int(r.headers["retry-after"]) >= 1
            gate.set()
            assert first.result(30).status_code == 200 and second.result(30).status_code == 200
        assert c.post("/predict", json=two).status_code == 200


def test_not_ready_without_lifespan(artifacts):
    c = TestClient(create_app(settings_for(artifacts["vit"])))  # lifespan not run: nothing loaded
    assert_error(c.get("/readyz"), 503, "not_ready")
    assert_error(c.post("/predict", json={"image": b64(png(1))}), 503, "not_ready")
    assert c.get("/healthz").status_code == 200


# ----------------------------------------------------------------------------- auth and CORS
def test_bearer_auth(artifacts, caplog):
    key = "s3cret-token-value"
    app = create_app(settings_for(artifacts["vit"], api_key=key))
    caplog.set_level("DEBUG")
    with TestClient(app) as c:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert c.get(path).status_code == 200, path
        body = {"image": b64(png(1))}
        r = c.post("/predict", json=body)
        assert_error(r, 401, "unauthorized", "Authorization: Bearer")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.post("/predict", json=body, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
        assert_error(c.post("/predict", json=body, headers={"Authorization": key}), 401, "unauthorized")
        assert_error(c.post("/predict", json=body, headers={"Authorization": f"Basic {key}"}), 401, "unauthorized")
        for path in ("/v1/models", "/docs", "/docs/assets/swagger-ui-bundle.js", "/openapi.json", "/nope"):
            assert_error(c.get(path), 401, "unauthorized")  # /docs' assets need the key as /docs does
        ok = {"Authorization": f"Bearer {key}"}
        assert c.post("/predict", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 200
        assert key not in c.get("/metrics").text and key not in c.get("/v1/models", headers=ok).text
    assert key not in caplog.text


def test_auth_off_by_default_and_cors(client, artifacts):
    assert client.get("/v1/models").status_code == 200
    r = client.get("/healthz", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers  # CORS off by default
    app = create_app(settings_for(artifacts["vit"], cors_origins="https://ui.example"))
    c = TestClient(app)
    r = c.options("/predict", headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "access-control-allow-origin" not in c.get("/healthz", headers={"Origin": "https://evil.example"}).headers
