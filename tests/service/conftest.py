"""Tiny artifacts (random-init fused ViT and BERT with TorchScript and ONNX exports), built once per session."""

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
    """``{"vit": dir, "bert": dir}``: both exports each, ``bf16.ok`` true, MSP threshold 0.45, T = 1.5."""
    root = tmp_path_factory.mktemp("artifacts")
    return {
        "vit": make_tiny_artifact(root / "vit", "vit", name="tiny-vit", seed=0),
        "bert": make_tiny_artifact(root / "bert", "bert", name="tiny-bert", seed=1),
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
    """Both tiny models, default backend choice (ONNX on CPU), no auth."""
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"]))
    with TestClient(app) as c:
        yield c
