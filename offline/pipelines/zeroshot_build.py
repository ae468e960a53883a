"""The zero-shot build (family ``clip``): a chain of :mod:`offline.stages` over one build context::

    data -> base CLIP -> joint head scores -> members -> fuse -> calibrate -> evaluate -> guarantees
      -> export both encoders -> artifact

``offline.build`` calls :func:`build_zero_shot` for ``family: clip``.

Base model (``base.source``):

* ``lit``: an OpenCLIP ``CustomTextCLIP`` with the packaged MiniLM as frozen text tower and an image
  tower trained here on the ID classes' captions (:mod:`offline.train.lit`; preset ``base.preset``, e.g.
  ``lit_fast``; ``base.arch`` overrides its vision config, ``base.steps`` its step count). The trained
  model is cached under ``$HYDRA_CACHE_DIR/lit`` (default ``.cache/lit``) by a hash of everything
  that determines it, so a rebuild with other Hydra settings does not retrain it.
* ``openclip:<model name or config .json>`` with ``base.path`` = a local ``open_clip_pytorch_model.bin``
  / ``.safetensors``: loaded by open_clip's own ``create_model(name, pretrained=path)``
  (e.g. ``openclip:ViT-B-32`` with the ``laion2b_s34b_b79k`` file).

Zero-shot classification uses the prompts ``"A photo of a {label}."`` of the data's class names.
Heads are scored jointly over both towers (flat layer index: vision layers, then text layers; see
``offline/families/clip.py``): circuits by zero-shot accuracy / MSP-AUROC / their average; Taylor on
the vision tower only (the towers' Taylor scales differ, as the paper notes).

Artifact: the zero-shot layout of ``docs/artifact.md``, which describes every file and manifest field: the fused
``service.core.fused_clip.FusedCLIP`` weights, both encoders' TorchScript and ONNX exports, the tokenizer and the
report. The manifest is built as ``service.core.artifact.Manifest``, whose validation is the format's.

Serving: embed the labels' prompts once with the text encoder, ``(L, M, D)``; per request embed the
images, ``(B, M, D)``; member logits ``(B, M, L) = logit_scale · einsum("bmd,lmd->bml")``
(``+ logit_bias``), divided by ``uncertainty.temperature``, then ``service.core.uncertainty.summarize``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
from open_clip.model import get_model_preprocess_cfg
from open_clip.tokenizer import bytes_to_unicode, default_bpe
from safetensors.torch import load_file
from torch import nn
from transformers import AutoTokenizer, CLIPTokenizer

from offline import train as train_mod
from offline.config import BuildConfig, ConfigError, check_budget
from offline.data import ROOT, Data
from offline.families.clip import CLIPAdapter, split_heads
from offline.progress import stage as progress_stage
from offline.stages.calibrate import ZeroShotCalibration, calibrate_zero_shot
from offline.stages.certify import Guarantees, zero_shot_guarantees, zero_shot_guarantees_report
from offline.stages.context import BaseModel, BuildContext, Timer
from offline.stages.datasets import (
    EVAL_BATCH,
    FASHION_MEAN,
    FASHION_STD,
    Batch,
    Batches,
    concat,
    load_data,
    prompt_batch,
    sample_indices,
    take,
    zero_shot_sets,
)
from offline.stages.ensemble import Fused, Members, ScoringBatches, fuse_members, zero_shot_members
from offline.stages.evaluation import Evaluation, evaluate_zero_shot, zero_shot_methods, zero_shot_models
from offline.stages.package import (
    Exports,
    export_zero_shot,
    label_free_spec,
    model_spec,
    prepare_out,
    provenance,
    save_weights,
    write_artifact,
    zero_shot_extra,
)
from offline.train import TrainConfig, lit
from service.core.artifact import Manifest, file_sha256

__all__ = [
    "HEAD_INDEX",
    "build_zero_shot",
    "finish_zero_shot",
    "image_prep",
    "load_base_clip",
    "load_openclip",
    "metrics_table",
    "ood_sample",
    "openclip_tokenizer",
    "prompt_batch",
    "zero_shot_batches",
]

log = logging.getLogger("hydra.build")

HEAD_INDEX = (
    "joint layer index: vision tower layers 0..Lv-1, then text tower layers Lv..Lv+Lt-1; "
    "heads are indices into the base model's heads of that layer"
)
OPENCLIP_PREFIX = "openclip:"


# ----------------------------------------------------------------------------- base models
def load_base_clip(cfg: BuildConfig, data: Data) -> BaseModel:
    """Base CLIP (eval), the artifact preprocessing, its tokenizer and a description for the manifest."""
    src = cfg.base.source
    if src == "lit":
        return _lit_base(cfg, data)
    if src.startswith(OPENCLIP_PREFIX):
        return _openclip_base(cfg, src[len(OPENCLIP_PREFIX) :])
    raise ConfigError(f"base.source {src!r} is not a zero-shot model source (lit, openclip:<name or config.json>)")


def image_prep(size: Sequence[int], mean: Sequence[float], std: Sequence[float], interpolation: str) -> dict:
    """The image part of the artifact's preprocessing: RGB (gray replicated), resized directly to ``size``."""
    return {
        "type": "image",
        "size": [int(s) for s in size],
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
        "interpolation": interpolation,
        "channels": 3,
        "resize": "direct",
    }


