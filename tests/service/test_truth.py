"""The served image model answers real images by their true names.

The repository's pretrained Fashion backbone, fused as a one-member model with every head (it then equals the
backbone) and written as an artifact, is served over HTTP. Real images of the Fashion-MNIST test file, 50 of each
in-distribution class, are sent through ``POST /predict``; each answer's label is compared with the data set's own
name for that image (torchvision's class list indexed by the IDX file's label, not the project's constant). The
per-class accuracy must match the backbone record's within sampling error: a swapped or shifted class list fails
it at once (the swapped Sandal / Shirt list answered real shirts "Shirt" 0 times in 89).

The same check on the default artifacts, every test image: ``python -m benchmarks.truth``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from offline import data as data_mod
from offline.families import get_adapter
from offline.method.fusion import fuse
from offline.train.checkpoints import load_timm
from service.core.artifact import (
    BaseModelInfo,
    ImagePreprocessing,
    Manifest,
    ModelSpec,
    Strategy,
    Uncertainty,
    write_manifest,
)
from service.entrypoints.app import create_app
from tests.fixtures.fashion import needs_fashion
from tests.service.helpers import b64, png, settings_for

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "offline" / "backbones" / "fashion-vit-s.json"
PER_CLASS = 50  # test images sent per class


pytestmark = needs_fashion


def _backbone_artifact(out: Path) -> tuple[Path, dict]:
    """The shipped backbone as a one-member artifact (all heads kept), labelled with the build's class names."""
    rec = json.loads(RECORD.read_text())
    arch = rec["load"]["base.arch"]
    model = load_timm(rec["load"]["base.source"].split(":", 1)[1], str(RECORD.parent / rec["file"]), 6, **arch).eval()
    fused, cfg = fuse(get_adapter("vit"), [model])
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, str(out / "model.safetensors"))
    overlay = arch["pretrained_cfg_overlay"]
    labels = [data_mod.FASHION_CLASSES[c] for c in data_mod.FASHION_ID_CLASSES]
    manifest = Manifest(
        name="fashion-backbone",
        family="vit",
        task="classification",
        base_model=BaseModelInfo(name=rec["name"]),
        members=1,
        heads=[[list(range(h)) for h in cfg["num_heads"]]],
        strategy=Strategy(name="random", seeds=[0]),
        labels=labels,
        preprocessing=ImagePreprocessing(
            size=(28, 28), mean=overlay["mean"], std=overlay["std"], interpolation="bilinear", channels=1
        ),
        uncertainty=Uncertainty(temperature=1.0, ood_score="msp", ood_threshold=0.0),
        model=ModelSpec(config=cfg, inputs=["pixel_values"]),
    )
    write_manifest(out, manifest)
    return out, rec


def test_served_labels_are_the_true_names_of_real_test_images(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    names = torchvision.datasets.FashionMNIST.classes  # the data set's own names, from outside the project
    art, rec = _backbone_artifact(tmp_path / "backbone")
    expected = rec["test_accuracy"]["per_class_stored_weights"]
    fdir = data_mod.fashion_dir()
    x = data_mod.read_idx_images(fdir / data_mod.FASHION_FILES["test_images"])
    y = data_mod.read_idx_labels(fdir / data_mod.FASHION_FILES["test_labels"])
    with TestClient(create_app(settings_for(art, backend="torch"))) as client:
        served = client.get("/v1/models").json()["models"][0]["labels"]
        assert sorted(served) == sorted(expected)  # the record and the artifact name the same classes
        for official in data_mod.FASHION_ID_CLASSES:
            truth = names[official]
            idx = np.flatnonzero(y == official)[:PER_CLASS]
            r = client.post("/predict", json={"images": [b64(png(x[i])) for i in idx]})
            assert r.status_code == 200, r.text
            acc = float(np.mean([p["label"] == truth for p in r.json()["predictions"]]))
            p = expected[truth]
            tol = 3 * math.sqrt(p * (1 - p) / PER_CLASS) + 0.02  # three standard errors of a 50-image estimate
            assert abs(acc - p) <= tol, f"{truth}: served {acc:.2f}, record {p:.2f} (tolerance {tol:.2f})"
