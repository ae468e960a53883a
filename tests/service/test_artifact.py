"""Artifact manifest: file hashes written, verified, and bad artifacts refused with the file named."""

from __future__ import annotations

import json

import pytest

from service.artifact import ArtifactError, file_sha256, load_manifest, verify_files, write_manifest


def _manifest() -> dict:
    return {
        "format_version": 1,
        "name": "t",
        "family": "vit",
        "task": "classification",
        "base_model": {"name": "x"},
        "members": 2,
        "heads": [[[0, 1]], [[1, 2]]],
        "strategy": {"name": "random", "seeds": [0, 1]},
        "labels": ["a", "b"],
        "preprocessing": {"type": "image"},
        "uncertainty": {"temperature": 1.0, "ood_score": "msp", "ood_threshold": 0.5, "tpr": 0.95},
        "exports": {},
        "metrics": {},
    }


@pytest.fixture
def artifact(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 10)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (tmp_path / ".checkpoints").mkdir()  # hidden: not part of the artifact
    (tmp_path / ".checkpoints" / "x").write_text("tmp")
    write_manifest(tmp_path, _manifest())
    return tmp_path


def test_manifest_lists_every_file_with_hash(artifact):
    m = load_manifest(artifact)
    assert set(m["files"]) == {"model.safetensors", "tokenizer/vocab.txt"}
    assert m["files"]["model.safetensors"]["sha256"] == file_sha256(artifact / "model.safetensors")
    assert m["files"]["model.safetensors"]["size"] == 70
    verify_files(artifact, m)


def test_corrupt_and_missing_files_are_named(artifact):
    m = load_manifest(artifact)
    (artifact / "model.safetensors").write_bytes(b"weightz" * 10)  # same size, other bytes
    with pytest.raises(ArtifactError, match=r"model\.safetensors: sha256"):
        verify_files(artifact, m)
    (artifact / "tokenizer" / "vocab.txt").unlink()
    m["files"].pop("model.safetensors")
    with pytest.raises(ArtifactError, match=r"vocab\.txt: listed in the manifest but missing"):
        verify_files(artifact, m)


def test_paths_outside_the_artifact_are_refused(artifact):
    m = load_manifest(artifact)
    m["files"]["../etc/passwd"] = {"sha256": "0", "size": 1}
    with pytest.raises(ArtifactError, match="outside the artifact"):
        verify_files(artifact, m)


def test_invalid_manifests_are_refused(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.json"):
        load_manifest(tmp_path)
    bad = _manifest()
    del bad["uncertainty"]
    (tmp_path / "manifest.json").write_text(json.dumps({**bad, "files": {}}))
    with pytest.raises(ArtifactError, match="uncertainty"):
        load_manifest(tmp_path)
    with pytest.raises(ArtifactError, match="heads lists 2 members"):
        write_manifest(tmp_path, {**_manifest(), "members": 3})
