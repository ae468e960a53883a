"""Is an image build's calibration split an easy draw, or did the build make it easy?

    python -m benchmarks.calibration_draw --artifact artifacts/default/image

Redraws the build's reserved Fashion-MNIST images from its manifest (:func:`benchmarks.truth.reserved_images`): the
calibration split and the reserved images the build left unused, exchangeable with it by construction. Scores both
with the repository's pretrained backbone (``offline/backbones``, trained on the training pool only, before any
build), per class. A gap the backbone shows too is a property of the draw, not of anything the build did.
Writes ``benchmarks/results/calibration_draw.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.truth import reserved_images
from offline.data import fashion
from offline.models.loaders import load_timm
from offline.train.pretrain import per_class_accuracy

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "offline" / "backbones" / "fashion-vit-s.json"


def backbone() -> torch.nn.Module:
    """The pretrained backbone loaded as its record says (the shipped configs load it the same way)."""
    record = json.loads(RECORD.read_text())
    name = record["load"]["base.source"].split(":", 1)[1]
    classes = len(fashion.FASHION_ID_CLASSES)
    return load_timm(name, str(RECORD.parent / record["file"]), classes, **record["load"]["base.arch"]).eval()


def accuracy(model: torch.nn.Module, x: np.ndarray, official: np.ndarray) -> dict[str, Any]:
    """Overall and per-class accuracy (by the data set's names) of ``model`` on uint8 images ``x`` ``(N, 28, 28)``
    with official Fashion-MNIST labels, at the demo normalisation
    (:func:`offline.train.pretrain.per_class_accuracy`)."""
    y = fashion.fashion_id_labels(official)
    per_class = per_class_accuracy(model, x, y)
    counts = np.bincount(y, minlength=len(per_class))
    overall = float(sum(acc * n for acc, n in zip(per_class.values(), counts, strict=True)) / len(y))
    return {"n": len(y), "accuracy": overall, "per_class": per_class}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "default" / "image")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration_draw.json")
    args = ap.parse_args(argv)
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    model = backbone()
    sets = {name: accuracy(model, x, y) for name, (x, y) in reserved_images(manifest).items()}
    cal, unused = sets["calibration"], sets["unused"]
    artifact = args.artifact.resolve()
    shown = artifact.relative_to(ROOT) if artifact.is_relative_to(ROOT) else artifact  # no machine's paths
    var = sum(s["accuracy"] * (1 - s["accuracy"]) / s["n"] for s in (cal, unused))
    doc = {
        "command": f"python -m benchmarks.calibration_draw --artifact {shown}",
        "model": "offline/backbones/fashion-vit-s (pretrained on the training pool, before any build)",
        "build": manifest.get("name"),
        "sets": sets,
        "gap": cal["accuracy"] - unused["accuracy"],
        "z": (cal["accuracy"] - unused["accuracy"]) / math.sqrt(var),
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
