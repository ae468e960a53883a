"""Faults inside the server: a backend exception fails only its batch's requests (``internal``, no details) and
the server stays ready; after ``HYDRA_UNREADY_AFTER_FAILURES`` failed batches in a row ``/readyz`` turns 503 until
a probe batch (or any request) runs again."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from service.core.errors import InvalidInput
from service.entrypoints.app import create_app
from service.runtime.batching import Batcher, BatchLimits
from tests.service.helpers import b64, noise_images, png, settings_for


class Switch:
    """Wraps a backend: raises (a message with internals) while ``broken``; counts the calls."""

    def __init__(self, inner) -> None:
        self.inner, self.broken, self.calls = inner, False, 0
        self.lock = threading.Lock()

    def outputs(self, inputs):
        with self.lock:
            self.calls += 1
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access at /opt/secret/kernels.cu:77")
        return self.inner.outputs(inputs)


def metric(c: TestClient, line_start: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in /metrics")


def test_a_failing_batch_fails_only_its_requests_and_the_server_stays_ready(artifacts):
    app = create_app(settings_for(artifacts["vit"], max_wait_ms=200, max_batch=8, unready_after_failures=5))
    good = [b64(png(a)) for a in noise_images(4, seed=11)]
    with TestClient(app) as c:
        rt = app.state.hydra.runtimes["tiny-vit"]
        sw = rt.backend = Switch(rt.backend)
        sw.broken = True
        with ThreadPoolExecutor(max_workers=4) as pool:  # one shared batch, then each request alone: all fail
            res = list(pool.map(lambda g: c.post("/predict", json={"image": g}), good))
        for r in res:
            assert r.status_code == 500 and r.json() == {
                "error": {"code": "internal", "message": "inference failed; the server log has the details"}
            }
        # a failed batch counts once, its one-by-one retries included: at most one count per request
        assert 1 <= rt.batcher.consecutive_failures <= len(good)
        assert c.get("/readyz").status_code == 200  # below the threshold: still ready
        sw.broken = False
        assert all(c.post("/predict", json={"image": g}).status_code == 200 for g in good)
        assert rt.batcher.consecutive_failures == 0
        assert metric(c, 'hydra_batch_errors_total{model="tiny-vit"}') >= 1


def test_readiness_goes_false_after_n_failed_batches_and_a_probe_brings_it_back(artifacts, caplog):
    n = 3
    app = create_app(settings_for(artifacts["vit"], unready_after_failures=n, probe_interval_s=0.2))
    image = {"image": b64(png(5))}
    with TestClient(app) as c:
        rt = app.state.hydra.runtimes["tiny-vit"]
        sw = rt.backend = Switch(rt.backend)
        sw.broken = True
        for i in range(n):
            assert c.get("/readyz").status_code == 200, f"unready after {i} failed batches"
            assert c.post("/predict", json=image).status_code == 500
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert "tiny-vit failed 3 or more batches in a row" in r.json()["error"]["message"]
        assert "secret" not in r.text
        assert metric(c, 'hydra_model_healthy{model="tiny-vit"}') == 0 and metric(c, "hydra_ready") == 0
        calls = sw.calls
        time.sleep(0.7)
        assert sw.calls >= calls + 2  # probe batches keep running while the model fails
        assert c.get("/readyz").status_code == 503
        sw.broken = False  # the device recovers: the next probe succeeds without any client request
        deadline = time.monotonic() + 10
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never ready again"
            time.sleep(0.05)
        assert metric(c, 'hydra_model_healthy{model="tiny-vit"}') == 1 and metric(c, "hydra_ready") == 1
        assert c.post("/predict", json=image).status_code == 200
    assert "not ready; a probe batch runs every" in caplog.text and "ready again" in caplog.text


def test_a_request_that_runs_also_brings_readiness_back_and_zero_disables(artifacts):
    app = create_app(settings_for(artifacts["vit"], unready_after_failures=2, probe_interval_s=3600))
    image = {"image": b64(png(6))}
    with TestClient(app) as c:
        rt = app.state.hydra.runtimes["tiny-vit"]
        sw = rt.backend = Switch(rt.backend)
        sw.broken = True
        for _ in range(2):
            c.post("/predict", json=image)
        assert c.get("/readyz").status_code == 503
        sw.broken = False
        assert c.post("/predict", json=image).status_code == 200  # requests are still served meanwhile
        assert c.get("/readyz").status_code == 200
    app = create_app(settings_for(artifacts["vit"], unready_after_failures=0))
    with TestClient(app) as c:
        rt = app.state.hydra.runtimes["tiny-vit"]
        sw = rt.backend = Switch(rt.backend)
        sw.broken = True
        for _ in range(10):
            assert c.post("/predict", json=image).status_code == 500
        assert c.get("/readyz").status_code == 200  # 0 = never unready


def test_batcher_health_known_answer():
    """Failed batches in a row -> unhealthy at the threshold; a batch that runs -> healthy; client errors are
    not the model's fault and do not count."""
    events: list[bool] = []
    outcomes = iter(["fail", "fail", "ok", "fail", "client", "fail", "fail", "fail", "ok"])

    def run(items):
        what = next(outcomes)
        if what == "fail":
            raise RuntimeError("boom")
        if what == "client":
            raise InvalidInput("bad input")
        return list(items)

    async def main() -> list[tuple[int, bool]]:
        b = Batcher("m", run, BatchLimits(4, 0, 16), unhealthy_after=3, on_health=events.append)
        b.start()
        trace = []
        for _ in range(9):
            try:
                await b.submit([1])
            except Exception:
                pass
            trace.append((b.consecutive_failures, b.healthy))
        await b.close()
        return trace

    trace = asyncio.run(main())
    assert trace == [
        (1, True),
        (2, True),
        (0, True),
        (1, True),
        (1, True),
        (2, True),
        (3, False),
        (4, False),
        (0, True),
    ]
    assert events == [False, True]


@pytest.mark.parametrize("bad", [0, -1])
def test_unready_setting_is_validated(bad):
    from pydantic import ValidationError

    from service.settings import Settings

    if bad < 0:
        with pytest.raises(ValidationError):
            Settings(unready_after_failures=bad)
    with pytest.raises(ValidationError):
        Settings(probe_interval_s=bad)
