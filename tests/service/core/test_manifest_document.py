"""The manifest.json a build writes is pinned: the same blocks give the same document, byte for byte.

Each case hands :class:`~service.core.artifact.Manifest` what the builders hand it (plain dicts with numpy scalars
and arrays, tuples, paths, typed blocks), writes it with :func:`~service.core.artifact.write_manifest` into a
directory of small fixed files, and compares the text with ``tests/fixtures/manifests/<case>.json``: the same
keys in the same order, the same values, optional fields left out (not null) where they are absent. The
documents were written by the builder's manifest code before the manifest was typed end to end; a change to
them is a change of the artifact format (docs/artifact.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.core.artifact import (
    Manifest,
    TextPreprocessing,
    artifact_version,
    load_manifest,
    verify_files,
    write_manifest,
)
from service.core.manifest import document_sha256

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "manifests"

# every file of the artifacts below, with fixed bytes (so their hashes are fixed too)
FILES = {
    "model.safetensors": b"weights",
    "model.ts": b"torchscript",
    "model.onnx": b"onnx",
    "image_encoder.onnx": b"image onnx",
    "text_encoder.onnx": b"text onnx",
    "ood.safetensors": b"ood statistics",
    "guarantees.safetensors": b"guarantees",
    "tokenizer/tokenizer.json": b"{}",
    "report.md": b"# report\n",
    "plots/reliability.png": b"png",
    ".checkpoints/step-1": b"hidden: not part of the artifact",
}

GUARANTEES = {
    "file": "guarantees.safetensors",
    "calibration": {
        "source": "held out",
        "unused_id_inputs": np.int64(40),
        "size": 300,
        "index_sha256": "ab12",
        "class_counts": {"cat": 150, "dog": 150},
    },
    "conformal": {
        "method": "aps",
        "k_reg": 1,
        "lam": 0.01,
        "alpha": 0.1,
        "mondrian": False,
        "min_alpha": np.float64(1 / 301),
        "min_alpha_per_class": np.array([1 / 151, 1 / 151]),
        "labels": "the model's",
    },
    "ood": {"score": "mahalanobis", "alpha": 0.05, "n": 300, "min_alpha": 1 / 301, "label_free": False},
    "selective": {
        "delta": 0.1,
        "p_value": "binomial",
        "confidence": "msp",
        "default_risk": 0.05,
        "ood_cut": {"score": "mahalanobis", "threshold": np.float32(1.75)},
        "grid": {"from": "quantiles of the validation confidences", "sizes": [12, 9]},
        "targets": [
            {
                "risk": 0.05,
                "certified": True,
                "threshold": np.float64(0.81),
                "calibration_accept_rate": 0.62,
                "calibration_risk": 0.031,
                "n_accepted": 186,
                "p_value": 0.004,
            },
            {
                "risk": 0.01,
                "certified": False,
                "threshold": None,
                "calibration_accept_rate": 0.0,
                "calibration_risk": None,
                "n_accepted": 0,
                "p_value": 1.0,
            },
        ],
    },
    "drift": {"delta": 0.01, "bins": 8, "seed": 0, "edges": "quantiles of the validation inputs' OOD scores"},
}

CLASSIFIER: dict[str, Any] = {
    "name": "pinned-vit",
    "family": "vit",
    "task": "classification",
    "base_model": {"name": "vit small", "path": Path("/models/vit.safetensors"), "sha256": "cd34", "seed": 0},
    "heads": [[[0, 1, 2], (0, 1)], [np.array([0, 2]), [1]]],
    "strategy": {"name": "taylor", "seeds": [0, 1], "budget": 0.3, "ranking": [[0, 1], [1, 0]], "scores": None},
    "labels": ["cat", "dog"],
    "preprocessing": {
        "type": "image",
        "size": (16, 16),
        "mean": [0.5],
        "std": [np.float32(0.25)],
        "interpolation": "bicubic",
        "channels": 1,
        "resize": "shorter_crop",
        "crop_pct": 0.875,
    },
    "uncertainty": {
        "temperature": np.float64(1.25),
        "ood_score": "mahalanobis",
        "ood_threshold": np.float32(1.75),
        "tpr": 0.95,
    },
    "model": {
        "config": {"arch": "vit", "members": 2, "num_classes": 2, "img_size": (16, 16), "eps": 1e-06, "extra": None},
        "weights": "model.safetensors",
        "inputs": ["pixel_values"],
        "output": "logits",
        "shape": "(B, M, C)",
        "outputs": ["logits", "features"],
    },
    "ood": {
        "file": "ood.safetensors",
        "scores": ["msp", "energy", "mahalanobis"],
        "selected": "mahalanobis",
        "forced": False,
        "candidates": {
            "msp": {"threshold": 0.61, "val_recall": {"noise": 0.2}, "val_mean_recall": 0.2, "id_val_flag_rate": 0.05},
            "mahalanobis": {"threshold": np.float64(1.75), "val_recall": {}, "val_mean_recall": None},
        },
        "fit": {
            "source": "held out: ID inputs in none of train/val/test",
            "unused_id_inputs": 100,
            "size": 40,
            "index_sha256": "ef56",
            "class_counts": {"cat": 20, "dog": 20},
        },
    },
    "exports": {
        "torchscript": {"file": "model.ts", "max_abs_diff": np.float32(1e-6), "tolerance": 1e-4},
        "onnx": {"file": "model.onnx", "max_abs_diff": 0.0, "tolerance": 1e-4, "opset": 17},
    },
    "precision": {"bf16": {"ok": True, "argmax_agreement": np.float64(0.995), "n": 256, "min_agreement": 0.99}},
    "metrics": {"hydra": {"acc": np.float32(0.9), "ece": None}, "single": {"acc": 0.88}},
    "data": {"setting": "fashion", "id": {"fit": {"size": 40}, "calibration": {"size": 300}}, "sources": None},
    "build": {"config": {"name": "pinned-vit", "seed": 0}, "timings_s": {"train": 1.5}, "torch": "2.x"},
    "guarantees": GUARANTEES,
}

ZERO_SHOT: dict[str, Any] = {
    "name": "pinned-clip",
    "family": "clip",
    "task": "zero-shot",
    "base_model": {"name": "tiny clip", "open_clip_config": {"embed_dim": 16}, "lit": None},
    "heads": [{"vision": [[0, 1], [1]], "text": [[0], [0, 1]]}] * 2,
    "head_index": "joint layer index: vision tower layers first, then text tower layers",
    "strategy": {"name": "circuit-avg", "seeds": [3, 4], "pool": 8, "pool_per_layer": [4, 4]},
    "labels": ["square", "bar", "cross"],
    "zero_shot": {
        "template": "A photo of a {label}.",
        "logit_scale": np.float32(42.5),
        "logit_bias": None,
        "embed_dim": 16,
    },
    "preprocessing": {
        "type": "image",
        "size": [16, 16],
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "interpolation": "bilinear",
        "channels": 3,
        "resize": "direct",
        "text": {"max_length": 12, "tokenizer": "tokenizer", "padding": "max_length"},
    },
    "uncertainty": {"temperature": 1.1, "ood_score": "mahalanobis_layers", "ood_threshold": 2.5, "tpr": 0.9},
    "model": {
        "config": {"arch": "clip", "members": 2, "embed_dim": 16, "logit_bias": None},
        "weights": "model.safetensors",
        "inputs": ["pixel_values", "input_ids", "attention_mask"],
        "output": "logits",
        "shape": "(B, M, L)",
        "outputs": ["logits", "features", "layer_features"],
        "image_encoder": {
            "inputs": ["pixel_values"],
            "output": "image_embeds",
            "shape": "(B, M, D)",
            "outputs": ["image_embeds", "layer_features"],
        },
        "text_encoder": {"inputs": ["input_ids", "attention_mask"], "output": "text_embeds", "shape": "(L, M, D)"},
    },
    "exports": {
        "onnx": {
            "image": "image_encoder.onnx",
            "text": "text_encoder.onnx",
            "max_abs_diff": {"image": np.float32(1.5e-6), "text": 0.0},
            "tolerance": 1e-4,
            "opset": 17,
            "inputs": {"image": ["pixel_values"], "text": ["input_ids"]},
        }
    },
    "precision": {},
    "metrics": {"hydra": {"acc": 0.5}},
    "data": None,
    "build": {"version": "2026.1", "timings_s": {}},
    "ood": {
        "file": "ood.safetensors",
        "scores": ["mahalanobis", "mahalanobis_layers"],
        "selected": "mahalanobis_layers",
        "forced": True,
        "candidates": {},
        "fit": None,
        "label_free": True,
        "layers": np.array([0, 1]),
    },
    "guarantees": {
        **GUARANTEES,
        "ood": {**GUARANTEES["ood"], "score": "mahalanobis_layers", "label_free": True},
        "selective": {**GUARANTEES["selective"], "ood_cut": {"score": "mahalanobis_layers", "threshold": 2.5}},
    },
}

TEXT: dict[str, Any] = {
    "name": "pinned-bert",
    "family": "bert",
    "task": "classification",
    "base_model": {"name": "minilm"},
    "heads": [[[0, 1], [2]]],
    "strategy": {"name": "random", "seeds": [7]},
    "labels": ["negative", "positive"],
    "preprocessing": TextPreprocessing(max_length=48),
    "uncertainty": {"temperature": 1, "ood_score": "msp", "ood_threshold": 0.5},
    "model": {
        "config": {"arch": "bert", "members": 1, "num_classes": 2, "max_position": 64},
        "inputs": ("input_ids", "attention_mask"),
    },
    "version": "v1.2",
}

CASES = {"classifier": CLASSIFIER, "zero_shot": ZERO_SHOT, "text": TEXT}


def write_case(out: Path, fields: dict[str, Any]) -> Path:
    """The files of :data:`FILES` and the manifest of ``fields`` written into ``out``, as a builder writes them."""
    for rel, data in FILES.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    manifest = Manifest(members=len(fields["heads"]), **fields)
    return write_manifest(out, manifest)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_written_manifest_is_the_pinned_document(tmp_path: Path, case: str):
    path = write_case(tmp_path, CASES[case])
    assert path.read_text() == (GOLDEN / f"{case}.json").read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pinned_document_loads_and_keeps_its_version(tmp_path: Path, case: str):
    """The pinned document, read back, is the typed manifest that wrote it, and its version is the one a reader
    of the document computes (recorded, else the hash of the document as written)."""
    write_case(tmp_path, CASES[case])
    m = load_manifest(tmp_path)
    verify_files(tmp_path, m)
    built = Manifest(members=len(CASES[case]["heads"]), **CASES[case])
    assert m.to_dict() == {**built.to_dict(), "files": m.to_dict()["files"]}
    assert artifact_version(m) == {"classifier": "8fed5b34c61d", "zero_shot": "2026.1", "text": "v1.2"}[case]


def test_an_older_document_loads_with_its_defaults_and_keeps_its_version(tmp_path: Path):
    """A manifest written before some fields had defaults (no ``tpr``, ``resize``, ``outputs``) loads with the
    defaults filled in, and its version is still the hash of the document as it was written."""
    write_case(tmp_path, CLASSIFIER)
    doc = json.loads((tmp_path / "manifest.json").read_text())
    del doc["uncertainty"]["tpr"], doc["preprocessing"]["interpolation"], doc["model"]["outputs"]
    doc["ood"]["scores"] = ["msp", "energy"]  # no feature score: the older model had no features output
    doc["uncertainty"]["ood_score"] = doc["ood"]["selected"] = "energy"
    doc["guarantees"]["ood"]["score"] = "energy"
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    m = load_manifest(tmp_path)
    assert (m.uncertainty.tpr, m.preprocessing.interpolation, m.model.outputs) == (0.95, "bilinear", ["logits"])
    assert m.to_dict() != doc and artifact_version(m) == document_sha256(doc)[:12]
    assert artifact_version(m.model_copy(update={"labels": ["dog", "cat"]})) != artifact_version(m)
