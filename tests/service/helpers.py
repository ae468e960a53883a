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

from service.core.artifact import Manifest
from service.settings import Settings

# the blocks of a small valid manifest of each task (JSON form), for tests that need a manifest but no artifact
_BLOCKS: dict[str, dict[str, Any]] = {
    "classification": {
        "family": "vit",
        "heads": [[[0, 1]]],
        "labels": ["a", "b"],
        "preprocessing": {"type": "image", "size": [8, 8], "mean": [0.5], "std": [0.5], "channels": 1},
        "model": {"config": {"arch": "vit", "num_classes": 2}, "inputs": ["pixel_values"]},
    },
    "zero-shot": {
        "family": "clip",
        "heads": [{"vision": [[0]], "text": [[0]]}],
        "zero_shot": {"logit_scale": 10.0, "embed_dim": 4},
        "preprocessing": {
            "type": "image",
            "size": [8, 8],
            "mean": [0.5],
            "std": [0.5],
            "text": {"max_length": 8},
        },
        "model": {"config": {"arch": "clip"}, "inputs": ["pixel_values", "input_ids", "attention_mask"]},
    },
}


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
        # the prediction store off: a test writes nothing under the machine's home (store tests give a tmp state_dir
        # or a store_url)
        "store": False,
    }
    return Settings(**{**base, **overrides})


def manifest_of(task: str = "classification", **fields: Any) -> Manifest:
    """A valid one-member manifest of ``task`` without files (a vit classifier over two labels, or a zero-shot
    CLIP); ``fields`` replace its top-level fields (in their JSON form)."""
    doc = {
        "name": "m",
        "task": task,
        "base_model": {"name": "test"},
        "members": 1,
        "strategy": {"name": "random", "seeds": [0]},
        "uncertainty": {"temperature": 1.0, "ood_score": "msp", "ood_threshold": 0.5},
        **_BLOCKS[task],
        **fields,
    }
    return Manifest.model_validate(doc)


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
