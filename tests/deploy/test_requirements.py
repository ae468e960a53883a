"""deploy/docker/requirements.py: the pinned requirement list the image installs before copying the source."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.helpers import DEPLOY, ROOT

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ (the image runs 3.12)")

_spec = importlib.util.spec_from_file_location("deploy_docker_requirements", DEPLOY / "docker" / "requirements.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
requirements = _module.requirements

PYPROJECT = """
[project]
name = "demo_pkg"
dependencies = ["a==1", "b>=2"]
[project.optional-dependencies]
x = ["c==3", "a==1"]
y = ["Demo-Pkg[x]", "d==4"]
z = ["demo-pkg[y,x]", "e==5"]
"""


@pytest.fixture
def pyproject(tmp_path: Path) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    return path


def test_known_answers(pyproject: Path) -> None:
    assert requirements(pyproject, []) == ["a==1", "b>=2"]
    assert requirements(pyproject, ["x"]) == ["a==1", "b>=2", "c==3"]
    # Self-references expand in place (name compared in PEP 503 normal form), each extra once.
    assert requirements(pyproject, ["y"]) == ["a==1", "b>=2", "c==3", "d==4"]
    assert requirements(pyproject, ["z", "x"]) == ["a==1", "b>=2", "c==3", "d==4", "e==5"]


def test_unknown_extra_is_named(pyproject: Path) -> None:
    with pytest.raises(KeyError, match="'nope'"):
        requirements(pyproject, ["nope"])


@pytest.mark.parametrize(("extra", "ort"), [("onnx", "onnxruntime=="), ("gpu", "onnxruntime-gpu==")])
def test_image_extras_from_the_real_pyproject(extra: str, ort: str) -> None:
    """What the CPU (onnx) and GPU (gpu) images install: the runtime dependencies (uvloop and httptools among them),
    onnxruntime, no builder deps."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "docker" / "requirements.py"), str(ROOT / "pyproject.toml"), extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()  # one requirement a line, as `pip install -r` reads them (markers hold spaces)
    assert out[: len(project["dependencies"])] == project["dependencies"]
    assert any(r.startswith(ort) for r in out)
    # the C event loop and HTTP parser `python -m service` runs (service/entrypoints/http_server.py), for Linux
    assert {r.split("==")[0] for r in out} >= {"uvloop", "httptools"}
    assert not any(r.startswith(("timm", "open_clip_torch", "scikit-learn", "pytest")) for r in out)
