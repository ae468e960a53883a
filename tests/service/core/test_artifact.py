"""Artifact manifest: file hashes written, verified, and bad artifacts refused with the file named."""

from __future__ import annotations

import json
import re

import pytest

from service.core.artifact import (
    ArtifactError,
    BaseModelInfo,
    FileEntry,
    ImagePreprocessing,
    Manifest,
    ModelSpec,
    Strategy,
    TextPreprocessing,
    Uncertainty,
    file_sha256,
    load_manifest,
    parse_manifest,
    verify_files,
    write_manifest,
)


def _manifest() -> Manifest:
    return Manifest(
        name="t",
        family="bert",
        task="classification",
        base_model=BaseModelInfo(name="x"),
        members=2,
        heads=[[[0, 1]], [[1, 2]]],
        strategy=Strategy(name="random", seeds=[0, 1]),
        labels=["a", "b"],
        preprocessing=TextPreprocessing(max_length=8),
        uncertainty=Uncertainty(temperature=1.0, ood_score="msp", ood_threshold=0.5),
        model=ModelSpec(config={"arch": "bert", "num_classes": 2}, inputs=["input_ids", "attention_mask"]),
    )


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
    assert m.files is not None and set(m.files) == {"model.safetensors", "tokenizer/vocab.txt"}
    assert m.files["model.safetensors"].sha256 == file_sha256(artifact / "model.safetensors")
    assert m.files["model.safetensors"].size == 70
    verify_files(artifact, m)


def test_corrupt_and_missing_files_are_named(artifact):
    m = load_manifest(artifact)
    (artifact / "model.safetensors").write_bytes(b"weightz" * 10)  # same size, other bytes
    with pytest.raises(ArtifactError, match=r"model\.safetensors: sha256"):
        verify_files(artifact, m)
    (artifact / "tokenizer" / "vocab.txt").unlink()
    m.files.pop("model.safetensors")
    with pytest.raises(ArtifactError, match=r"vocab\.txt: listed in the manifest but missing"):
        verify_files(artifact, m)


def test_paths_outside_the_artifact_are_refused(artifact):
    m = load_manifest(artifact)
    m.files["../etc/passwd"] = FileEntry(sha256="0" * 64, size=1)
    with pytest.raises(ArtifactError, match="outside the artifact"):
        verify_files(artifact, m)


def test_invalid_manifests_are_refused(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.json"):
        load_manifest(tmp_path)
    bad = _manifest().to_dict()
    del bad["uncertainty"]
    (tmp_path / "manifest.json").write_text(json.dumps({**bad, "files": {}}))
    with pytest.raises(ArtifactError, match="uncertainty"):
        load_manifest(tmp_path)
    with pytest.raises(ArtifactError, match="heads lists 2 members"):
        write_manifest(tmp_path, _manifest().model_copy(update={"members": 3}))


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"preprocessing": {"type": "audio", "max_length": 8}}, "preprocessing", "tag 'audio'"),
        ({"preprocessing": {"type": "text", "max_length": 0}}, "preprocessing.text.max_length", "greater than"),
        ({"uncertainty": {"temperature": 0, "ood_score": "msp", "ood_threshold": 0.5}}, "uncertainty.temperature", ""),
        ({"uncertainty": {"temperature": 1, "ood_score": "odd", "ood_threshold": 0.5}}, "uncertainty.ood_score", ""),
        ({"labels": ["a", "b", "c"]}, "(top level)", "3 labels but the model has 2 classes"),
        ({"strategy": {"name": "greedy", "seeds": [0, 1]}}, "strategy.name", ""),
        ({"family": "resnet"}, "family", ""),
        ({"format_version": 2}, "format_version", ""),
        ({"surprise": 1}, "surprise", "Extra inputs are not permitted"),
        (
            {"model": {"config": {"arch": "gpt"}, "inputs": ["x"]}},
            "model.config",
            "arch must be one of bert, clip, vit",
        ),
        ({"task": "zero-shot"}, "(top level)", "task zero-shot does not match family bert, a classification family"),
    ],
)
def test_every_manifest_field_is_checked_at_load(artifact, change, field, message):
    """A manifest on disk with one bad field is refused at load, and the error names that field."""
    doc = json.loads((artifact / "manifest.json").read_text())
    (artifact / "manifest.json").write_text(json.dumps({**doc, **change}))
    with pytest.raises(ArtifactError, match=rf"manifest field {re.escape(field)}: .*{re.escape(message)}"):
        load_manifest(artifact)


def test_files_the_manifest_points_to_must_be_listed(artifact):
    doc = json.loads((artifact / "manifest.json").read_text())
    doc["model"]["weights"] = "other.safetensors"
    (artifact / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="'other.safetensors' is referenced by the manifest but is not in"):
        load_manifest(artifact)


def test_image_preprocessing_checks_its_values():
    ok = ImagePreprocessing(size=(16, 16), mean=[0.5], std=[0.25], channels=1)
    assert ok.to_dict() == {
        "type": "image",
        "size": [16, 16],
        "mean": [0.5],
        "std": [0.25],
        "interpolation": "bilinear",
        "channels": 1,
        "resize": "direct",
    }
    with pytest.raises(ValueError, match="std must be > 0"):
        ImagePreprocessing(size=(16, 16), mean=[0.5], std=[0.0], channels=1)
    with pytest.raises(ValueError, match="mean needs 1 or 3 values, got 2"):
        ImagePreprocessing(size=(16, 16), mean=[0.5, 0.5], std=[0.25], channels=3)


def test_the_manifest_round_trips_through_write_and_load(artifact):
    m = load_manifest(artifact)
    assert m.members == 2 and m.format_version == 1
    assert m.to_dict() == {**_manifest().to_dict(), "files": m.to_dict()["files"]}
    doc = json.loads((artifact / "manifest.json").read_text())
    assert m.to_dict() == parse_manifest(doc).to_dict() == doc
