"""Security: the API key is compared in constant time and never appears in logs or errors; CORS is off by
default; no endpoint reads a file path from the request; artifacts load without pickle."""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import pickle
import re
import urllib.parse
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

import service.api.middleware
import service.entrypoints.app
from service.entrypoints.app import create_app
from service.settings import Settings
from tests.service.helpers import b64, png, settings_for

KEY = "sec-Zz81-bearer-key-do-not-log"
SERVICE = Path(service.entrypoints.app.__file__).resolve().parent


def test_key_compared_by_digest_in_constant_time(artifacts, monkeypatch):
    import hmac

    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(service.api.middleware.hmac, "compare_digest", spy)
    app = create_app(settings_for(artifacts["vit"], api_key=KEY))
    c = TestClient(app)  # auth is checked before anything is loaded
    for token in ("x", KEY[:-1], KEY + "x", "y" * 5000, KEY.upper()):
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401 and r.json()["error"] == {"code": "unauthorized", "message": "invalid bearer token"}
    assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # every comparison is of two SHA-256 digests: the time depends neither on the key's content nor on its length
    assert calls == [(32, 32)] * 6
    guard = app.context
    while not isinstance(guard, service.api.middleware.Front):
        guard = guard.app
    assert guard._key_digest == hashlib.sha256(KEY.encode()).digest()
    assert not [k for k, v in vars(guard).items() if v in (KEY, KEY.encode())]  # only the digest is kept


def test_key_never_in_logs_errors_or_answers(artifacts, caplog):
    caplog.set_level("DEBUG")
    app = create_app(settings_for(artifacts["vit"], api_key=KEY, log_level="debug"))
    ok = {"Authorization": f"Bearer {KEY}"}
    texts = []
    with TestClient(app, raise_server_exceptions=False) as c:
        for headers in (
            {},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": f"Bearer {KEY}!"},
            {"Authorization": f"bearer  {KEY} "},
            ok,
        ):
            r = c.post("/predict", json={"image": b64(png(1))}, headers=headers)
            texts.append(r.text)
        # the key as a field's value (what a confused client might send): never echoed back
        for body in ({"text": "x", "api_key": KEY}, {"image": KEY}, {"images": [KEY]}, {"text": KEY, "top_k": KEY}):
            r = c.post("/predict", json=body, headers=ok)
            assert r.status_code in (400, 422)
            texts.append(r.text)
        for path in ("/v1/models", "/metrics", "/readyz", "/openapi.json", "/nope"):
            texts.append(c.get(path, headers=ok).text)
    assert not any(KEY in t for t in texts), [t for t in texts if KEY in t]
    assert KEY not in caplog.text
    assert KEY not in repr(app.state.hydra.settings) and KEY not in str(app.state.hydra.settings)
    with pytest.raises(ValidationError) as e:  # what `python -m service` prints for bad settings
        Settings(api_key=KEY, max_batch=0)
    assert KEY not in str(e.value)


def test_cors_is_off_by_default(artifacts):
    c = TestClient(create_app(settings_for(artifacts["vit"])))
    pre = c.options("/predict", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert not any(h.startswith("access-control-") for h in pre.headers)
    r = c.get("/healthz", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    c = TestClient(create_app(settings_for(artifacts["vit"], cors_origins="https://ui.example")))
    pre = c.options("/predict", headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert pre.headers["access-control-allow-origin"] == "https://ui.example"
    pre = c.options("/predict", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_no_endpoint_reads_a_path_from_the_request(artifacts, monkeypatch):
    app = create_app(settings_for(artifacts["vit"]))
    # no route takes a path parameter but the Open Inference Protocol's model name and version (looked up among
    # the loaded models, never opened); nothing serves files
    params = {p for r in app.routes for p in re.findall(r"{(\w+)", getattr(r, "path", ""))}
    assert params <= {"model_name", "model_version"}, params
    for py in SERVICE.glob("*.py"):
        src = py.read_text()
        for bad in ("path_params", "FileResponse", "StaticFiles", "query_params"):
            assert bad not in src, f"{py.name} uses {bad}"
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file, *a, **kw):
        opened.append(str(file))
        return real_open(file, *a, **kw)

    def spy_os_open(path, *a, **kw):
        opened.append(str(path))
        return real_os_open(path, *a, **kw)

    hostile = [
        "/etc/passwd",
        "../../../../etc/passwd",
        str(artifacts["vit"]),
        str(artifacts["vit"] / "model.onnx"),
        "file:///etc/passwd",
        "\\\\server\\share\\passwd",
    ]
    with TestClient(app) as c:
        monkeypatch.setattr(builtins, "open", spy_open)
        monkeypatch.setattr(io, "open", spy_open)
        monkeypatch.setattr(os, "open", spy_os_open)
        open(os.devnull).close()  # the spy sees opens
        assert opened == [os.devnull]
        for value in hostile:
            r = c.post("/predict", json={"image": b64(png(1)), "model": value})
            assert r.status_code == 400 and "unknown model" in r.json()["error"]["message"]
            r = c.post("/predict", json={"image": value})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input"
            r = c.post("/predict", files=[("file", (value, png(2), "image/png"))])
            assert r.status_code == 200  # the part's file name is ignored: the bytes are the image
            r = c.post("/zero-shot", json={"image": b64(png(1)), "labels": [value, "b"], "template": "{label}"})
            assert r.status_code == 400
            quoted = urllib.parse.quote(value, safe="")
            name = c.get("/v1/models").json()["models"][0]["name"]
            assert c.get(f"/v2/models/{name}/ready").status_code == 200
            for path in (f"/v2/models/{quoted}/ready", f"/v2/models/{quoted}", f"/v2/models/{name}/versions/{quoted}"):
                assert c.get(path).status_code == 404, path  # an unknown model or version, never a file
        monkeypatch.undo()
    assert not [p for p in opened if "passwd" in p or str(artifacts["vit"]) in p], opened


def test_artifacts_load_without_pickle(artifacts, monkeypatch):
    for py in SERVICE.glob("*.py"):
        src = py.read_text()
        assert not re.search(r"^\s*(import pickle|from pickle|import dill|import joblib)", src, re.M), py.name
        assert "torch.load(" not in src and "allow_pickle=True" not in src and "weights_only=False" not in src

    def refuse(*a, **kw):
        raise AssertionError("pickle used while loading an artifact")

    class NoUnpickler:
        def __init__(self, *a, **kw) -> None:
            refuse()

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    for backend in ("torch", "torchscript", "onnx"):  # safetensors; TorchScript's C++ reader; protobuf
        extra = [artifacts["bert"]] if backend != "torchscript" else []  # the BERT has no TorchScript export
        app = create_app(settings_for(artifacts["vit"], *extra, backend=backend, precision="fp32"))
        with TestClient(app) as c:
            assert c.get("/readyz").status_code == 200
            assert {m["backend"] for m in c.get("/v1/models").json()["models"]} == {backend}
            assert c.post("/predict", json={"image": b64(png(3))}).status_code == 200
            if extra:
                assert c.post("/predict", json={"text": "tokenizer.json, no pickle"}).status_code == 200
