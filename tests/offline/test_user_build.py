"""What a user does: their own Hugging Face checkpoint and a CSV of labelled texts, without OOD data -> build ->
serve -> /predict; the served probabilities are the builder's evaluation-time probabilities for the same text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from offline.build import build
from offline.config import load_config
from service.core.artifact import load_manifest
from service.core.preprocess import make_preprocessor
from service.core.registry import load_model
from service.core.uncertainty import summarize
from service.entrypoints.app import create_app
from tests.service.helpers import settings_for

from .conftest import LABELS, ticket_build, ticket_config


def test_hf_checkpoint_and_csv_build_serve_and_predict(user_files, tmp_path):
    ckpt, data = user_files
    cfg = ticket_config(ckpt, data)
    out = build(cfg, tmp_path / "artifact")
    m = load_manifest(out)
    assert m.labels == LABELS  # from the CSV's label column, sorted
    assert m.ood.selected == m.uncertainty.ood_score == "mahalanobis"  # no OOD data: the fallback
    assert "no OOD data" in (out / "report.md").read_text()
    texts = ["I was charged twice on my card", "where is my parcel", "thanks, great service"]
    app = create_app(settings_for(out, backend="onnx"))
    with TestClient(app) as c:
        r = c.post("/predict", json={"texts": texts, "top_k": 3})
    assert r.status_code == 200, r.text
    served = torch.tensor(
        [[{t["label"]: t["prob"] for t in p["top_k"]}[label] for label in LABELS] for p in r.json()["predictions"]]
    )
    # the builder's evaluation path: the artifact's preprocessing and the fused eager model, at its temperature
    pre = make_preprocessor(m.preprocessing, out, 1 << 20)
    model = load_model(out / "model.safetensors", m.model.config)
    with torch.inference_mode():
        logits = model(**pre.collate(pre.encode(texts)))
    want = summarize(logits, m.uncertainty.temperature)["probs"]
    torch.testing.assert_close(served, want, atol=1e-4, rtol=0)


def _photo(path: Path, size: tuple[int, int], colour: tuple[int, int, int], mode: str = "RGB", fmt: str = "PNG"):
    from PIL import Image

    rng = np.random.default_rng(sum(size) + colour[0])
    arr = np.clip(np.asarray(colour) + rng.integers(-40, 40, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(arr)
    im = im.convert(mode) if mode != "RGB" else im
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, format=fmt)


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An RGB image folder of 3 classes: images of varied sizes and formats (JPEG, PNG, a CMYK JPEG, a palette PNG)."""
    root = tmp_path_factory.mktemp("photos")
    colours = {"forest": (40, 160, 60), "sea": (30, 80, 200), "sand": (220, 190, 120)}
    for c, (name, colour) in enumerate(colours.items()):
        for i in range(14):
            size = (40 + 7 * i, 32 + 5 * ((i + c) % 6))
            fmt, mode = [("PNG", "RGB"), ("JPEG", "RGB"), ("JPEG", "CMYK"), ("PNG", "P")][i % 4]
            _photo(root / name / f"img{i}.{fmt.lower().replace('jpeg', 'jpg')}", size, colour, mode, fmt)
    return root


