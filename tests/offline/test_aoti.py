"""The AOTInductor export (``export.aoti: true``): ``model.pt2`` compiled ahead of time for the CPU, checked against
eager at build time on both outputs, listed in the manifest, and served by ``HYDRA_BACKEND=aoti`` with the answers
the ONNX Runtime backend gives for the same texts (batch sizes and lengths the build never compiled for)."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from offline.build import build
from service.core.artifact import load_manifest
from service.core.backends import BackendConfigError
from service.entrypoints.app import create_app
from service.runtime.plan import resolve_plan
from tests.service.helpers import settings_for

from .conftest import ticket_config

TEXTS = [
    "I was charged twice on my card and nobody answers",
    "where is my parcel",
    "thanks, great service",
    "refund please",
    "the courier left it at the wrong address again, third time this month",
]


@pytest.fixture(scope="module")
def artifact(user_files, tmp_path_factory):
    ckpt, data = user_files
    cfg = ticket_config(ckpt, data, **{"export.aoti": True})
    return build(cfg, tmp_path_factory.mktemp("aoti") / "artifact")


def test_the_package_is_checked_listed_and_served_like_onnx(artifact):
    m = load_manifest(artifact)
    exp = m.exports["aoti"]
    assert exp.file == "model.pt2" and exp.max_abs_diff <= exp.tolerance
    assert "model.pt2" in m.files
    answers = {}
    for backend in ("aoti", "onnx"):
        with TestClient(create_app(settings_for(artifact, backend=backend))) as c:
            for texts in (TEXTS, TEXTS[1:2]):  # a batch of mixed lengths (padded), and one short text alone
                r = c.post("/predict", json={"texts": texts, "top_k": 3, "return_scores": True})
                assert r.status_code == 200, r.text
                answers[backend, len(texts)] = r.json()["predictions"]
            (info,) = c.get("/v1/models").json()["models"]
            assert info["backend"] == backend
    for n in (len(TEXTS), 1):
        for a, o in zip(answers["aoti", n], answers["onnx", n], strict=True):
            got = torch.tensor([t["prob"] for t in a["top_k"]])
            want = torch.tensor([t["prob"] for t in o["top_k"]])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert a["ood"]["metric"] == o["ood"]["metric"] and a["ood"]["flag"] == o["ood"]["flag"]
            assert a["ood"]["score"] == pytest.approx(o["ood"]["score"], abs=1e-3)  # the features agree too


def test_asking_for_aoti_without_a_package_is_one_clear_error(artifact):
    m = load_manifest(artifact)
    m = m.model_copy(update={"exports": {k: e for k, e in m.exports.items() if k != "aoti"}})
    with pytest.raises(BackendConfigError, match="no AOTInductor package"):
        resolve_plan(m, backend="aoti")
    with pytest.raises(BackendConfigError, match="compiled for the CPU"):
        resolve_plan(load_manifest(artifact), backend="aoti", device="cuda", cuda_available=True)
