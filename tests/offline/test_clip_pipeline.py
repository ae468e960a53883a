"""The zero-shot build end to end on a tiny OpenCLIP checkpoint file saved by the test (synthetic images)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from offline.data import Data, Split
from offline.families import get_adapter
from service.core.artifact import file_sha256
from service.core.registry import load_model

CLASSES = ["square", "bar", "cross"]
TINY_CLIP = {  # an OpenCLIP model config: two layers per tower, the real tokenizer's vocabulary
    "embed_dim": 16,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 16, "patch_size": 4, "width": 32, "layers": 2, "head_width": 8, "mlp_ratio": 2},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 24, "heads": 3, "layers": 2},
}


def _images(n: int, seed: int, kind: str = "id") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype(np.int64)
    x = rng.integers(0, 80, (n, 28, 28)).astype(np.uint8)
    if kind == "noise":
        return rng.integers(0, 255, (n, 28, 28)).astype(np.uint8), y
    for i, c in enumerate(y):
        if c == 0:
            x[i, 8:20, 8:20] = 240
        elif c == 1:
            x[i, 12:16, :] = 240
        else:
            x[i, 12:16, :] = 240
            x[i, :, 12:16] = 240
    return x, y


def synthetic_data() -> Data:
    (xtr, ytr), (xva, yva), (xte, yte) = _images(64, 0), _images(48, 1), _images(40, 2)
    noise_val, _ = _images(24, 3, "noise")
    noise_test, _ = _images(20, 4, "noise")
    blank = np.zeros((16, 28, 28), dtype=np.uint8)
    return Data(
        "image",
        CLASSES,
        Split(xtr, ytr),
        Split(xva, yva),
        Split(xte, yte),
        ood_val={"noise": noise_val, "blank": blank[:8]},
        ood_test={"noise": (noise_test, "far"), "blank": (blank, "far")},
        splits={"setting": "synthetic", "id": {"train": {"size": 64}}},
        calibration=Split(*_images(60, 5)),
    )


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A tiny random OpenCLIP ``CLIP`` (real tokenizer vocabulary) saved as config JSON + checkpoint file."""
    import open_clip

    cfg_path = tmp_path / "tiny-clip-build-test.json"
    cfg_path.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(cfg_path)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-clip-build-test")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    weights = tmp_path / "open_clip_pytorch_model.bin"
    torch.save(model.state_dict(), weights)
    return cfg_path, weights


