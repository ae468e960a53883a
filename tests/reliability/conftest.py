"""The reliability suite's tiny artifacts (random-init fused ViT and BERT), built once per session.

``artifact_copy`` and ``client`` come from tests/conftest.py and use these.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_artifact import tiny_artifacts


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"vit": dir, "bert": dir}``: the ViT with TorchScript and ONNX exports, the BERT with ONNX."""
    return tiny_artifacts(tmp_path_factory.mktemp("reliability-artifacts"), bert_exports=("onnx",))
