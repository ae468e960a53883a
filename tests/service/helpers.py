"""Helpers shared by the server tests: settings, encoded images, the error body, a held warm-up."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from PIL import Image

from service.settings import Settings


def settings_for(*dirs: Path, **overrides) -> Settings:
    # load_in_background=False: `with TestClient(app)` returns once every model is warm (tests of the background
    # start-up set it back to True)
    # precision="fp32": the suite compares answers with the fp32 model; "auto" would serve bf16 on a CPU with native
    # bf16 (AMX: some machines of CI's kind have it). What "auto" picks is tested in test_backends.py.
    base = {
        "artifacts": [str(d) for d in dirs],
        "device": "cpu",
        "max_wait_ms": 2.0,
        "load_in_background": False,
        "precision": "fp32",
    }
    return Settings(**{**base, **overrides})


def png(value: int | np.ndarray = 128, size: tuple[int, int] = (16, 16), mode: str = "L", fmt: str = "PNG") -> bytes:
    """An encoded image: constant ``value`` or the given uint8 array; ``size`` is (W, H)."""
    if isinstance(value, np.ndarray):
        im = Image.fromarray(value)
    else:
        im = Image.new(mode, size, value if mode == "L" else (value,) * len(mode))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def noise_images(n: int, seed: int = 0, size: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size), dtype=np.uint8) for _ in range(n)]


def assert_error(r: Any, status: int, code: str, *fragments: str) -> dict[str, Any]:
    """The contract's error body (docs/api.md), exactly, with the message naming what is wrong; no stack trace."""
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    msg = body["error"]["message"]
    for f in fragments:
        assert f in msg, (f, msg)
    assert "Traceback" not in r.text and 'File "' not in r.text
    return body


def hold_warmup(monkeypatch: pytest.MonkeyPatch, runtime: type) -> tuple[threading.Event, threading.Event]:
    """Hold ``runtime.warmup`` (a runtime class) until ``release`` is set (at most 30 s); ``started`` is set when a
    warm-up begins. Returns ``(started, release)``."""
    started, release = threading.Event(), threading.Event()
    original = runtime.warmup

    async def gated_warmup(self: Any) -> None:
        started.set()
        await anyio.to_thread.run_sync(release.wait, 30)
        await original(self)

    monkeypatch.setattr(runtime, "warmup", gated_warmup)
    return started, release
