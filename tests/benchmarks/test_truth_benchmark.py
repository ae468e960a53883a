"""benchmarks/truth.py: its tallies on hand-made answers (known answers), and, when the default artifacts are built
(`make artifacts`), a run on 100 real test images of each class through a real server (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import truth

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "artifacts" / "default"


def _p(label: str, conf: float, flag: bool, cset: list[str], accept: bool) -> dict:
    return {
        "label": label,
        "confidence": conf,
        "ood": {"flag": flag},
        "conformal": {"set": cset, "size": len(cset)},
        "selective": {"accept": accept, "risk": 0.05},
    }


def test_classifier_tallies_known_answers():
    preds = [
        _p("Shirt", 0.95, False, ["Shirt"], True),
        _p("Coat", 0.6, False, ["Coat", "Shirt"], False),
        _p("Coat", 0.99, False, ["Coat"], True),
        _p("Shirt", 0.97, False, ["Shirt"], True),
        _p("Shirt", 0.5, True, ["Shirt"], False),
    ]
    truth_names = ["Shirt", "Shirt", "Coat", "Sandal", "Bag"]
    got = truth.classifier_truth(preds, truth_names, ["Shirt", "Coat"])
    assert got["per_class"] == {"Shirt": {"n": 2, "accuracy": 0.5}, "Coat": {"n": 1, "accuracy": 1.0}}
    assert got["accuracy"] == pytest.approx(2 / 3) and got["coverage_alpha_0.1"] == 1.0
    assert got["accepted"] == 2 and got["accepted_error"] == 0.0 and got["accept_rate"] == pytest.approx(2 / 3)
    assert got["near_flagged"] == 0.5 and got["near_confident_unflagged"] == 0.5
    assert got["near_flagged_by_class"] == {"Sandal": 0.0, "Bag": 1.0}


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEFAULT / "image" / "manifest.json").is_file() or not (DEFAULT / "zeroshot" / "manifest.json").is_file(),
    reason="default artifacts not built (make artifacts)",
)
def test_the_default_image_models_answer_real_images_by_true_name(tmp_path):
    out = tmp_path / "truth.json"
    truth.main(
        [
            "--image",
            str(DEFAULT / "image"),
            "--zeroshot",
            str(DEFAULT / "zeroshot"),
            "--per-class",
            "100",
            "--out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert all(v["accuracy"] > 0.6 for v in doc["classifier"]["per_class"].values())
    assert doc["checks"]["zero-shot, user words within 3 points of the build's labels"]
