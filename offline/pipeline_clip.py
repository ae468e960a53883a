"""The zero-shot build (family ``clip``): data → base CLIP → joint head scores → members → fuse → calibrate →
export both encoders → report, composed of :mod:`offline.stages`. ``offline.build`` calls :func:`build_zero_shot`
for ``family: clip``.

Base model (``base.source``):

* ``lit``: an OpenCLIP ``CustomTextCLIP`` with the packaged MiniLM as frozen text tower and an image
  tower trained here on the ID classes' captions (:mod:`offline.lit`; preset ``base.preset``, e.g.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import open_clip
import torch
from open_clip.model import get_model_preprocess_cfg
from open_clip.tokenizer import bytes_to_unicode, default_bpe
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, CLIPTokenizer

from service.core.artifact import OOD_FILE, Manifest, file_sha256
from service.core.fused_clip import zero_shot_logits
from service.core.ood import ood_tensors
from service.core.preprocess import ImagePreprocessor
from service.core.uncertainty import SUMMARY_SCORES, summarize

from . import lit
from .calibration import fit_temperature
from .config import BuildConfig, ConfigError, check_budget
from .data import ROOT
from .export import ONNX_OPSET, bf16_agreement, export_checked
from .families.clip import CLIPAdapter, split_heads
from .foreign import foreign_images
from .fusion import fuse
from .guarantees import GUARANTEES_FILE, CalibrationOutputs, evaluate_guarantees, fit_guarantees
from .ood_fit import (
    LAYERS,
    background_stats,
    base_score,
    candidate_scores,
    columns_of,
    fit_layer_stats,
    flag_rate,
    label_free_scores,
    layer_candidates,
    restrict_layers,
    select_score,
    with_layers,
)
from .progress import stage as progress_stage
from .stages import (
    EVAL_BATCH,
    EVAL_MAX_PIXELS,
    FASHION_MEAN,
    FASHION_STD,
    Batch,
    Calibration,
    EvalSets,
    Method,
    ScoringBatches,
    Timer,
    best_layers,
    budget_of,
    build_members,
    calibrate,
    collect_logits,
    concat,
    eval_batches,
    evaluate,
    forced_score,
    layer_candidate_name,
    load_data,
    prepare_out,
    provenance,
    sample_indices,
    standard_methods,
    take,
    taylor_members,
    write_artifact,
)
from .train import TrainConfig

log = logging.getLogger("hydra.build")

HEAD_INDEX = (
    "joint layer index: vision tower layers 0..Lv-1, then text tower layers Lv..Lv+Lt-1; "
    "heads are indices into the base model's heads of that layer"
)
OPENCLIP_PREFIX = "openclip:"


# ----------------------------------------------------------------------------- base models
def image_prep(size: Sequence[int], mean: Sequence[float], std: Sequence[float], interpolation: str) -> dict:
    """The image part of the artifact's preprocessing: RGB (gray replicated), resized directly to ``size``."""
    return {"type": "image", "size": [int(s) for s in size], "mean": [float(m) for m in mean],
            "std": [float(s) for s in std], "interpolation": interpolation, "channels": 3, "resize": "direct"}


def lit_cache_dir() -> Path:
    return Path(os.environ.get("HYDRA_CACHE_DIR", ROOT / ".cache")) / "lit"


def _lit_key(model_cfg: dict, tcfg: TrainConfig, data, max_length: int, image_init: str | None = None) -> str:
    tower = Path(model_cfg["text_cfg"]["hf_model_name"])
    weights = next(iter(sorted(tower.glob("*.safetensors"))), None)
    doc = {"model": model_cfg, "train": vars(tcfg), "templates": lit.TRAIN_TEMPLATES, "max_length": max_length,
           "classes": list(data.class_names), "train_split": data.splits.get("id", {}).get("train"),
           "text_weights": file_sha256(weights) if weights else None, "version": 1}
    if image_init:  # the image tower's starting weights (an unset one keeps older keys)
        doc["image_init"] = file_sha256(image_init)
    blob = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


