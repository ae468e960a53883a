"""The training runs of a build, over :func:`offline.train.loop.fit`: a base ViT trained here from scratch, a timm
classifier or a BERT fine-tuned, a pruned member fine-tuned. Each returns its model in eval mode with its results
recorded on it (:data:`TRAIN_LOG_ATTR`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from offline.data import Data, Split
from offline.families.vit import check_supported
from offline.train.batches import Batch, data_batcher, val_batches
from offline.train.loop import Forward, Resume, accuracy, fit
from offline.train.presets import GRAY_MEAN, GRAY_STD, TrainConfig

log = logging.getLogger("hydra.train")

TRAIN_LOG_ATTR = "_hydra_train_log"  # dict of training results (val accuracy, loss, seconds) set on trained models


def _record(model: nn.Module, desc: str, losses: list[float], acc: float | None, n_val: int, t0: float) -> None:
    """Set the run's results on ``model`` (:data:`TRAIN_LOG_ATTR`) and log its validation accuracy."""
    info = {
        "val_accuracy": acc,
        "val_examples": n_val,
        "final_loss": float(np.mean(losses[-20:])) if losses else None,
        "steps_run": len(losses),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    setattr(model, TRAIN_LOG_ATTR, info)
    if acc is not None:
        log.info(
            "%s: val accuracy %.4f on %d examples (%d steps, %.1f s)", desc, acc, n_val, len(losses), info["seconds"]
        )


def _validate(
    model: nn.Module, forward: Forward, val: Split, prep: dict[str, Any], tok: Any, tcfg: TrainConfig
) -> tuple[float | None, int]:
    """The end-of-training accuracy on the first ``tcfg.max_eval`` examples of ``val`` (None without any)."""
    batches, n_val = val_batches(val.inputs, val.labels, prep, tok, tcfg)
    return (accuracy(model, forward, batches) if n_val else None), n_val


def vit_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Logits ``(B, C)`` of a timm image classifier."""
    return model(batch["pixel_values"])


def hf_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Logits ``(B, C)`` of a Hugging Face sequence classifier."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def train_base_vit(
    train: Split,
    val: Split,
    arch: dict[str, Any],
    tcfg: TrainConfig,
    mean: Sequence[float] = GRAY_MEAN,
    std: Sequence[float] = GRAY_STD,
    checkpoint_dir: Path | None = None,
) -> nn.Module:
    """Train a timm ``VisionTransformer(**arch)`` from scratch on uint8 images ``(N, H, W)``; returned in eval mode.

    ``train`` / ``val``: the images and labels to train and validate on. Inputs are normalised with ``mean`` /
    ``std`` and resized / channel-replicated to ``arch``'s ``img_size`` / ``in_chans``; the model must be one Hydra
    can fuse (class token, plain blocks). With ``checkpoint_dir`` the run is resumable, as in :func:`fit`.
    """
    t0 = time.perf_counter()
    torch.manual_seed(tcfg.seed)
    model = VisionTransformer(**arch)
    check_supported(model)
    img = arch.get("img_size", 224)
    prep = {
        "type": "image",
        "mean": list(mean),
        "std": list(std),
        "size": [img, img] if isinstance(img, int) else img,
        "channels": arch.get("in_chans", 3),
    }
    y = np.asarray(train.labels, dtype=np.int64)
    key = {"arch": arch, "mean": list(mean), "std": list(std)}
    resume = Resume(checkpoint_dir, key) if checkpoint_dir is not None else None
    losses = fit(model, vit_forward, data_batcher(train.inputs, y, prep, None, tcfg), len(y), tcfg, "base ViT", resume)
    acc, n_val = _validate(model, vit_forward, val, prep, None, tcfg)
    _record(model, "base ViT", losses, acc, n_val, t0)
    return model.eval()


def train_classifier_on_arrays(
    model: nn.Module,
    data: Data,
    prep: dict[str, Any],
    tcfg: TrainConfig,
    checkpoint_dir: Path | None = None,
    checkpoint_key: Any = None,
) -> nn.Module:
    """Fine-tune a timm image classifier (e.g. pretrained with a new head) on ``data`` preprocessed per ``prep``.

    ``prep``: ``size`` [H, W], ``mean`` / ``std`` per channel, ``channels``; ``tcfg.unfreeze`` picks what trains
    (``"head"`` for a linear probe). With ``checkpoint_dir`` the run is resumable (and a finished one reloads at
    once); ``checkpoint_key``: what else determines it (the checkpoint file's hash).
    """
    t0 = time.perf_counter()
    prep = {**prep, "type": "image"}
    y = np.asarray(data.train.labels, dtype=np.int64)
    resume = Resume(checkpoint_dir, checkpoint_key) if checkpoint_dir is not None else None
    get = data_batcher(data.train.inputs, y, prep, None, tcfg)
    losses = fit(model, vit_forward, get, len(y), tcfg, "classifier", resume)
    acc, n_val = _validate(model, vit_forward, data.val, prep, None, tcfg)
    _record(model, "classifier", losses, acc, n_val, t0)
    return model.eval()


def finetune_bert(
    model: nn.Module,
    tok: Any,
    train: Split,
    val: Split,
    tcfg: TrainConfig,
    max_length: int,
    checkpoint_dir: Path | None = None,
) -> nn.Module:
    """Fine-tune a ``BertForSequenceClassification`` on texts (tokenised to ``max_length``); logs val accuracy.

    ``train`` / ``val``: the texts and labels to train and validate on. With ``checkpoint_dir`` the run is
    resumable (and a finished run is reused) as in :func:`fit`."""
    t0 = time.perf_counter()
    prep = {"type": "text", "max_length": max_length}
    y = np.asarray(train.labels, dtype=np.int64)
    key = {
        "max_length": max_length,
        "model": type(model).__name__,
        "config": model.config.to_json_string() if hasattr(model, "config") else None,
    }
    resume = Resume(checkpoint_dir, key) if checkpoint_dir is not None else None
    get = data_batcher(list(train.inputs), y, prep, tok, tcfg)
    losses = fit(model, hf_forward, get, len(y), tcfg, "fine-tune", resume)
    acc, n_val = _validate(model, hf_forward, Split(list(val.inputs), val.labels), prep, tok, tcfg)
    _record(model, "fine-tune", losses, acc, n_val, t0)
    return model.eval()


def finetune_member(
    adapter: Any,
    member: nn.Module,
    data: Data,
    prep: dict[str, Any],
    tok: Any,
    tcfg: TrainConfig,
    resume: Resume,
    desc: str,
    teacher: nn.Module | None = None,
) -> nn.Module:
    """Fine-tune one structurally pruned member in place (``tcfg.unfreeze`` and ``tcfg.last_blocks`` pick what
    trains); resumable; with ``teacher`` (the unpruned base) and ``tcfg.distill_weight`` it distils from it.

    Batches come from ``data.train`` preprocessed per ``prep``; logits from ``adapter.forward``. A
    checkpoint (weights as safetensors; optimizer, scheduler, step and RNG with ``torch.save``) is
    written to ``resume.folder`` every ``tcfg.checkpoint_every`` steps; a restarted run resumes from
    the last one made with the same config, data size and kept heads, and ``resume.key``: more of what
    determines the run (e.g. its data recipe).
    """
    t0 = time.perf_counter()
    fwd: Forward = adapter.forward
    y = np.asarray(data.train.labels, dtype=np.int64)
    get = data_batcher(data.train.inputs, y, prep, tok, tcfg)
    key = {"family": adapter.name, "heads": adapter.kept_heads(member), **(resume.key or {})}
    losses = fit(member, fwd, get, len(y), tcfg, desc, Resume(Path(resume.folder), key), teacher)
    acc, n_val = _validate(member, fwd, data.val, prep, tok, tcfg)
    _record(member, desc, losses, acc, n_val, t0)
    return member.eval()
