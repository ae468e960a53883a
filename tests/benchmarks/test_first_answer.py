"""``benchmarks/first_answer.py`` runs to its end: a clone of the repository, a server started in it, the printed
``try:`` command answered, the models counted as they appear, the result written. Here the server is a tiny
artifact's ``python -m service`` (``make serve`` itself builds the three defaults: minutes)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks import first_answer
from tests.fixtures.tiny_artifact import make_tiny_artifact


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("git") is None, reason="needs curl and git")
def test_the_script_clones_serves_answers_and_writes_its_result(tmp_path: Path, monkeypatch):
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-first")
    monkeypatch.setenv("HYDRA_ARTIFACTS", str(art))
    monkeypatch.setenv("HYDRA_WORKERS", "1")
    out = tmp_path / "first.json"
    argv = ["--clone", str(tmp_path / "clone"), "--out", str(out), "--limit", "120"]
    argv += ["--command", f"{sys.executable} -m service", "--models", "1"]
    assert first_answer.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["first_answer"]["seconds"] > 0 and doc["first_answer"]["command"].startswith("curl -s ")
    assert list(doc["models_ready_s"]) == ["tiny-first"] and doc["all_ready_s"] == doc["models_ready_s"]["tiny-first"]
    assert doc["command"].startswith("python -m benchmarks.first_answer --clone DIR --command")
    assert str(tmp_path) not in json.dumps(doc)  # no folder outside the repository in the result
    assert doc["machine"]["cpu"] and len(doc["commit"]) == 40