def load_base_clip(cfg: BuildConfig, data: Any) -> tuple[nn.Module, Any, dict, dict]:
    """Base CLIP (eval), its tokenizer, the artifact preprocessing and a description for the manifest."""
    src = cfg.base.source
    if src == "lit":
        return _lit_base(cfg, data)
    if src.startswith(OPENCLIP_PREFIX):
        name = src[len(OPENCLIP_PREFIX):]
        model = load_openclip(name, cfg.base.path)
        pp = get_model_preprocess_cfg(model)  # what open_clip's own transforms would do
        size = pp.get("size", model.visual.image_size)
        size = [size, size] if isinstance(size, int) else list(size)
        prep = image_prep(size, pp["mean"], pp["std"], pp.get("interpolation", "bicubic"))
        if hasattr(model, "text") and hasattr(model.text, "config"):  # HF text tower
            tok_name = open_clip.get_model_config(Path(name).stem)["text_cfg"].get("hf_tokenizer_name")
            tok = AutoTokenizer.from_pretrained(tok_name or model.text.config.name_or_path)
            max_length = cfg.base.max_length
        else:
            max_length = int(model.context_length)
            tok = openclip_tokenizer(max_length)
        # open_clip's own text transformer adds its positional embedding to all context_length positions
        padding = "longest" if hasattr(model, "text") and hasattr(model.text, "config") else "max_length"
        prep["text"] = {"max_length": max_length, "tokenizer": "tokenizer", "padding": padding}
        desc = {"name": Path(name).stem, "source": src, "path": cfg.base.path,
                "sha256": file_sha256(cfg.base.path) if cfg.base.path else None}
        return model, tok, prep, desc
    raise ConfigError(f"base.source {src!r} is not a zero-shot model source (lit, openclip:<name or config.json>)")


def _lit_base(cfg: BuildConfig, data) -> tuple[nn.Module, Any, dict, dict]:
    if cfg.base.preset not in lit.LIT_PRESETS:
        raise ConfigError(f"base.preset {cfg.base.preset!r} is not a LiT preset; known: {sorted(lit.LIT_PRESETS)}")
    preset = lit.LIT_PRESETS[cfg.base.preset]
    vision = {**preset["vision"], **cfg.base.arch}
    model_cfg = lit.lit_model_config(vision, text_path=cfg.base.path)
    tcfg = TrainConfig(**{**preset["train"], **({"steps": cfg.base.steps} if cfg.base.steps else {}),
                          "seed": cfg.data.seed})
    max_length = min(cfg.base.max_length, model_cfg["text_cfg"]["context_length"])
    size = vision["image_size"]
    size = [size, size] if isinstance(size, int) else list(size)
    prep = image_prep(size, [FASHION_MEAN] * 3, [FASHION_STD] * 3, "bilinear")
    tok = lit.load_tokenizer(model_cfg)
    if cfg.base.image_init and not Path(cfg.base.image_init).is_file():
        raise ConfigError(f"base.image_init {cfg.base.image_init} is not a file")
    key = _lit_key(model_cfg, tcfg, data, max_length, cfg.base.image_init)
    cache = lit_cache_dir() / key
    name = f"lit-{cfg.base.preset}"
    model = lit.make_lit_model(model_cfg, pretrained_text=True, seed=tcfg.seed)
    init = lit.init_image_tower(model, cfg.base.image_init) if cfg.base.image_init else None
    weights = cache / f"{name}.safetensors"
    if weights.is_file() and (cache / "lit_log.json").is_file():
        model.load_state_dict(load_file(str(weights)), strict=True)
        info = json.loads((cache / "lit_log.json").read_text())
        log.info("LiT base model loaded from the cache %s", cache)
    else:
        lit.train_lit(model, tok, data, tcfg, prep, max_length=max_length)
        info = getattr(model, lit.LIT_TRAIN_LOG_ATTR)
        lit.save_openclip(model, model_cfg, cache, name)
        (cache / "lit_log.json").write_text(json.dumps(info, indent=2, default=str))
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
    return model.eval(), tok, prep, desc


