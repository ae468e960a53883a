"""Start-up and shutdown: artifact verification, readiness only after warm-up, draining in-flight requests,
nothing loaded at import, the server not importing the builder, ``python -m service``."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from benchmarks.harness import free_port
from service.core.artifact import load_manifest
from service.entrypoints.app import create_app
from service.entrypoints.cli import freeze_startup_heap
from service.lifecycle import StartupError
from service.runtime import ClassifierRuntime
from service.settings import Settings
from tests.service.helpers import b64, hold_warmup, png, settings_for

ROOT = Path(__file__).resolve().parents[2]


def start(settings: Settings) -> None:
    with TestClient(create_app(settings)):
        pass


def test_corrupt_file_refuses_start_naming_it(artifact_copy):
    art = artifact_copy("vit")
    weights = art / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    with pytest.raises(StartupError, match=r"refusing to start: .*model\.safetensors: sha256 .* \(corrupt\?\)"):
        start(settings_for(art))


def test_missing_file_refuses_start_naming_it(artifact_copy):
    art = artifact_copy("bert")
    (art / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(StartupError, match=r"tokenizer/tokenizer\.json: listed in the manifest but missing"):
        start(settings_for(art))


def test_missing_directory_and_bad_manifest(tmp_path, artifact_copy):
    with pytest.raises(StartupError, match=f"{tmp_path / 'nowhere'}: artifact directory does not exist"):
        start(settings_for(tmp_path / "nowhere"))
    art = artifact_copy("vit")
    (art / "manifest.json").write_text("{broken")
    with pytest.raises(StartupError, match=r"manifest\.json: unreadable manifest"):
        start(settings_for(art))
    with pytest.raises(StartupError, match="HYDRA_ARTIFACTS is empty"):
        start(Settings(artifacts=""))


def test_impossible_backend_and_duplicate_names_refuse_start(artifacts):
    with pytest.raises(StartupError, match="HYDRA_BACKEND=torchscript.*|fp32 only"):
        start(settings_for(artifacts["vit"], backend="torchscript", precision="bf16"))
    with pytest.raises(StartupError, match="'tiny-vit' is already used"):
        start(settings_for(artifacts["vit"], artifacts["vit"]))


def test_settings_are_validated(monkeypatch):
    for key in [k for k in os.environ if k.startswith("HYDRA_")]:
        monkeypatch.delenv(key)
    d = Settings()
    assert (d.artifacts, d.host, d.port, d.cors_origins, d.api_key) == ([], "127.0.0.1", 8000, [], None)
    assert Settings(api_key="  ").api_key is None  # an empty secret means auth off, not an empty token
    for key, value in {
        "HYDRA_ARTIFACTS": " a, b ,,",
        "HYDRA_MAX_BATCH": "8",
        "HYDRA_PORT": "9000",
        "HYDRA_API_KEY": "tok-9f8e7d",
        "HYDRA_CORS_ORIGINS": "https://a.example,https://b.example",
        "HYDRA_LOG_LEVEL": "WARNING",
    }.items():
        monkeypatch.setenv(key, value)
    s = Settings()
    assert s.artifacts == ["a", "b"] and s.max_batch == 8 and s.port == 9000 and s.log_level == "warning"
    assert s.api_key.get_secret_value() == "tok-9f8e7d" and "tok-9f8e7d" not in repr(s)
    assert s.cors_origins == ["https://a.example", "https://b.example"]
    for bad in (
        {"max_batch": 0},
        {"device": "tpu"},
        {"backend": "tensorrt"},
        {"precision": "fp8"},
        {"port": 0},
        {"max_wait_ms": -1},
        {"max_queue": 4, "max_items": 8},
        {"unknown_setting": 1},
        {"loop": "trio"},
        {"http": "zttp"},
    ):
        with pytest.raises(ValidationError):
            Settings(**bad)


def test_readyz_is_503_until_warm_up_finished(artifacts, monkeypatch):
    started, release = hold_warmup(monkeypatch, ClassifierRuntime)
    app = create_app(settings_for(artifacts["vit"]))
    serving = TestClient(app)
    starter = threading.Thread(target=serving.__enter__)
    starter.start()
    try:
        assert started.wait(60), "warm-up never began"
        probe = TestClient(app)  # same app, no lifespan of its own: sees the state mid start-up
        r = probe.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert probe.get("/healthz").status_code == 200
        assert app.state.hydra.runtimes["tiny-vit"].ready is False
    finally:
        release.set()
        starter.join(60)
    try:
        assert serving.get("/readyz").status_code == 200
    finally:
        serving.__exit__(None, None, None)
    assert TestClient(app).get("/readyz").status_code == 503  # not ready again after shutdown


def test_on_ready_is_called_once_every_model_is_warm(artifacts):
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"]))
    state = app.state.hydra
    seen = []
    state.on_ready = lambda: seen.append((state.ready, all(rt.ready for rt in state.runtimes.values())))
    with TestClient(app) as c:
        assert seen == [(True, True)] and c.get("/readyz").status_code == 200


def test_python_m_service_freezes_the_start_up_heap():
    """What ``python -m service`` does once ready: the objects alive then leave the collector's generations."""
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 10_000 and len(gc.get_objects()) < 1_000
    finally:
        gc.unfreeze()  # this test process goes on creating and dropping apps


