"""The zero-shot build (family ``clip``): data → base CLIP → joint head scores → members → fuse → calibrate →
export both encoders → report. ``offline.pipeline.build`` calls :func:`build_zero_shot` for ``family: clip``.

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

Artifact (CONTRACT.md §1) — files: ``manifest.json``, ``model.safetensors`` (the fused
``service.fused_clip.FusedCLIP``), ``image_encoder.ts``, ``text_encoder.ts``, ``image_encoder.onnx``,
``text_encoder.onnx``, ``tokenizer/`` (Hugging Face tokenizer, ``AutoTokenizer.from_pretrained``), and
``report.md``, ``report.json``, ``plots/*.png``. The manifest::

    {
      "format_version": 1, "name": str, "family": "clip", "task": "zero-shot",
      "base_model": {"name", "source", "path", "sha256", "open_clip_config", "lit": {...} | absent},
      "members": M,
      "heads": [{"vision": [[kept base head indices] per vision layer], "text": [[...] per text layer]}, ...M],
      "head_index": "<how the joint (layer, head) pairs of strategy.ranking are numbered>",
      "strategy": {"name", "seeds", "budget", "pool", "ranking": [[joint layer, head], ...], ...},
      "labels": [class names],          # the build's fixed label set, in logit order (for /predict)
      "zero_shot": {"template": "A photo of a {label}.", "logit_scale": float (the multiplier, exp'd),
                    "logit_bias": float | null, "embed_dim": D},
      "preprocessing": {"type": "image", "size": [H, W], "mean": [3], "std": [3], "interpolation",
                        "channels": 3, "resize": "direct",
                        "text": {"max_length": int, "tokenizer": "tokenizer", "padding": "longest"}},
      "uncertainty": {"temperature", "ood_score", "ood_threshold", "tpr"},
      "model": {"config": <FusedCLIP config>, "weights": "model.safetensors",
                "inputs": ["pixel_values", "input_ids", "attention_mask"], "output": "logits", "shape": "(B, M, L)",
                "image_encoder": {"inputs": ["pixel_values"], "output": "image_embeds", "shape": "(B, M, D)"},
                "text_encoder": {"inputs": ["input_ids", "attention_mask"], "output": "text_embeds",
                                 "shape": "(L, M, D)"}},
      "exports": {"torchscript": {"image": "image_encoder.ts", "text": "text_encoder.ts",
                                  "max_abs_diff": {"image": float, "text": float}, "tolerance": float},
                  "onnx": {"image": "image_encoder.onnx", "text": "text_encoder.onnx",
                           "inputs": {"image": [...], "text": [...]},  # graph inputs actually present
                           "max_abs_diff": {...}, "tolerance": float, "opset": 17}},
      "precision": {"bf16": {...}}, "metrics": {method: headline numbers}, "data": {...}, "build": {...},
      "files": {...}  # added by service.artifact.write_manifest
    }

Serving: embed the labels' prompts once with the text encoder, ``(L, M, D)``; per request embed the
images, ``(B, M, D)``; member logits ``(B, M, L) = logit_scale · einsum("bmd,lmd->bml")``
(``+ logit_bias``), divided by ``uncertainty.temperature``, then ``service.uncertainty.summarize``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.uncertainty import ood_score as ood_score_of
from service.uncertainty import summarize

from . import lit
from .config import BuildConfig, ConfigError, check_budget
from .data import ROOT
from .families.clip import CLIPAdapter, split_heads
from .fusion import fuse
from .members import Budget, pool_size
from .pipeline import (
    EVAL_BATCH,
    FASHION_MEAN,
    FASHION_STD,
    Timer,
    _flag,
    _n_params,
    build_members,
    collect_logits,
    file_sha256,
    load_data,
)
from .scoring import taylor_prune
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


def _lit_key(model_cfg: dict, tcfg: TrainConfig, data, max_length: int) -> str:
    tower = Path(model_cfg["text_cfg"]["hf_model_name"])
    weights = next(iter(sorted(tower.glob("*.safetensors"))), None)
    blob = json.dumps(
        {"model": model_cfg, "train": vars(tcfg), "templates": lit.TRAIN_TEMPLATES, "max_length": max_length,
         "classes": list(data.class_names), "train_split": data.splits.get("id", {}).get("train"),
         "text_weights": file_sha256(weights) if weights else None, "version": 1},
        sort_keys=True, default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_openclip(name: str, path: str | None) -> nn.Module:
    """An OpenCLIP model through open_clip's own loader: ``create_model(name, pretrained=path)``.

    ``name`` is a built-in architecture (``ViT-B-32``) or a model config ``.json`` (registered first).
    """
    import open_clip

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
    from open_clip.tokenizer import bytes_to_unicode, default_bpe
    from transformers import CLIPTokenizer

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


def load_base_clip(cfg: BuildConfig, data, timer: Timer) -> tuple[nn.Module, Any, dict, dict]:
    """Base CLIP (eval), its tokenizer, the artifact preprocessing and a description for the manifest."""
    src = cfg.base.source
    if src == "lit":
        return _lit_base(cfg, data)
    if src.startswith(OPENCLIP_PREFIX):
        name = src[len(OPENCLIP_PREFIX):]
        model = load_openclip(name, cfg.base.path)
        from open_clip.model import get_model_preprocess_cfg

        pp = get_model_preprocess_cfg(model)  # what open_clip's own transforms would do
        size = pp.get("size", model.visual.image_size)
        size = [size, size] if isinstance(size, int) else list(size)
        prep = image_prep(size, pp["mean"], pp["std"], pp.get("interpolation", "bicubic"))
        if hasattr(model, "text") and hasattr(model.text, "config"):  # HF text tower
            import open_clip
            from transformers import AutoTokenizer

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
    key = _lit_key(model_cfg, tcfg, data, max_length)
    cache = lit_cache_dir() / key
    name = f"lit-{cfg.base.preset}"
    model = lit.make_lit_model(model_cfg, pretrained_text=True, seed=tcfg.seed)
    weights = cache / f"{name}.safetensors"
    if weights.is_file() and (cache / "lit_log.json").is_file():
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(weights)), strict=True)
        info = json.loads((cache / "lit_log.json").read_text())
        log.info("LiT base model loaded from the cache %s", cache)
    else:
        lit.train_lit(model, tok, data.class_names, data.train.inputs, data.train.labels, data.val.inputs,
                      data.val.labels, tcfg, prep, max_length=max_length)
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


def ood_sample(ood_sets: dict[str, np.ndarray], n: int, seed: int) -> np.ndarray:
    """``n`` OOD validation images drawn evenly from every set (seeded), so no single set drives the circuits."""
    names = sorted(ood_sets)
    rng = np.random.default_rng(seed)
    per, extra = divmod(n, len(names))
    parts = []
    for i, name in enumerate(names):
        x = ood_sets[name]
        k = min(len(x), per + (1 if i < extra else 0))
        parts.append(x[np.sort(rng.choice(len(x), size=k, replace=False))])
    return np.concatenate(parts)


# ----------------------------------------------------------------------------- members
def build_clip_members(
    cfg: BuildConfig,
    adapter: CLIPAdapter,
    base: nn.Module,
    calib: list,
    val_id: list,
    val_y: torch.Tensor,
    val_ood: list,
    timer: Timer,
) -> tuple[list[nn.Module], dict[str, Any]]:
    """Members by joint circuits / random ranking (``offline.pipeline.build_members``) or vision-only Taylor."""
    h = cfg.hydra
    if h.strategy != "taylor":
        return build_members(cfg, adapter, base, calib, val_id, val_y, val_ood, timer)
    heads = adapter.heads(base)
    lv = adapter.num_vision_layers(base)
    budget = Budget(per_layer=h.prune_per_layer) if h.prune_per_layer is not None else Budget(total=h.prune_total)
    vision_counts = budget.per_layer_counts(heads[:lv])
    counts = vision_counts + [0] * (len(heads) - lv)  # Taylor prunes the vision tower only
    pools = [pool_size(r, n, h.pool) for r, n in zip(counts, heads, strict=True)]
    seeds = list(h.seeds) if h.seeds is not None else list(range(h.members))
    base.requires_grad_(False)
    base.visual.requires_grad_(True)  # gradients only where heads are scored
    members = []
    for s in seeds:
        res = taylor_prune(adapter, base, calib, counts, pool_per_layer=pools, seed=s if h.members > 1 else None,
                           progress=True)
        members.append(res.model)
    base.requires_grad_(False)
    timer.lap("taylor scoring and pruning (vision tower)")
    info = {"name": "taylor", "seeds": seeds, "budget": vars(budget), "pool": h.pool, "pool_per_layer": pools,
            "towers": "vision only"}
    return members, info


# ----------------------------------------------------------------------------- build
def build_zero_shot(cfg: BuildConfig, out: Path) -> Path:
    """Build the zero-shot artifact of ``cfg`` into ``out`` (see the module docstring) and return it."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.data.seed)
    out = Path(out)
    timer = Timer()
    data = load_data(cfg)
    if data.modality != "image":
        raise ConfigError(f"family clip needs image data, got {data.modality} data")
    if cfg.data.labels is not None and list(cfg.data.labels) != list(data.class_names):
        raise ConfigError(f"data.labels {cfg.data.labels} do not match the data's classes {data.class_names}")
    timer.lap("data")
    adapter = CLIPAdapter()
    base, tok, prep, base_desc = load_base_clip(cfg, data, timer)
    heads = adapter.heads(base)
    lv = adapter.num_vision_layers(base)
    check_budget(cfg, heads[:lv] if cfg.hydra.strategy == "taylor" else heads)
    timer.lap("base model")

    template = lit.TEMPLATE
    prompts_ = prompt_batch(tok, data.class_names, template, prep["text"])
    n = min(cfg.hydra.calib_samples, len(data.train.labels))
    rng = np.random.default_rng(cfg.data.seed)
    cal_idx = np.sort(rng.choice(len(data.train.labels), size=n, replace=False))
    calib = zero_shot_batches(data.train.inputs[cal_idx], data.train.labels[cal_idx], prep, prompts_, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val_circ = zero_shot_batches(data.val.inputs[:n_val], data.val.labels[:n_val], prep, prompts_, 256)
    ood_circ_x = ood_sample(data.ood_val, n_val, cfg.data.seed)
    ood_circ = zero_shot_batches(ood_circ_x, np.zeros(len(ood_circ_x), dtype=np.int64), prep, prompts_, 256)
    members, strategy = build_clip_members(
        cfg, adapter, base, calib, [b for b, _ in val_circ], torch.as_tensor(data.val.labels[:n_val]),
        [b for b, _ in ood_circ], timer,
    )
    if cfg.hydra.finetune_steps > 0:
        log.warning("hydra.finetune_steps is ignored for zero-shot builds: members are used without training")
    fused, fcfg = fuse(adapter, members, mlp=cfg.hydra.mlp)
    timer.lap("fusion")
    return finish_zero_shot(cfg, out, adapter, base, members, fused, fcfg, data, prep, tok, prompts_, template,
                            strategy, base_desc, timer)


def finish_zero_shot(
    cfg: BuildConfig, out: Path, adapter: CLIPAdapter, base: nn.Module, members: list[nn.Module], fused: nn.Module,
    fcfg: dict, data, prep: dict, tok: Any, prompts_: dict[str, torch.Tensor], template: str, strategy: dict,
    base_desc: dict, timer: Timer,
) -> Path:
    """Calibrate, evaluate, export and write the artifact (mirrors ``offline.pipeline.finish_artifact``)."""
    from safetensors.torch import save_file

    from service.artifact import write_manifest

    from .calibration import calibrate_threshold, fit_temperature
    from .export import bf16_agreement, check_parity, export_onnx, export_torchscript
    from .metrics import evaluate_predictions
    from .report import measure_latency, write_report

    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    val = zero_shot_batches(data.val.inputs, data.val.labels, prep, prompts_)
    test = zero_shot_batches(data.test.inputs, data.test.labels, prep, prompts_)
    ood_test = {name: zero_shot_batches(x, np.zeros(len(x), dtype=np.int64), prep, prompts_)
                for name, (x, _) in data.ood_test.items()}
    ood_kinds = {name: kind for name, (_, kind) in data.ood_test.items()}
    ood_val_x = np.concatenate(list(data.ood_val.values()))
    ood_val = zero_shot_batches(ood_val_x, np.zeros(len(ood_val_x), dtype=np.int64), prep, prompts_)

    with torch.inference_mode():  # the label prompts are embedded once, as the server does
        text_emb = fused.encode_text(prompts_["input_ids"], prompts_["attention_mask"])  # (L, M, D)

    def fused_fn(b: dict[str, torch.Tensor]) -> torch.Tensor:
        from service.fused_clip import zero_shot_logits

        return zero_shot_logits(fused.encode_image(b["pixel_values"]), text_emb, fused.logit_scale.exp(),
                                fused.logit_bias)

    with torch.inference_mode():
        text_feats = {id(m): adapter.encode_text(m, prompts_) for m in [base, *members]}  # (L, D) each

    def member_fn(m: nn.Module):
        return lambda b: adapter.logits(m, adapter.encode_image(m, b), text_feats[id(m)])

    single_fn = member_fn(base)

    val_y = torch.as_tensor(data.val.labels)
    val_logits = collect_logits(fused_fn, val)
    T = fit_temperature(val_logits, val_y) if cfg.calibration.temperature else 1.0
    T_single = fit_temperature(collect_logits(single_fn, val), val_y) if cfg.calibration.temperature else 1.0
    metric = cfg.calibration.ood_score
    id_scores = ood_score_of(summarize(val_logits, T), metric).numpy()
    threshold = calibrate_threshold(id_scores, metric, tpr=cfg.calibration.tpr)
    ood_val_scores = ood_score_of(summarize(collect_logits(fused_fn, ood_val), T), metric).numpy()
    timer.lap("calibration")

    y_test = data.test.labels
    outputs: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    outputs["single"] = (collect_logits(single_fn, test),
                         {n: collect_logits(single_fn, b) for n, b in ood_test.items()})
    member_out = []
    for m in members:
        fn = member_fn(m)
        member_out.append((collect_logits(fn, test), {n: collect_logits(fn, b) for n, b in ood_test.items()}))
    for i, mo in enumerate(member_out):
        outputs[f"member_{i}"] = mo
    outputs["hydra"] = (collect_logits(fused_fn, test), {n: collect_logits(fused_fn, b) for n, b in ood_test.items()})
    outputs["ensemble_unfused"] = (
        torch.cat([mo[0] for mo in member_out], dim=1),
        {n: torch.cat([mo[1][n] for mo in member_out], dim=1) for n in ood_test},
    )
    temps = {"hydra": T, "single_ts": T_single}
    outputs["single_ts"] = outputs["single"]  # the single model with its own fitted temperature (a baseline)
    example = test[0][0]
    one = {**example, "pixel_values": example["pixel_values"][:1]}
    eight = {**example, "pixel_values": example["pixel_values"][:8]}
    member_fns = [member_fn(m) for m in members]
    fns = {"single": single_fn, "single_ts": single_fn, "hydra": fused_fn,
           "ensemble_unfused": lambda b: [f(b) for f in member_fns]}
    for i, f in enumerate(member_fns):
        fns[f"member_{i}"] = f
    params = {"single": _n_params(base), "single_ts": _n_params(base), "hydra": _n_params(fused),
              "ensemble_unfused": sum(_n_params(m) for m in members),
              **{f"member_{i}": _n_params(m) for i, m in enumerate(members)}}
    rows = []
    plots: dict[str, Any] = {"labels": y_test, "ood_kinds": ood_kinds}
    for name, (logits, ood_logits) in outputs.items():
        temp = temps.get(name, 1.0)
        probs = torch.softmax(logits / temp, -1).numpy()
        ood_probs = {n: torch.softmax(v / temp, -1).numpy() for n, v in ood_logits.items()}
        row = {"method": name, **evaluate_predictions(probs, y_test, ood_probs, ood_score=metric)}
        row["temperature"] = temp
        row["params"] = params[name]
        row["latency_ms"] = {  # image side per call: the label prompts' embeddings are computed once
            "batch1": measure_latency(lambda f=fns[name]: f(one)),
            "batch8": measure_latency(lambda f=fns[name]: f(eight)),
        }
        rows.append(row)
        plots[name] = {"member_probs_id": probs, "member_probs_ood": ood_probs}
    timer.lap("evaluation")

    # artifact files: weights, both encoders exported and checked against eager, tokenizer
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, str(out / "model.safetensors"))
    image_batches = [{"pixel_values": b["pixel_values"][:k]} for (b, _), k in zip(val[:3], (2, 5, 16), strict=False)]
    text_batches = [
        {k: v for k, v in prompts_.items()},
        prompt_batch(tok, data.class_names[:2], "a photo of the {label}, a type of clothing.", prep["text"]),
        prompt_batch(tok, list(data.class_names) + ["dog", "bicycle"], "{label}", prep["text"]),
    ]
    tol = cfg.export.tolerance
    encoders = {"image": (fused.image_encoder, image_batches, ["image_embeds"]),
                "text": (fused.text_encoder, text_batches, ["text_embeds"])}
    exports: dict[str, Any] = {}
    if cfg.export.torchscript:
        exports["torchscript"] = {"max_abs_diff": {}, "tolerance": tol}
        for side, (mod, batches, _) in encoders.items():
            path = out / f"{side}_encoder.ts"
            export_torchscript(mod, batches[0], path)
            exports["torchscript"][side] = path.name
            exports["torchscript"]["max_abs_diff"][side] = check_parity(mod, path, "torchscript", batches, tol)
    if cfg.export.onnx:
        import onnx

        exports["onnx"] = {"max_abs_diff": {}, "tolerance": tol, "opset": 17, "inputs": {}}
        for side, (mod, batches, names) in encoders.items():
            path = out / f"{side}_encoder.onnx"
            export_onnx(mod, batches[0], path, output_names=names)
            exports["onnx"][side] = path.name
            exports["onnx"]["inputs"][side] = [i.name for i in onnx.load(str(path)).graph.input]
            exports["onnx"]["max_abs_diff"][side] = check_parity(mod, path, "onnx", batches, tol)
    precision = {}
    if cfg.export.bf16_check:
        precision["bf16"] = bf16_agreement(fused, [b for b, _ in val[:4]], temperature=T)
    tok.save_pretrained(str(out / "tokenizer"))
    timer.lap("export")

    title = f"{cfg.name}: zero-shot Hydra ({strategy['name']}, M={len(members)})"
    metrics_summary = write_report(
        out, rows, ood_kinds, plots, title,
        extra={"template": template, "labels": list(data.class_names), "temperature": T,
               "temperature_single_ts": T_single, "ood_threshold": threshold, "ood_score": metric,
               "timings_s": timer.times, "ood_val_flagged": float(np.mean(_flag(ood_val_scores, metric, threshold))),
               "base_zero_shot_val_acc": base_desc.get("lit", {}).get("val_zero_shot_accuracy")},
    )
    manifest = {
        "format_version": 1,
        "name": cfg.name,
        "family": "clip",
        "task": "zero-shot",
        "base_model": base_desc,
        "members": len(members),
        "heads": [split_heads(base, adapter.kept_heads(m)) for m in members],
        "head_index": HEAD_INDEX,
        "strategy": strategy,
        "labels": list(data.class_names),
        "zero_shot": {"template": template, "logit_scale": fcfg["logit_scale"], "logit_bias": fcfg["logit_bias"],
                      "embed_dim": fcfg["embed_dim"]},
        "preprocessing": prep,
        "uncertainty": {"temperature": T, "ood_score": metric, "ood_threshold": threshold, "tpr": cfg.calibration.tpr},
        "model": {
            "config": fcfg, "weights": "model.safetensors", "inputs": ["pixel_values", "input_ids", "attention_mask"],
            "output": "logits", "shape": "(B, M, L)",
            "image_encoder": {"inputs": ["pixel_values"], "output": "image_embeds", "shape": "(B, M, D)"},
            "text_encoder": {"inputs": ["input_ids", "attention_mask"], "output": "text_embeds", "shape": "(L, M, D)"},
        },
        "exports": exports,
        "precision": precision,
        "metrics": metrics_summary,
        "data": data.splits,
        "build": {"config": cfg.to_dict(), "timings_s": timer.times, "torch": torch.__version__,
                  "machine": platform.platform(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    write_manifest(out, manifest)
    log.info("artifact written to %s", out)
    return out


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
    import argparse

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