# ----------------------------------------------------------------------------- batches
def prompt_batch(
    tok: Any, class_names: Sequence[str], template: str, text_prep: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Tokenised class prompts ``{"input_ids", "attention_mask"}`` ``(L, T)`` as ``preprocessing.text`` says."""
    texts = lit.prompts(class_names, template)
    return lit.tokenize_prompts(tok, texts, text_prep["max_length"], padding=text_prep.get("padding", "longest"))


def zero_shot_batches(
    images: np.ndarray, labels: np.ndarray, prep: dict, prompts_: dict[str, torch.Tensor], batch_size: int = EVAL_BATCH
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Images in order as ``({"pixel_values": (B, 3, H, W), "input_ids": (L, T), "attention_mask": (L, T)}, y)``."""
    out = []
    for i in range(0, len(labels), batch_size):
        x = lit.pixel_batch(images[i : i + batch_size], prep["mean"], prep["std"], prep["size"], prep["channels"])
        out.append(({"pixel_values": x, **prompts_}, torch.as_tensor(np.asarray(labels[i : i + batch_size]))))
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


# ----------------------------------------------------------------------------- members
def build_clip_members(
    cfg: BuildConfig, adapter: CLIPAdapter, base: nn.Module, scoring: ScoringBatches, timer: Timer
) -> tuple[list[nn.Module], dict[str, Any]]:
    """Members by joint circuits / random ranking (:func:`offline.stages.build_members`) or vision-only Taylor."""
    if cfg.hydra.strategy != "taylor":
        return build_members(cfg, adapter, base, scoring, timer)
    heads = adapter.heads(base)
    lv = adapter.num_vision_layers(base)
    counts = budget_of(cfg).per_layer_counts(heads[:lv]) + [0] * (len(heads) - lv)  # the vision tower only
    base.requires_grad_(False)
    base.visual.requires_grad_(True)  # gradients only where heads are scored
    members, info = taylor_members(cfg, adapter, base, scoring.calib, counts)
    base.requires_grad_(False)
    timer.lap("taylor scoring and pruning (vision tower)")
    return members, {**info, "towers": "vision only"}


def scoring_batches(cfg: BuildConfig, data: Any, prep: dict, prompts_: Batch) -> ScoringBatches:
    """Taylor's gradient batches and circuit extraction's ID / OOD validation batches, each with the prompts."""
    n = min(cfg.hydra.calib_samples, len(data.train.labels))
    cal_idx = sample_indices(len(data.train.labels), n, cfg.data.seed)
    calib = zero_shot_batches(take(data.train.inputs, cal_idx), data.train.labels[cal_idx], prep, prompts_, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val = zero_shot_batches(take(data.val.inputs, np.arange(n_val)), data.val.labels[:n_val], prep, prompts_, 256)
    ood_x = ood_sample(data.ood_val, n_val, cfg.data.seed)
    return ScoringBatches.of(calib, val, zero_shot_batches(ood_x, np.zeros(len(ood_x), dtype=np.int64), prep,
                                                           prompts_, 256))  # fmt: skip


# ----------------------------------------------------------------------------- build
def build_zero_shot(cfg: BuildConfig, out: Path) -> Path:
    """Build the zero-shot artifact of ``cfg`` into ``out`` (see the module docstring) and return it."""
    torch.manual_seed(cfg.data.seed)
    out = Path(out)
    timer = Timer()
    data = load_data(cfg)
    if data.modality != "image":
        raise ConfigError(f"family clip needs image data, got {data.modality} data")
    timer.lap("data")
    adapter = CLIPAdapter()
    base, tok, prep, base_desc = load_base_clip(cfg, data)
    heads = adapter.heads(base)
    check_budget(cfg, heads[: adapter.num_vision_layers(base)] if cfg.hydra.strategy == "taylor" else heads)
    timer.lap("base model")
    prompts_ = prompt_batch(tok, data.class_names, lit.TEMPLATE, prep["text"])
    members, strategy = build_clip_members(cfg, adapter, base, scoring_batches(cfg, data, prep, prompts_), timer)
    if cfg.hydra.finetune_steps > 0:
        log.warning("hydra.finetune_steps is ignored for zero-shot builds: members are used without training")
    fused, fcfg = fuse(adapter, members, mlp=cfg.hydra.mlp)
    timer.lap("fusion")
    return finish_zero_shot(cfg, out, adapter, base, members, (fused, fcfg), data, (prep, tok, prompts_), strategy,
                            base_desc, timer)  # fmt: skip


def zero_shot_fns(
    adapter: CLIPAdapter, base: nn.Module, members: list[nn.Module], fused: nn.Module, prompts_: Batch
) -> tuple[Callable[[Batch], torch.Tensor], Callable[[Batch], torch.Tensor], list[Callable[[Batch], torch.Tensor]]]:
    """``(fused, base, members)``: batch -> zero-shot logits, the label prompts embedded once as the server does."""
    with torch.inference_mode():
        text_emb = fused.encode_text(prompts_["input_ids"], prompts_["attention_mask"])  # (L, M, D)
        text_feats = {id(m): adapter.encode_text(m, prompts_) for m in [base, *members]}  # (L, D) each

    def fused_fn(b: Batch) -> torch.Tensor:
        return zero_shot_logits(fused.encode_image(b["pixel_values"]), text_emb, fused.logit_scale.exp(),
                                fused.logit_bias)  # fmt: skip

    def member_fn(m: nn.Module) -> Callable[[Batch], torch.Tensor]:
        return lambda b: adapter.logits(m, adapter.encode_image(m, b), text_feats[id(m)])

    return fused_fn, member_fn(base), [member_fn(m) for m in members]


def zero_shot_exports(
    cfg: BuildConfig, fused: nn.Module, val: list, tok: Any, class_names: list[str], prep: dict, prompts_: Batch,
    out: Path,
) -> dict[str, Any]:  # fmt: skip
    """Both encoders exported and checked against eager: images at batch 2, 5 and 16; prompts of the build's labels,
    of two labels with another template, and of more labels than the build saw."""
    image_batches = [{"pixel_values": b["pixel_values"][:k]} for (b, _), k in zip(val[:3], (2, 5, 16), strict=False)]
    text_batches = [
        dict(prompts_),
        prompt_batch(tok, class_names[:2], "a photo of the {label}, a type of clothing.", prep["text"]),
        prompt_batch(tok, list(class_names) + ["dog", "bicycle"], "{label}", prep["text"]),
    ]
    image_out = ["image_embeds"] + (["layer_features"] if fused.visual.with_layer_features else [])
    encoders = {"image": (fused.image_encoder, image_batches, image_out),
                "text": (fused.text_encoder, text_batches, ["text_embeds"])}  # fmt: skip
    tol = cfg.export.tolerance
    exports: dict[str, Any] = {}
    for kind, on in (("torchscript", cfg.export.torchscript), ("onnx", cfg.export.onnx)):
        if not on:
            continue
        ext = "ts" if kind == "torchscript" else "onnx"
        rec: dict[str, Any] = {"max_abs_diff": {}, "tolerance": tol}
        if ext == "onnx":
            rec.update(opset=ONNX_OPSET, inputs={})
        for side, (mod, batches, names) in encoders.items():
            path = out / f"{side}_encoder.{ext}"
            rec["max_abs_diff"][side] = export_checked(mod, kind, path, batches, tol, names)
            rec[side] = path.name
            if ext == "onnx":  # the graph inputs actually present
                rec["inputs"][side] = [i.name for i in onnx.load(str(path)).graph.input]
        exports[kind] = rec
    return exports


def finish_zero_shot(
    cfg: BuildConfig, out: Path, adapter: CLIPAdapter, base: nn.Module, members: list[nn.Module],
    fused_and_config: tuple[nn.Module, dict], data: Any, prep_tok_prompts: tuple[dict, Any, Batch], strategy: dict,
    base_desc: dict, timer: Timer,
) -> Path:  # fmt: skip
    """Calibrate, evaluate, export and write the artifact; evaluation images go through the server's preprocessing
    (:func:`offline.stages.eval_batches`)."""
    (fused, fcfg), (prep, tok, prompts_) = fused_and_config, prep_tok_prompts
    prepare_out(out)
    pre = ImagePreprocessor(prep, EVAL_MAX_PIXELS)
    val = eval_batches(pre, data.val.inputs, data.val.labels, extra=prompts_)[0]
    test = eval_batches(pre, data.test.inputs, data.test.labels, extra=prompts_)[0]
    ood_test = {n: eval_batches(pre, x, [0] * len(x), extra=prompts_)[0] for n, (x, _) in data.ood_test.items()}
    ood_val_x = concat(list(data.ood_val.values()))
    ood_val = eval_batches(pre, ood_val_x, [0] * len(ood_val_x), extra=prompts_)[0]
    fused_fn, single, member_fns = zero_shot_fns(adapter, base, members, fused, prompts_)
    with progress_stage("calibration"):
        cal = calibrate(cfg, fused_fn, val, ood_val)
        served, scores = None, None
        if forced_score(cfg) not in SUMMARY_SCORES:  # auto or a feature score: the label-free distance (default)
            cal, scores = calibrate_label_free(cfg, cal.temperature, image_feature_runs(fused, pre, data, val, test,
                                                                                        ood_test))  # fmt: skip
            served = served_label_free(cal, scores)
        guarantees, served_outs = zero_shot_guarantees(cfg, fused_fn, cal, data, pre, prompts_, val, scores)
        val_y = torch.cat([y for _, y in val])
        T_single = fit_temperature(collect_logits(single, val), val_y) if cfg.calibration.temperature else 1.0
    timer.lap("calibration")

    sets = EvalSets(test, ood_test)
    methods = standard_methods(single, base, member_fns, members, fused_fn, fused, cal.temperature, sets)
    # the base model at its own fitted temperature: a baseline for the ensemble's calibration
    methods["single_ts"] = Method(single, methods["single"].params, T_single, runs=methods["single"].runs)
    example = test[0][0]
    latency = tuple({**example, "pixel_values": example["pixel_values"][:k]} for k in (1, 8))
    ood_kinds = {name: kind for name, (_, kind) in data.ood_test.items()}
    metric = cal.metric if cal.metric in SUMMARY_SCORES else "msp"  # the main rows' score: a probability score
    rows, plots = evaluate(methods, sets, data.test.labels, ood_kinds, metric, latency)  # image side per call
    timer.lap("evaluation")
    report = None if guarantees is None else zero_shot_guarantees_report(
        cfg, methods["hydra"], cal, torch.cat([y for _, y in test]), served_outs, scores, timer)

    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, str(out / "model.safetensors"))
    if cal.stats is not None:
        save_file(ood_tensors(cal.stats), str(out / OOD_FILE))
    if guarantees is not None:
        save_file(guarantees.tensors, str(out / GUARANTEES_FILE))
    fused.visual.with_layer_features = cal.stats is not None and cal.stats.layers is not None
    with progress_stage("export"):
        exports = zero_shot_exports(cfg, fused, val, tok, list(data.class_names), prep, prompts_, out)
    precision = {"bf16": bf16_agreement(fused, [b for b, _ in val[:4]], temperature=cal.temperature)} \
        if cfg.export.bf16_check else {}  # fmt: skip
    tok.save_pretrained(str(out / "tokenizer"))
    timer.lap("export")

    def manifest(metrics: dict[str, Any]) -> Manifest:
        return Manifest(
            name=cfg.name, family="clip", task="zero-shot", base_model=base_desc, members=len(members),
            heads=[split_heads(base, adapter.kept_heads(m)) for m in members], head_index=HEAD_INDEX,
            strategy=strategy, labels=list(data.class_names),
            zero_shot={"template": lit.TEMPLATE, "logit_scale": fcfg["logit_scale"], "logit_bias": fcfg["logit_bias"],
                       "embed_dim": fcfg["embed_dim"]},
            preprocessing=prep, uncertainty=cal.uncertainty(), model=model_spec(fcfg, cal), exports=exports,
            precision=precision, metrics=metrics, data=data.splits, build=provenance(cfg, timer),
            ood=label_free_spec(cal, data), guarantees=guarantees.spec if guarantees is not None else None,
        )  # fmt: skip

    extra = {"template": lit.TEMPLATE, "labels": list(data.class_names), "temperature": cal.temperature,
             "temperature_single_ts": T_single, "ood_threshold": cal.threshold, "ood_score": cal.metric,
             "timings_s": timer.times, "ood_val_flagged": cal.ood_val_flagged,
             "base_zero_shot_val_acc": base_desc.get("lit", {}).get("val_zero_shot_accuracy")}  # fmt: skip
    if report is not None:
        extra["guarantees_report"] = report
    if served is not None:
        extra.update(ood_candidates=cal.candidates, ood_selected=cal.selected or cal.metric, served_flag=served)
        if cal.layer_ids is not None:
            extra["ood_layers"] = list(cal.layer_ids)
    title = f"{cfg.name}: zero-shot Hydra ({strategy['name']}, M={len(members)})"
    plots["class_names"] = list(data.class_names)  # the per-class table and confusion matrix, by name
    return write_artifact(out, manifest, rows, ood_kinds, plots, title, extra)


def model_spec(fcfg: dict[str, Any], cal: Calibration | None = None) -> dict[str, Any]:
    """The manifest's ``model`` block of a fused dual encoder; ``outputs``: with label-free OOD statistics the image
    embeddings are the scores' ``features`` (and, for ``mahalanobis_layers``, the image tower's layer features)."""
    image = {"inputs": ["pixel_values"], "output": "image_embeds", "shape": "(B, M, D)"}
    outputs = ["logits"]
    if cal is not None and cal.stats is not None:
        outputs.append("features")
        if cal.stats.layers is not None:
            outputs.append("layer_features")
            image["outputs"] = ["image_embeds", "layer_features"]
    return {
        "config": fcfg, "weights": "model.safetensors", "inputs": ["pixel_values", "input_ids", "attention_mask"],
        "output": "logits", "shape": "(B, M, L)", "outputs": outputs, "image_encoder": image,
        "text_encoder": {"inputs": ["input_ids", "attention_mask"], "output": "text_embeds", "shape": "(L, M, D)"},
    }  # fmt: skip


# ----------------------------------------------------------------------------- the label-free OOD score
ImageRun = tuple[torch.Tensor, torch.Tensor | None]  # image embeddings (N, M, D), layer features (N, M, L-1, d)


@torch.inference_mode()
def image_feature_runs(
    fused: nn.Module, pre: ImagePreprocessor, data: Any, val: list, test: list, ood_test: dict[str, list]
) -> dict[str, ImageRun]:
    """The fused image tower's embeddings and layer features on every set: ``fit`` (the statistics), ``val`` (their
    norms, the thresholds), ``oodval:<name>`` (selection), ``test``, ``ood:<name>`` and ``foreign`` (the report)."""
    sets: dict[str, list] = {
        "fit": eval_batches(pre, data.fit.inputs, data.fit.labels)[0], "val": val, "test": test,
        **{f"ood:{n}": b for n, b in ood_test.items()},
        **{f"oodval:{n}": eval_batches(pre, x, [0] * len(x))[0] for n, x in data.ood_val.items()},
    }  # fmt: skip
    if data.calibration is not None:
        sets["calibration"] = eval_batches(pre, data.calibration.inputs, data.calibration.labels)[0]
    foreign = [f.pixels for f in foreign_images()]
    sets["foreign"] = eval_batches(pre, foreign, [0] * len(foreign), sort=False)[0]
    out = {}
    for name, batches in sets.items():
        parts = [fused.image_features(b["pixel_values"]) for b, _ in batches]
        layers = [p[1] for p in parts]
        out[name] = (torch.cat([p[0] for p in parts]).float(),
                     torch.cat(layers).float() if layers and layers[0] is not None else None)  # fmt: skip
    return out


def calibrate_label_free(
    cfg: BuildConfig, temperature: float, runs: dict[str, ImageRun]
) -> tuple[Calibration, dict[str, dict[str, np.ndarray]]]:
    """The served OOD score of a zero-shot model: label-free, since the labels come with each request. One Gaussian
    per member of the ID images' embeddings (the fit split), ``mahalanobis`` the distance to it; the image tower's
    layers as :func:`offline.stages.calibrate_ood` uses them (``mahalanobis_layers`` candidates); the threshold at
    ``calibration.tpr`` of ID validation images and the best mean recall over the OOD validation sets, as for the
    classifiers. The flag does not depend on the labels of a request. Also returns every candidate's scores on every
    set of ``runs`` (the report's)."""
    fit, val = runs["fit"], runs["val"]
    stats = background_stats(fit[0], val[0])
    scores = {name: {"mahalanobis": label_free_scores(emb, stats).numpy()} for name, (emb, _) in runs.items()}
    full = None
    if val[1] is not None and fit[1] is not None and val[1].shape[2] > 0:
        zeros = torch.zeros(fit[1].shape[0], dtype=torch.int64)
        full = fit_layer_stats(fit[1], zeros, 1, val[1], torch.from_numpy(scores["val"]["mahalanobis"]))
        for name, (_, layers) in runs.items():
            cols = columns_of(torch.from_numpy(scores[name]["mahalanobis"]), layers, full)
            for ids in layer_candidates(val[1].shape[2]):
                scores[name][layer_candidate_name(ids)] = candidate_scores(cols, full, ids)
    ood_val = {name[7:]: v for name, v in scores.items() if name.startswith("oodval:")}
    forced = forced_score(cfg)
    selected, candidates = select_score(scores["val"], ood_val, cfg.calibration.tpr, forced)
    metric = base_score(selected)
    layer_ids = best_layers(candidates, selected)
    if metric == LAYERS and full is not None:
        stats = with_layers(stats, restrict_layers(full, layer_ids))  # type: ignore[arg-type]
    c = candidates[selected]
    cal = Calibration(temperature, metric, c["threshold"], cfg.calibration.tpr, c["val_mean_recall"] or 0.0, stats,
                      candidates, forced is not None, selected, layer_ids)  # fmt: skip
    return cal, scores


def zero_shot_guarantees(
    cfg: BuildConfig, fused_fn: Callable[[Batch], torch.Tensor], cal: Calibration, data: Any, pre: ImagePreprocessor,
    prompts_: Batch, val: list, scores: dict[str, dict[str, np.ndarray]] | None,
) -> tuple[Any, dict[str, CalibrationOutputs]]:  # fmt: skip
    """The guarantees of a zero-shot model on the calibration split: sets and risk rules for the build's labels and
    template, OOD p-values of the served score (label-free unless a probability score is forced); ``(None, {})``
    without a calibration split. Also returns the served outputs on ``calibration`` and ``val`` (the report's)."""
    if data.calibration is None:
        return None, {}
    cal_batches = eval_batches(pre, data.calibration.inputs, data.calibration.labels, extra=prompts_)[0]
    outs = {name: zero_shot_outputs(collect_logits(fused_fn, batches), torch.cat([y for _, y in batches]), cal,
                                    scores, name) for name, batches in (("calibration", cal_batches), ("val", val))}
    fitted = fit_guarantees(cfg.guarantees, outs["calibration"], outs["val"], cal.metric, cal.threshold,
                            data.splits.get("id", {}).get("calibration", {}), label_free=scores is not None)
    return fitted, outs  # fmt: skip


def zero_shot_outputs(logits: torch.Tensor, labels: torch.Tensor, cal: Calibration,
                      scores: dict[str, dict[str, np.ndarray]] | None, name: str) -> CalibrationOutputs:  # fmt: skip
    """The served answer on one set: probabilities of the build's labels at the served temperature, the served OOD
    score (``scores[name]``: the label-free score; None: the probability score of ``logits``), the labels."""
    s = summarize(logits, cal.temperature)
    score = scores[name][cal.selected] if scores is not None else s[cal.metric].double().numpy()
    return CalibrationOutputs(s["probs"].double().numpy(), labels.numpy(), np.asarray(score, dtype=np.float64))


def zero_shot_guarantees_report(cfg: BuildConfig, hydra: Method, cal: Calibration, test_labels: torch.Tensor,
                                served: dict[str, CalibrationOutputs], scores: dict[str, dict[str, np.ndarray]] | None,
                                timer: Timer) -> dict[str, Any]:  # fmt: skip
    """The report's guarantees section of a zero-shot build (:func:`offline.guarantees.evaluate_guarantees`), for
    the served model alone: the build's labels and template, its served score on the calibration split, ID test and
    each OOD test set. (Single and the members have no label-free statistics of their own to compare like with
    like.)"""
    outs = dict(served)
    outs["test"] = zero_shot_outputs(hydra.runs["test"][0], test_labels, cal, scores, "test")
    for name, run in hydra.runs.items():
        if name.startswith("ood:"):
            outs[name] = zero_shot_outputs(run[0], torch.zeros(len(run[0]), dtype=torch.int64), cal, scores, name)
    with progress_stage("guarantees (drift simulations)"):
        report = evaluate_guarantees(cfg.guarantees, {"hydra": outs}, {"hydra": cal.threshold}, cal.metric)
    timer.lap("guarantees (drift simulations)")
    return report


def served_label_free(cal: Calibration, scores: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """The served label-free flag on the test sets (ID test: false alarms; each OOD test set and the foreign-image
    set per kind: recall), as the report's ``served_flag``; ``scores``: :func:`calibrate_label_free`'s."""
    score = {name: v[cal.selected] for name, v in scores.items()}
    kinds = [f.kind for f in foreign_images()]
    flags = np.asarray(score["foreign"]) > cal.threshold
    return {
        "score": cal.metric, "threshold": cal.threshold,
        "id_test_flag_rate": flag_rate(score["test"], cal.metric, cal.threshold),
        "recall": {n[4:]: flag_rate(v, cal.metric, cal.threshold) for n, v in score.items() if n.startswith("ood:")},
        "foreign": float(flags.mean()),
        "foreign_by_kind": {k: float(flags[[kk == k for kk in kinds]].mean()) for k in dict.fromkeys(kinds)},
    }  # fmt: skip


def label_free_spec(cal: Calibration, data: Any) -> dict[str, Any] | None:
    """The manifest's ``ood`` block of a zero-shot model with label-free statistics (None: probability scores)."""
    if cal.stats is None:
        return None
    scores = ["mahalanobis"] + ([LAYERS] if cal.stats.layers is not None else [])
    spec = {"file": OOD_FILE, "scores": scores, "selected": cal.metric, "forced": cal.forced,
            "candidates": cal.candidates, "fit": data.splits.get("id", {}).get("fit"), "label_free": True}  # fmt: skip
    if cal.stats.layers is not None:
        spec["layers"] = list(cal.stats.layers.ids)
    return spec


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
    """``python -m offline.pipeline_clip ARTIFACT``: print the zero-shot metrics table of a built artifact."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("artifact", help="artifact directory holding report.json")
    args = ap.parse_args(argv)
    print(metrics_table(args.artifact))
    return 0


__all__ = [
    "HEAD_INDEX",
    "metrics_table",
    "build_clip_members",
    "build_zero_shot",
    "finish_zero_shot",
    "image_prep",
    "load_base_clip",
    "load_openclip",
    "openclip_tokenizer",
    "ood_sample",
    "prompt_batch",
    "zero_shot_batches",
]


if __name__ == "__main__":
    raise SystemExit(main())