def test_shutdown_finishes_in_flight_requests(artifacts):
    """Lifespan shutdown (what uvicorn runs after SIGTERM): not ready, new requests refused, queued ones answered."""
    app = create_app(settings_for(artifacts["vit"], max_batch=1, max_wait_ms=0))
    gate = threading.Event()

    async def main() -> tuple[list[int], int]:
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        rt = app.state.hydra.runtimes["tiny-vit"]
        inner = rt.backend
        rt.backend = SimpleNamespace(outputs=lambda inputs: (gate.wait(10), inner.outputs(inputs))[1])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            in_flight = [asyncio.create_task(c.post("/predict", json={"image": b64(png(i))})) for i in range(3)]
            while rt.batcher.depth < 2:  # one running, two queued
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(lifespan.__aexit__(None, None, None))
            await asyncio.sleep(0.05)
            assert not app.state.hydra.ready
            late = await c.post("/predict", json={"image": b64(png(9))})
            gate.set()
            await stopping
            return [(await t).status_code for t in in_flight], late.status_code

    statuses, late = asyncio.run(main())
    assert statuses == [200, 200, 200] and late == 503


def test_import_loads_nothing_and_server_does_not_import_the_builder():
    code = (
        "import sys, service.entrypoints.app as m, service.entrypoints.cli;"
        "assert m.app.state.hydra.runtimes == {} and not m.app.state.hydra.ready;"
        "bad = sorted({n.split('.')[0] for n in sys.modules} & {'offline', 'timm', 'open_clip', 'sklearn'});"
        "print(bad)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HYDRA_ARTIFACTS", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_python_m_service_serves_and_stops_on_sigterm(artifacts, artifact_copy):
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HYDRA_ARTIFACTS": str(artifacts["vit"]),
        "HYDRA_PORT": str(port),
        "HYDRA_LOG_LEVEL": "info",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("server never became ready")
        r = httpx.post(f"{url}/predict", json={"image": b64(png(3))}, timeout=10)
        assert r.status_code == 200 and r.json()["model"] == "tiny-vit"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0  # a graceful stop on SIGTERM exits 0 (service/entrypoints/cli.py)
        assert "stopped: every queued request answered" in err and "Application shutdown complete" in err
    finally:
        if proc.poll() is None:
            proc.kill()
    # a corrupt artifact: exit status 3 and the bad file named in the log
    art = artifact_copy("vit")
    (art / load_manifest(art).export_file("onnx")).write_bytes(b"garbage")
    bad = subprocess.run(
        [sys.executable, "-m", "service"],
        cwd=ROOT,
        env={**env, "HYDRA_ARTIFACTS": str(art)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 3
    assert "model.onnx" in bad.stderr and "refusing to start" in bad.stderr
