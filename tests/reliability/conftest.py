"""Tiny artifacts for the reliability suite (random-init fused ViT and BERT), built once per session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.main import create_app
from service.tiny_artifact import make_tiny_artifact
from tests.service.helpers import settings_for


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"vit": dir, "bert": dir}``: the ViT with TorchScript and ONNX exports, the BERT with ONNX."""
    root = tmp_path_factory.mktemp("reliability-artifacts")
    return {
        "vit": make_tiny_artifact(root / "vit", "vit", name="tiny-vit", seed=0),
        "bert": make_tiny_artifact(root / "bert", "bert", name="tiny-bert", seed=1, exports=("onnx",)),
    }


@pytest.fixture
def artifact_copy(artifacts: dict[str, Path], tmp_path: Path):
    """``artifact_copy("vit")`` -> a fresh copy of the tiny artifact that a test may damage."""

    def copy(family: str) -> Path:
        dst = tmp_path / family
        shutil.copytree(artifacts[family], dst)
        return dst

    return copy


@pytest.fixture(scope="module")
def client(artifacts: dict[str, Path]) -> Iterator[TestClient]:
    """Both tiny models (ONNX on CPU), no auth, loaded before the first request."""
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"]))
    with TestClient(app) as c:
        yield c
