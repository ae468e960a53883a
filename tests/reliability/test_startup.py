"""Start-up: artifact files are verified before the server takes connections (a bad or missing file refuses
start-up, naming it), models load and warm up in the background (``/healthz`` 200, ``/readyz`` and inference 503
``not_ready`` until warm), and a failure while loading leaves the server not ready and stops it with a non-zero
status (``python -m service`` exits 4)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from benchmarks.harness import free_port
from service.entrypoints import cli as entry
from service.entrypoints.app import create_app
from service.lifecycle import StartupError
from service.runtime import ClassifierRuntime
from tests.service.helpers import b64, hold_warmup, png, settings_for


def background(*dirs: Path, **kw) -> object:
    return settings_for(*dirs, load_in_background=True, **kw)


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("condition never met")
        time.sleep(0.02)


def test_ready_only_after_warm_up_in_the_background(artifacts, monkeypatch):
    started, release = hold_warmup(monkeypatch, ClassifierRuntime)
    app = create_app(background(artifacts["vit"]))
    try:
        with TestClient(app) as c:  # the lifespan returns after verification: the port would be bound here
            assert started.wait(60), "warm-up never began"
            for _ in range(3):  # answered while the warm-up is blocked
                assert c.get("/healthz").status_code == 200
                r = c.get("/readyz")
                assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
                assert "loading or warming up" in r.json()["error"]["message"]
                r = c.post("/predict", json={"image": b64(png(1))})
                assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            assert "hydra_ready 0.0" in c.get("/metrics").text
            release.set()
            wait_for(lambda: c.get("/readyz").status_code == 200)
            assert c.post("/predict", json={"image": b64(png(1))}).status_code == 200
            assert "hydra_ready 1.0" in c.get("/metrics").text
    finally:
        release.set()
    assert TestClient(app).get("/readyz").status_code == 503  # not ready after shutdown


def test_bad_files_refuse_start_before_anything_loads(artifact_copy, monkeypatch):
    loads = []
    monkeypatch.setattr(ClassifierRuntime, "load", lambda self: loads.append(self.name))
    vit, bert = artifact_copy("vit"), artifact_copy("bert")
    weights = vit / "model.onnx"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(StartupError, match=r"refusing to start: .*vit/model\.onnx: sha256 .* \(corrupt\?\)"):
        with TestClient(create_app(background(bert, vit))):
            pass
    (bert / "tokenizer" / "vocab.txt").unlink(missing_ok=True)
    (bert / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(StartupError, match=r"bert/tokenizer/tokenizer\.json: listed in the manifest but missing"):
        with TestClient(create_app(background(bert))):
            pass
    assert loads == []  # verification happens first, synchronously; nothing was loaded


def test_a_failure_while_loading_keeps_the_server_not_ready_and_calls_on_fatal(artifacts, monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("out of memory while reading the weights")

    monkeypatch.setattr(ClassifierRuntime, "load", broken)
    app = create_app(background(artifacts["vit"]))
    state = app.state.hydra
    fatal: list[str] = []
    state.on_fatal = fatal.append
    with TestClient(app) as c:
        wait_for(lambda: bool(fatal))
        assert "out of memory" in fatal[0] and state.load_error == fatal[0]
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert "loading the models failed" in r.json()["error"]["message"]
        assert "out of memory" not in r.text  # details in the log, not on a public endpoint
        r = c.post("/predict", json={"image": b64(png(1))})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert "cannot serve: loading failed" in caplog.text and "out of memory" in caplog.text


def test_python_m_service_exit_statuses(artifacts, artifact_copy, monkeypatch, capsys, caplog):
    """``service.entrypoints.cli.main`` in-process: 3 when a file is bad (nothing bound), 4 when loading fails later."""
    for key in [k for k in __import__("os").environ if k.startswith("HYDRA_")]:
        monkeypatch.delenv(key)
    art = artifact_copy("vit")
    (art / "model.safetensors").write_bytes(b"not the weights")
    monkeypatch.setenv("HYDRA_ARTIFACTS", str(art))
    monkeypatch.setenv("HYDRA_PORT", str(free_port()))
    monkeypatch.setenv("HYDRA_LOG_LEVEL", "warning")
    monkeypatch.setenv("HYDRA_WORKERS", "1")  # one process: its own log (several workers: test_workers.py)
    assert entry.main([]) == entry.EXIT_REFUSED
    assert "refusing to start" in caplog.text and f"{art}/model.safetensors: size" in caplog.text
    monkeypatch.setenv("HYDRA_ARTIFACTS", str(artifacts["vit"]))

    def broken(self):
        raise RuntimeError("device lost")

    monkeypatch.setattr(ClassifierRuntime, "load", broken)
    t0 = time.monotonic()
    assert entry.main(["--graceful-timeout", "5"]) == entry.EXIT_LOAD_FAILED
    assert time.monotonic() - t0 < 30
    assert "device lost" in caplog.text and "exiting with status 4" in caplog.text
    monkeypatch.setenv("HYDRA_MAX_BATCH", "0")
    assert entry.main([]) == entry.EXIT_SETTINGS
    assert "HYDRA_* settings" in capsys.readouterr().err
