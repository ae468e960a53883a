"""A build stopped abruptly (``os._exit``: no cleanup, as ``kill -9`` leaves it) at any stage boundary, including
while it writes the artifact's files, is finished by the same command, and the artifact is the one an
uninterrupted build writes, bit for bit. A folder that a finished build or a user left is still refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offline.build import main
from service.core.artifact import MANIFEST, load_manifest

from .conftest import ticket_build

ROOT = Path(__file__).resolve().parents[2]

# a child process that runs the builder and stops it dead at one point: before or after a function of a module
STOPPER = """
import importlib, os, sys
target, when = sys.argv[1], sys.argv[2]
module, name = target.split(":")
m = importlib.import_module(module)
orig = getattr(m, name)
def stop(*a, **k):
    if when == "after":
        orig(*a, **k)
    os._exit(137)
setattr(m, name, stop)
from offline.build import main
sys.exit(main(sys.argv[3:]))
"""

# (where, when): each stage boundary, then each step of the final write
FAST_STOPS = [
    (
        "offline.pipelines.classifier_build:export_classifier",
        "before",
    ),  # weights and statistics written, no exports, no manifest
]
SLOW_STOPS = [
    ("offline.stages.package:write_manifest", "after"),  # the manifest written, the checkpoints not yet removed
    ("offline.pipelines.classifier_build:scored_members", "before"),  # the base done
    ("offline.pipelines.classifier_build:fuse_members", "before"),  # the members fine-tuned
    ("offline.pipelines.classifier_build:save_weights", "before"),  # evaluation done, nothing of the artifact written
    ("offline.stages.package:write_report", "before"),  # exports written, no report
    ("offline.stages.package:write_manifest", "before"),  # every file but the manifest
]


def _args(tmp: Path, user_files: tuple[Path, Path], out: Path) -> list[str]:
    ckpt, data = user_files
    config = tmp / "empty.yaml"
    config.write_text("{}\n")
    over = ticket_build(ckpt, data, **{"hydra.finetune_steps": 4})
    flags = [f for k, v in over.items() for f in (f"--{k}", v if isinstance(v, str) else json.dumps(v))]
    # torch's threads named: the reference builds in this process, where another test may have set them (a
    # benchmark run in-process with --threads 1), the stopped build in a fresh one; sums over other thread counts
    # round otherwise, and the weights are compared bit for bit
    return ["--config", str(config), "--out", str(out), "--no-progress", "--threads", "2", *flags]


@pytest.fixture(scope="module")
def reference(user_files, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted build's artifact and its weights' hash."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "artifact"
    assert main(_args(tmp, user_files, out)) == 0
    return out, load_manifest(out).files["model.safetensors"].sha256


def _stop_then_resume(tmp: Path, user_files: tuple[Path, Path], where: str, when: str) -> Path:
    out = tmp / "artifact"
    args = _args(tmp, user_files, out)
    child = subprocess.run(
        [sys.executable, "-c", STOPPER, where, when, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 137, child.stderr[-2000:]
    assert (out / ".checkpoints").is_dir()  # stopped before the end: the build's resumable state is there
    assert main(args) == 0  # the same command finishes it
    assert not (out / ".checkpoints").exists()
    assert not list(out.glob(".*.tmp"))
    return out


def _same_artifact(out: Path, reference: tuple[Path, str]) -> None:
    m = load_manifest(out)  # every file listed is there with its hash (load_manifest checks)
    assert m.files["model.safetensors"].sha256 == reference[1]
    assert sorted(m.files) == sorted(load_manifest(reference[0]).files)


@pytest.mark.parametrize(("where", "when"), FAST_STOPS)
def test_a_build_stopped_while_writing_the_artifact_resumes(where, when, user_files, tmp_path, reference):
    _same_artifact(_stop_then_resume(tmp_path, user_files, where, when), reference)


@pytest.mark.slow
@pytest.mark.parametrize(("where", "when"), SLOW_STOPS)
def test_a_build_stopped_at_any_stage_boundary_resumes(where, when, user_files, tmp_path, reference):
    _same_artifact(_stop_then_resume(tmp_path, user_files, where, when), reference)


def test_a_finished_artifact_or_a_users_folder_is_refused(user_files, tmp_path, reference, capsys):
    finished = tmp_path / "finished"
    finished.mkdir()
    for p in reference[0].iterdir():
        if p.is_file():
            (finished / p.name).write_bytes(p.read_bytes())
    assert (finished / MANIFEST).is_file()
    assert main(_args(tmp_path, user_files, finished)) == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: --out {finished} is not empty; pass --force to overwrite"
    )
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine\n")
    assert main(_args(tmp_path, user_files, users)) == 2
    assert (users / "notes.txt").read_text() == "mine\n"  # nothing of the user's is touched
