"""Fixtures shared by the server suites (tests/service, tests/reliability): tiny artifacts and a test client.

``artifacts`` is built once per session per suite: the server suite's here (both exports each); the reliability
suite overrides it in its own conftest (the BERT with ONNX only). ``artifact_copy`` and ``client`` use whichever
``artifacts`` the requesting test's suite defines.
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# servers the tests start (in process or as `python -m service`) keep their default prediction store under a
# throwaway folder, never under the machine's home
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="hydra-test-state-"))

import shutil  # noqa: E402 (after the offline defaults, which transformers reads at import)
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from service.entrypoints.app import create_app  # noqa: E402
from tests.fixtures.tiny_artifact import tiny_artifacts  # noqa: E402
from tests.service.helpers import settings_for  # noqa: E402


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"vit": dir, "bert": dir}``: both exports each, ``bf16.ok`` true, MSP threshold 0.45, T = 1.5."""
    return tiny_artifacts(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture
def artifact_copy(artifacts: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    """``artifact_copy("vit")`` -> a fresh copy of the tiny artifact that a test may damage."""

    def copy(family: str) -> Path:
        dst = tmp_path / family
        shutil.copytree(artifacts[family], dst)
        return dst

    return copy


@pytest.fixture(scope="module")
def client(artifacts: dict[str, Path]) -> Iterator[TestClient]:
    """Both tiny models, default backend choice (ONNX on CPU), no auth, loaded before the first request."""
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"]))
    with TestClient(app) as c:
        yield c