@pytest.mark.slow  # a whole build: circuits, fusion, calibration, evaluation, four exports (~1-2 min on 2 cores)
def test_zero_shot_build_from_openclip_checkpoint(tmp_path, tiny_checkpoint, monkeypatch):
    from offline.build import build
    from offline.config import load_config
    from offline.pipelines import zeroshot_build as pipeline_clip
    from service.core.artifact import load_manifest, verify_files

    cfg_path, weights = tiny_checkpoint
    monkeypatch.setattr(pipeline_clip, "load_data", lambda cfg: synthetic_data())
    cfg = load_config(
        None,
        {
            "name": "tiny-zs",
            "family": "clip",
            "base.source": f"openclip:{cfg_path}",
            "base.path": str(weights),
            "hydra.members": 3,
            "hydra.strategy": "circuit-avg",
            "hydra.prune_total": 3,
            "hydra.calib_samples": 32,
            "export.bf16_check": False,
            "data.label_words": {c: f"kind {i}" for i, c in enumerate(CLASSES)},  # a user's own words
        },
    )
    out = build(cfg, tmp_path / "artifact")
    rows = {r["method"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    for method in ("single", "single_ts", "hydra"):  # every row again with the user's words: its own answers
        assert rows[f"{method}@words"]["acc"] is not None
        assert rows[f"{method}@words"]["nll"] != rows[method]["nll"]
    assert rows["hydra@words"]["temperature"] == rows["hydra"]["temperature"]  # the served temperature

    typed = load_manifest(out)
    verify_files(out, typed)
    manifest = typed.to_dict()  # its JSON form, as written: the checks below read the document
    assert (manifest["family"], manifest["task"], manifest["members"]) == ("clip", "zero-shot", 3)
    assert manifest["labels"] == CLASSES
    assert manifest["zero_shot"]["template"] == "A photo of a {label}."
    assert manifest["base_model"]["sha256"] == file_sha256(weights)
    heads = manifest["heads"]
    assert [sorted(h) for h in heads] == [["text", "vision"]] * 3
    n_pruned = [sum(4 - len(k) for k in h["vision"]) + sum(3 - len(k) for k in h["text"]) for h in heads]
    assert n_pruned == [3, 3, 3]  # the joint budget: 3 heads per member over both towers
    for side in ("image", "text"):
        for kind, tol in (("torchscript", 1e-4), ("onnx", 1e-4)):
            assert (out / manifest["exports"][kind][side]).is_file()
            assert manifest["exports"][kind]["max_abs_diff"][side] <= tol
    assert manifest["exports"]["onnx"]["inputs"]["image"] == ["pixel_values"]
    assert {"hydra", "single", "ensemble_unfused", "member_0"} <= set(manifest["metrics"])
    # the OOD flag is label-free: distances of the image tower's outputs to the ID images, chosen on validation
    ood = manifest["ood"]
    assert ood["label_free"] is True and ood["selected"] == manifest["uncertainty"]["ood_score"]
    assert ood["selected"] in ("mahalanobis", "mahalanobis_layers") and (out / ood["file"]).is_file()
    assert {"mahalanobis", "mahalanobis_layers@0", "mahalanobis_layers@0,1"} & set(ood["candidates"])
    _served_model_is_the_members(out, manifest, cfg_path, weights)
    _guarantees_on_the_calibration_split(out, manifest, cfg.guarantees.risks)


def _served_model_is_the_members(out, manifest, cfg_path, weights) -> None:
    """The artifact's tokenizer reproduces open_clip's ids for the prompts, and the served model is exactly the
    members the manifest names, pruned from the checkpoint."""
    import open_clip
    from transformers import AutoTokenizer

    from offline.models.loaders import load_openclip

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    prompts = [manifest["zero_shot"]["template"].format(label=c) for c in CLASSES]
    text = manifest["preprocessing"]["text"]
    enc = tok(prompts, padding=text["padding"], truncation=True, max_length=text["max_length"], return_tensors="pt")
    assert torch.equal(enc["input_ids"], open_clip.tokenize(prompts, context_length=12))

    fused = load_model(out / manifest["model"]["weights"], manifest["model"]["config"])
    base = load_openclip(str(cfg_path), str(weights))
    adapter = get_adapter("clip")
    members = [adapter.prune_to(base, h["vision"] + h["text"]) for h in manifest["heads"]]
    px = torch.randn(4, 3, 16, 16)
    batch = {"pixel_values": px, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    with torch.no_grad():
        logits = fused(**batch)
        for m, member in enumerate(members):
            torch.testing.assert_close(logits[:, m], adapter.forward(member, batch), atol=1e-5, rtol=0)
        assert manifest["zero_shot"]["logit_scale"] == pytest.approx(float(base.logit_scale.exp()), rel=1e-6)


def _guarantees_on_the_calibration_split(out, manifest, risks) -> None:
    """The guarantees, fitted on the calibration split, and the report's tables of them on ID test and OOD test."""
    report = json.loads((out / "report.json").read_text())
    assert {r["method"] for r in report["rows"]} >= {"single", "single_ts", "hydra"}
    g = manifest["guarantees"]
    assert g["conformal"]["min_alpha"] == pytest.approx(1 - 0.1 ** (1 / 60)) and g["ood"]["label_free"] is True
    assert g["conformal"]["delta"] == 0.1 and g["ood"]["min_alpha"] == pytest.approx(1 / 61)  # p-values: marginal
    hydra = report["extra"]["guarantees_report"]["methods"]["hydra"]
    assert hydra["calibration_size"] == 60
    for cell in hydra["coverage"].values():  # sets of the 3 labels; alpha 0.01 < 1/61: every label
        assert 0.0 <= cell["mean_size"] <= 3.0 and 0.0 <= cell["coverage"] <= 1.0
    assert hydra["coverage"]["0.01"]["mean_size"] == 3.0
    assert set(hydra["p_values"]["0.05"]["recall"]) == {"noise", "blank"}
    assert {r["risk"] for r in hydra["selective"]} == set(risks)
    assert set(hydra["drift"]["runs"]) == {"noise", "blank"}
    assert "## Guarantees (calibration split)" in (out / "report.md").read_text()


def test_label_words_must_name_every_class_and_only_zero_shot(tmp_path, monkeypatch):
    from offline.build import build
    from offline.config import ConfigError, load_config
    from offline.pipelines import zeroshot_build as pipeline_clip

    monkeypatch.setattr(pipeline_clip, "load_data", lambda cfg: synthetic_data())
    monkeypatch.setattr(pipeline_clip, "load_base_clip", lambda *a: pytest.fail("the base loaded before the check"))
    over = {"name": "zs", "family": "clip", "hydra.prune_total": 1, "data.label_words": {"square": "box", "blob": "x"}}
    with pytest.raises(ConfigError, match=r"data\.label_words must give a word for each class .*unknown \['blob'\]; "):
        build(load_config(None, over), tmp_path / "out")
    with pytest.raises(ConfigError, match="data.label_words is for zero-shot builds"):
        load_config(None, {"family": "bert", "data.setting": "tweets", "data.label_words": {"a": "b"}})