def load_openclip(name: str, path: str | None) -> nn.Module:
    """An OpenCLIP model through open_clip's own loader: ``create_model(name, pretrained=path)``.

    ``name`` is a built-in architecture (``ViT-B-32``) or a model config ``.json`` (registered first).
    """
    if name.endswith(".json"):
        cfg_path = Path(name)
        if not cfg_path.is_file():
            raise ConfigError(f"OpenCLIP model config {cfg_path} does not exist")
        open_clip.add_model_config(cfg_path)
        name = cfg_path.stem
    try:
        model = open_clip.create_model(name, pretrained=path, load_weights=path is not None)
    except RuntimeError as e:
        raise ConfigError(f"cannot load OpenCLIP model {name!r} from {path!r}: {e}") from e
    return model.eval()


def openclip_tokenizer(context_length: int = 77) -> Any:
    """open_clip's BPE tokenizer as a Hugging Face ``CLIPTokenizer`` (same ids on ordinary text), padding with 0.

    Built from the BPE merges file open_clip ships, so no hub is reached; ``save_pretrained`` makes the
    artifact's ``tokenizer/`` folder loadable with ``AutoTokenizer``.
    """
    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]  # open_clip's <start_of_text>, <end_of_text>: ids 49406, 49407
    return CLIPTokenizer(
        vocab={t: i for i, t in enumerate(vocab)},
        merges=[tuple(m.split()) for m in merges],
        pad_token="!",  # id 0, what open_clip pads with
        model_max_length=context_length,
    )


def _openclip_base(cfg: BuildConfig, name: str) -> BaseModel:
    """An OpenCLIP checkpoint (``openclip:<name or config.json>``, weights in ``base.path``) with open_clip's own
    preprocessing and tokenizer."""
    model = load_openclip(name, cfg.base.path)
    pp = get_model_preprocess_cfg(model)  # what open_clip's own transforms would do
    size = pp.get("size", model.visual.image_size)
    size = [size, size] if isinstance(size, int) else list(size)
    prep = image_prep(size, pp["mean"], pp["std"], pp.get("interpolation", "bicubic"))
    hf_text = hasattr(model, "text") and hasattr(model.text, "config")
    if hf_text:  # HF text tower
        tok_name = open_clip.get_model_config(Path(name).stem)["text_cfg"].get("hf_tokenizer_name")
        tok = AutoTokenizer.from_pretrained(tok_name or model.text.config.name_or_path)
        max_length = cfg.base.max_length
    else:
        max_length = int(model.context_length)
        tok = openclip_tokenizer(max_length)
    # open_clip's own text transformer adds its positional embedding to all context_length positions
    padding = "longest" if hf_text else "max_length"
    prep["text"] = {"max_length": max_length, "tokenizer": "tokenizer", "padding": padding}
    desc = {
        "name": Path(name).stem,
        "source": cfg.base.source,
        "path": cfg.base.path,
        "sha256": file_sha256(cfg.base.path) if cfg.base.path else None,
    }
    return BaseModel(model, prep, tok, desc)


def lit_cache_dir() -> Path:
    return Path(os.environ.get("HYDRA_CACHE_DIR", ROOT / ".cache")) / "lit"


