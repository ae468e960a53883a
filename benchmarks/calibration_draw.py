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
import timm
import torch
from safetensors.torch import load_file

from benchmarks.truth import reserved_images
from offline.data import fashion

ROOT = Path(__file__).resolve().parents[1]
BACKBONE = ROOT / "offline" / "backbones" / "fashion-vit-s"


def backbone() -> tuple[torch.nn.Module, float, float]:
    """The pretrained backbone as its record says to load it, with its normalisation ``(model, mean, std)``."""
    load = json.loads(BACKBONE.with_suffix(".json").read_text())["load"]
    arch = dict(load["base.arch"])
    overlay = arch.pop("pretrained_cfg_overlay")
    model = timm.create_model(
        load["base.source"].split(":", 1)[1], pretrained=False, **arch, num_classes=overlay["num_classes"]
    )
    model.load_state_dict(load_file(str(BACKBONE.with_suffix(".safetensors"))))
    return model.eval(), float(overlay["mean"][0]), float(overlay["std"][0])


def accuracy(model: torch.nn.Module, mean: float, std: float, x: np.ndarray, official: np.ndarray) -> dict[str, Any]:
    """Overall and per-class accuracy (by the data set's names) of ``model`` on uint8 images ``x`` ``(N, 28, 28)``."""
    y = fashion.fashion_id_labels(official)
    xt = (torch.from_numpy(x).float() / 255 - mean) / std
    with torch.inference_mode():
        pred = torch.cat([model(xt[i : i + 500, None]) for i in range(0, len(xt), 500)]).argmax(1).numpy()
    names = [fashion.FASHION_CLASSES[c] for c in fashion.FASHION_ID_CLASSES]
    per_class = {n: float((pred[y == c] == c).mean()) for c, n in enumerate(names)}
    return {"n": len(y), "accuracy": float((pred == y).mean()), "per_class": per_class}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "default" / "image")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration_draw.json")
    args = ap.parse_args(argv)
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    model, mean, std = backbone()
    sets = {name: accuracy(model, mean, std, x, y) for name, (x, y) in reserved_images(manifest).items()}
    cal, unused = sets["calibration"], sets["unused"]
    var = sum(s["accuracy"] * (1 - s["accuracy"]) / s["n"] for s in (cal, unused))
    doc = {
        "command": f"python -m benchmarks.calibration_draw --artifact {args.artifact}",
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