def test_timm_checkpoint_and_photo_folder_build_serve_and_predict(photo_folder, tmp_path):
    """A timm ViT in the standard layout with a 1000-class head, an RGB photo folder -> build -> server -> /predict
    on a JPEG of yet another size: labels from the folder names; the served probabilities equal the builder's
    evaluation-time probabilities for the same file (same transform: timm's shorter-side crop; same model)."""
    import timm
    from safetensors.torch import save_file

    arch = {"img_size": 32, "patch_size": 8, "depth": 2}
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000, **arch)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "vit.safetensors"))
    cfg = load_config(
        None,
        {
            "name": "scenes",
            "family": "vit",
            "base.source": "timm:vit_tiny_patch16_224",
            "base.path": str(tmp_path / "vit.safetensors"),
            "base.arch": arch,
            "base.preset": "vit_fast",
            "base.steps": 4,
            "data.setting": "image-folder",
            "data.path": str(photo_folder),
            "data.max_train": 30,
            "data.max_val": 6,
            "data.max_test": 6,
            "hydra.prune_per_layer": 1,
            "hydra.calib_samples": 8,
            "hydra.finetune_steps": 2,
            "export.torchscript": False,
            "export.bf16_check": False,
        },
    )
    out = build(cfg, tmp_path / "artifact")
    m = load_manifest(out)
    assert m.labels == ["forest", "sand", "sea"]  # the folder names, sorted
    prep = m.preprocessing
    assert (prep.resize, prep.size, prep.channels) == ("shorter_crop", (32, 32), 3) and prep.crop_pct > 0
    query = tmp_path / "query.jpg"
    _photo(query, (97, 61), (35, 150, 70), fmt="JPEG")
    app = create_app(settings_for(out, backend="onnx"))
    with TestClient(app) as c:
        r = c.post("/predict", files=[("file", ("q.jpg", query.read_bytes(), "image/jpeg"))], data={"top_k": "3"})
    assert r.status_code == 200, r.text
    p = r.json()["predictions"][0]
    served = torch.tensor([{t["label"]: t["prob"] for t in p["top_k"]}[label] for label in m.labels])
    pre = make_preprocessor(prep, out, 1 << 24)
    model = load_model(out / "model.safetensors", m.model.config)
    with torch.inference_mode():
        logits = model(pre(query.read_bytes()).unsqueeze(0))
    want = summarize(logits, m.uncertainty.temperature)["probs"][0]
    torch.testing.assert_close(served, want, atol=1e-4, rtol=0)


def test_deep_ensemble_baseline_row(user_files, tmp_path):
    """``base.deep_ensemble: 2``: a second base trained like the first with the next seed; the report gets a
    ``deep_ensemble`` row scored with the same OOD scores as Hydra, and the first base (its cache key) and the
    served artifact do not depend on the baseline."""
    import dataclasses
    import json

    from offline.pipelines.classifier_build import base_checkpoint_dir

    ckpt, data = user_files
    over = ticket_build(ckpt, data, **{"export.onnx": False, "base.cache_dir": str(tmp_path / "bases")})
    cfg = load_config(None, {**over, "base.deep_ensemble": 2})
    key = base_checkpoint_dir(cfg, None)
    with_base = lambda **kw: dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, **kw))
    assert key == base_checkpoint_dir(with_base(deep_ensemble=0), None)
    assert key != base_checkpoint_dir(with_base(seed=1), None)
    out = build(cfg, tmp_path / "with")
    rows = {r["method"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    de, single = rows["deep_ensemble"], rows["single"]
    assert de["params"] == 2 * single["params"]
    assert set(de["ood_scores"]) == set(rows["hydra"]["ood_scores"])  # the same scores, its own statistics
    assert single["mi_id"] == 0 and de["mi_id"] > 0  # two differently seeded bases disagree
    assert len(list((tmp_path / "bases").iterdir())) == 2  # both bases cached, apart
    plain = build(load_config(None, over), tmp_path / "without")  # reuses the cached first base
    assert "deep_ensemble" not in {r["method"] for r in json.loads((plain / "report.json").read_text())["rows"]}
    assert load_manifest(plain).files["model.safetensors"] == load_manifest(out).files["model.safetensors"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_build_under_bf16_autocast_writes_an_fp32_artifact(user_files, tmp_path, device):
    """``build.precision: bf16`` and ``build.eval_precision: bf16`` (on CUDA: the GPU build): training, head
    scoring, calibration and evaluation run under bf16 autocast on the build device; the artifact is the same
    device-independent fp32 artifact, its exports pass the parity check against the fp32 eager model, and it
    serves on the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from safetensors import safe_open

    ckpt, data = user_files
    cfg = ticket_config(
        ckpt,
        data,
        **{"build.device": device, "build.precision": "bf16", "build.eval_precision": "bf16", "build.workers": 1},
    )
    out = build(cfg, tmp_path / "artifact")
    m = load_manifest(out)
    assert m.build["config"]["build"] == {"device": device, "precision": "bf16", "eval_precision": "bf16", "workers": 1}
    assert m.exports["onnx"].max_abs_diff <= m.exports["onnx"].tolerance
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    with TestClient(create_app(settings_for(out, backend="onnx"))) as c:
        r = c.post("/predict", json={"texts": ["where is my parcel"]})
    assert r.status_code == 200, r.text