def _lit_key(model_cfg: dict, tcfg: TrainConfig, data: Data, max_length: int, image_init: str | None = None) -> str:
    tower = Path(model_cfg["text_cfg"]["hf_model_name"])
    weights = next(iter(sorted(tower.glob("*.safetensors"))), None)
    doc = {
        "model": model_cfg,
        "train": train_mod.recorded(tcfg),
        "templates": lit.TRAIN_TEMPLATES,
        "max_length": max_length,
        "classes": list(data.class_names),
        "train_split": data.splits.get("id", {}).get("train"),
        "text_weights": file_sha256(weights) if weights else None,
        "version": 1,
    }
    if image_init:  # the image tower's starting weights (an unset one keeps older keys)
        doc["image_init"] = file_sha256(image_init)
    blob = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _lit_base(cfg: BuildConfig, data: Data) -> BaseModel:
    """A LiT model (:mod:`offline.train.lit`): the packaged MiniLM as frozen text tower and an image tower trained here
    on the ID classes' captions, or loaded from the cache when the same one was trained before."""
    if cfg.base.preset not in lit.LIT_PRESETS:
        raise ConfigError(f"base.preset {cfg.base.preset!r} is not a LiT preset; known: {sorted(lit.LIT_PRESETS)}")
    preset = lit.LIT_PRESETS[cfg.base.preset]
    vision = {**preset["vision"], **cfg.base.arch}
    model_cfg = lit.lit_model_config(vision, text_path=cfg.base.path)
    steps = {"steps": cfg.base.steps} if cfg.base.steps else {}
    tcfg = TrainConfig(**{**preset["train"], **steps, "seed": cfg.data.seed})
    max_length = min(cfg.base.max_length, model_cfg["text_cfg"]["context_length"])
    size = vision["image_size"]
    size = [size, size] if isinstance(size, int) else list(size)
    prep = image_prep(size, [FASHION_MEAN] * 3, [FASHION_STD] * 3, "bilinear")
    tok = lit.load_tokenizer(model_cfg)
    if cfg.base.image_init and not Path(cfg.base.image_init).is_file():
        raise ConfigError(f"base.image_init {cfg.base.image_init} is not a file")
    cache = lit_cache_dir() / _lit_key(model_cfg, tcfg, data, max_length, cfg.base.image_init)
    model = lit.make_lit_model(model_cfg, pretrained_text=True, seed=tcfg.seed)
    init = lit.init_image_tower(model, cfg.base.image_init) if cfg.base.image_init else None
    weights = cache / f"lit-{cfg.base.preset}.safetensors"
    info = _lit_trained(model, model_cfg, tok, data, tcfg, prep, max_length, weights)
    prep["text"] = {"max_length": max_length, "tokenizer": "tokenizer", "padding": "longest"}
    text_path = model_cfg["text_cfg"]["hf_model_name"]
    text_weights = next(iter(sorted(Path(text_path).glob("*.safetensors"))), None)
    desc = {
        "name": "LiT CustomTextCLIP: frozen all-MiniLM-L6-v2 text tower, image tower trained here",
        "source": "lit",
        "path": text_path,
        "sha256": file_sha256(text_weights) if text_weights else None,
        "open_clip_config": model_cfg,
        "lit": info,
        "cache": str(cache),
        "image_init": init,
    }
    return BaseModel(model.eval(), prep, tok, desc)


def _lit_trained(
    model: nn.Module,
    model_cfg: dict[str, Any],
    tok: Any,
    data: Data,
    tcfg: TrainConfig,
    prep: dict[str, Any],
    max_length: int,
    weights: Path,
) -> dict[str, Any]:
    """``model``'s image tower trained (:func:`offline.train.lit.train_lit`) and saved with its training log beside
    ``weights``, or loaded from there when an earlier build trained the same; returns the training log."""
    cache = weights.parent
    if weights.is_file() and (cache / "lit_log.json").is_file():
        model.load_state_dict(load_file(str(weights)), strict=True)
        log.info("LiT base model loaded from the cache %s", cache)
        return json.loads((cache / "lit_log.json").read_text())
    lit.train_lit(model, tok, data, tcfg, prep, max_length=max_length)
    info = getattr(model, lit.LIT_TRAIN_LOG_ATTR)
    lit.save_openclip(model, model_cfg, cache, weights.stem)
    (cache / "lit_log.json").write_text(json.dumps(info, indent=2, default=str))
    return info


# ----------------------------------------------------------------------------- the scoring batches
def zero_shot_batches(
    images: np.ndarray, labels: np.ndarray, prep: dict, prompts: Batch, batch_size: int = EVAL_BATCH
) -> Batches:
    """Images in order as ``({"pixel_values": (B, 3, H, W), "input_ids": (L, T), "attention_mask": (L, T)}, y)``."""
    out = []
    for i in range(0, len(labels), batch_size):
        x = lit.pixel_batch(images[i : i + batch_size], prep["mean"], prep["std"], prep["size"], prep["channels"])
        out.append(({"pixel_values": x, **prompts}, torch.as_tensor(np.asarray(labels[i : i + batch_size]))))
    return out


def ood_sample(ood_sets: dict[str, Any], n: int, seed: int) -> Any:
    """``n`` OOD validation images drawn evenly from every set (seeded), so no single set drives the circuits;
    arrays or a user's image files alike (none without OOD data)."""
    names = sorted(ood_sets)
    if not names:
        return []
    rng = np.random.default_rng(seed)
    per, extra = divmod(n, len(names))
    parts = []
    for i, name in enumerate(names):
        x = ood_sets[name]
        k = min(len(x), per + (1 if i < extra else 0))
        parts.append(take(x, np.sort(rng.choice(len(x), size=k, replace=False))))
    return concat(parts)


def scoring_batches(ctx: BuildContext, prompts: Batch) -> ScoringBatches:
    """Taylor's gradient batches and circuit extraction's ID / OOD validation batches, each with the prompts."""
    cfg, data, prep = ctx.config, ctx.data, ctx.base.preprocessing
    n = min(cfg.hydra.calib_samples, len(data.train.labels))
    cal_idx = sample_indices(len(data.train.labels), n, cfg.data.seed)
    calib = zero_shot_batches(take(data.train.inputs, cal_idx), data.train.labels[cal_idx], prep, prompts, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val = zero_shot_batches(take(data.val.inputs, np.arange(n_val)), data.val.labels[:n_val], prep, prompts, 256)
    ood_x = ood_sample(data.ood_val, n_val, cfg.data.seed)
    ood = zero_shot_batches(ood_x, np.zeros(len(ood_x), dtype=np.int64), prep, prompts, 256)
    return ScoringBatches.of(calib, val, ood)


# ----------------------------------------------------------------------------- the build
def build_zero_shot(cfg: BuildConfig, out: Path) -> Path:
    """Build the zero-shot artifact of ``cfg`` into ``out`` (see the module docstring) and return it."""
    torch.manual_seed(cfg.data.seed)
    timer = Timer()
    data = load_data(cfg)
    if data.modality != "image":
        raise ConfigError(f"family clip needs image data, got {data.modality} data")
    words = cfg.data.label_words
    if words and set(words) != set(data.class_names):
        extra, missing = sorted(set(words) - set(data.class_names)), sorted(set(data.class_names) - set(words))
        raise ConfigError(
            f"data.label_words must give a word for each class {list(data.class_names)}: "
            + "; ".join(p for p in (f"unknown {extra}" if extra else "", f"missing {missing}" if missing else "") if p)
        )
    timer.lap("data")
    ctx = BuildContext.create(cfg, Path(out), data, load_base_clip(cfg, data), timer)
    adapter, base = ctx.adapter, ctx.base.model
    assert isinstance(adapter, CLIPAdapter)
    heads = adapter.heads(base)
    check_budget(cfg, heads[: adapter.num_vision_layers(base)] if cfg.hydra.strategy == "taylor" else heads)
    timer.lap("base model")
    prompts = prompt_batch(ctx, data.class_names, lit.TEMPLATE)
    members = zero_shot_members(ctx, scoring_batches(ctx, prompts))
    if cfg.hydra.finetune_steps > 0:
        log.warning("hydra.finetune_steps is ignored for zero-shot builds: members are used without training")
    return finish_zero_shot(ctx, members, fuse_members(ctx, members), prompts)


def finish_zero_shot(ctx: BuildContext, members: Members, fused: Fused, prompts: Batch) -> Path:
    """Calibrate, evaluate, export and write the artifact; evaluation images go through the server's preprocessing
    (:func:`offline.stages.datasets.zero_shot_sets`), each batch with the label ``prompts``."""
    prepare_out(ctx)
    sets = zero_shot_sets(ctx, prompts)
    models = zero_shot_models(ctx, members, fused, prompts)
    with progress_stage("calibration"):
        cal = calibrate_zero_shot(ctx, fused, models.hydra.fn, sets)
        guarantees = zero_shot_guarantees(ctx, models.hydra.fn, cal, sets)
    ctx.timer.lap("calibration")
    methods = zero_shot_methods(ctx, models, sets, cal.calibration.temperature)
    evaluation = evaluate_zero_shot(ctx, methods, sets, cal)
    if ctx.config.data.label_words:  # every row again, with the prompts of the user's words for the same classes
        words = [ctx.config.data.label_words[c] for c in ctx.data.class_names]
        alt = zero_shot_models(ctx, members, fused, prompt_batch(ctx, words, lit.TEMPLATE))
        alt_methods = zero_shot_methods(ctx, alt, sets, cal.calibration.temperature)
        evaluation.rows += [
            {**r, "method": f"{r['method']}@words"} for r in evaluate_zero_shot(ctx, alt_methods, sets, cal).rows
        ]
        evaluation.extra["label_words"] = dict(zip(ctx.data.class_names, words, strict=True))
    guarantees = zero_shot_guarantees_report(ctx, methods["hydra"], cal, sets, guarantees)
    save_weights(ctx.out, fused.model, cal.calibration, guarantees.fitted)
    exports = export_zero_shot(ctx, fused, cal.calibration, sets, prompts)
    t_single = methods["single_ts"].temperature
    return write_zero_shot(ctx, members, fused, cal, evaluation, guarantees, exports, t_single)


def write_zero_shot(
    ctx: BuildContext,
    pruned: Members,
    fusion: Fused,
    calibrated: ZeroShotCalibration,
    evaluation: Evaluation,
    fitted: Guarantees,
    checked: Exports,
    t_single: float,
) -> Path:
    """The report, then the manifest of a zero-shot artifact (:func:`offline.stages.package.write_artifact`);
    ``t_single``: the base model's own temperature (the report's ``single_ts`` row)."""
    cfg, data, adapter, timer = ctx.config, ctx.data, ctx.adapter, ctx.timer
    base, prep, base_desc = ctx.base.model, ctx.base.preprocessing, ctx.base.description
    members, strategy, fcfg, cal = pruned.models, pruned.strategy, fusion.config, calibrated.calibration
    exports, precision, guarantees = checked.exports, checked.precision, fitted.fitted

    def manifest(metrics: dict[str, Any]) -> Manifest:
        return Manifest(
            name=cfg.name,
            family="clip",
            task="zero-shot",
            base_model=base_desc,
            members=len(members),
            heads=[split_heads(base, adapter.kept_heads(m)) for m in members],
            head_index=HEAD_INDEX,
            strategy=strategy,
            labels=list(data.class_names),
            zero_shot={
                "template": lit.TEMPLATE,
                "logit_scale": fcfg["logit_scale"],
                "logit_bias": fcfg["logit_bias"],
                "embed_dim": fcfg["embed_dim"],
            },
            preprocessing=prep,
            uncertainty=cal.uncertainty(),
            model=model_spec(fcfg, cal),
            exports=exports,
            precision=precision,
            metrics=metrics,
            data=data.splits,
            build=provenance(cfg, timer),
            ood=label_free_spec(cal, data),
            guarantees=guarantees.spec if guarantees is not None else None,
        )

    title = f"{cfg.name}: zero-shot Hydra ({strategy['name']}, M={len(members)})"
    return write_artifact(ctx, manifest, evaluation, title, zero_shot_extra(ctx, calibrated, t_single, fitted))


# ----------------------------------------------------------------------------- the numbers, printed
TABLE_METHODS = ("single", "single_ts", "hydra", "ensemble_unfused")


def metrics_table(artifact: str | Path, methods: Sequence[str] = TABLE_METHODS) -> str:
    """Zero-shot accuracy, ECE, NLL and per-OOD-set AUROC / FPR95 (%) of ``methods`` from ``report.json``."""
    doc = json.loads((Path(artifact) / "report.json").read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    sets = list(doc.get("ood_kinds", {}))
    head = ["method", "acc %", "ECE %", "NLL"] + [f"{s} {k}" for s in [*sets, "avg"] for k in ("AUROC", "FPR95")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}"

    for m in methods:
        if m not in rows:
            continue
        r = rows[m]
        ood = [r["ood"].get(s, {}) for s in sets] + [r.get("ood_avg", {})]
        cells = [m, pct(r["acc"]), pct(r["ece"]), f"{r['nll']:.4f}"]
        cells += [pct(o.get(k)) for o in ood for k in ("auroc", "fpr95")]
        lines.append("| " + " | ".join(cells) + " |")
    kinds = ", ".join(f"{s}: {k}" for s, k in doc.get("ood_kinds", {}).items())
    return "\n".join([f"{doc['title']} (OOD sets: {kinds}; score {doc['extra'].get('ood_score')})", *lines])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m offline.pipelines.zeroshot_build ARTIFACT``: print the zero-shot metrics table of a built
    artifact."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("artifact", help="artifact directory holding report.json")
    args = ap.parse_args(argv)
    print(metrics_table(args.artifact))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
