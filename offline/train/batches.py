"""Model batches: images (arrays or files) and texts as the tensors a model takes, in order or per training step.

Image arrays are normalised here (:func:`images_to_tensor`); image files go through the server's own
preprocessing (:func:`offline.train.decode.files_to_tensor`); texts through the model's tokenizer. A training
step's batch is a function of ``(seed, step)`` only (:func:`data_batcher`, with :mod:`offline.train.augment`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from offline.train.augment import crop, flip
from offline.train.decode import files_to_tensor
from offline.train.presets import TrainConfig

Batch = dict[str, torch.Tensor]
Labelled = tuple[Batch, torch.Tensor]  # a model batch and its int64 labels (B,)
GetBatch = Callable[[np.ndarray, int], Labelled]  # (example indices, step) -> that step's labelled batch

IMAGE_KEYS = ("mean", "std", "size", "channels", "resize", "crop_pct", "interpolation")


def images_to_tensor(
    images: np.ndarray | Sequence[str],
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    size: Sequence[int] | int | None = None,
    channels: int | None = None,
    **spec: Any,
) -> torch.Tensor:
    """uint8 ``(B, H, W)`` or ``(B, H, W, 3)`` -> float32 ``(B, C, H', W')`` with ``x = (u8/255 - mean) / std``.

    Gray is replicated to ``channels`` (RGB is reduced to luminance for ``channels=1``); the image is
    resized (bilinear) to ``size`` when it differs; ``mean`` / ``std`` have one value or one per channel.
    A list of image files goes through :func:`files_to_tensor` instead (``spec``: ``resize``, ``crop_pct``,
    ``interpolation`` of the artifact's preprocessing).
    """
    if not isinstance(images, np.ndarray) and len(images) and isinstance(images[0], (str, Path)):
        hw = [size, size] if isinstance(size, int) else list(size or [])
        full = {"size": hw, "mean": list(mean or [0.0]), "std": list(std or [1.0]), "channels": channels or 3}
        return files_to_tensor(images, {**full, **{k: v for k, v in spec.items() if v is not None}})
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    if x.dim() == 3:
        x = x.unsqueeze(1)  # (B, 1, H, W)
    elif x.dim() == 4 and x.shape[-1] in (1, 3):
        x = x.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)
    else:
        raise ValueError(f"images must be uint8 (B, H, W) or (B, H, W, 3), got shape {tuple(images.shape)}")
    x = _to_channels(x, channels)
    if size is not None:
        hw = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
        if tuple(x.shape[-2:]) != hw:
            shrink = hw[0] < x.shape[-2] or hw[1] < x.shape[-1]
            x = F.interpolate(x, size=hw, mode="bilinear", align_corners=False, antialias=shrink)
    if mean is not None or std is not None:
        c = x.shape[1]
        m = torch.tensor(list(mean if mean is not None else [0.0]), dtype=torch.float32)
        s = torch.tensor(list(std if std is not None else [1.0]), dtype=torch.float32)
        if m.numel() not in (1, c) or s.numel() not in (1, c):
            raise ValueError(f"mean/std give {m.numel()}/{s.numel()} values for {c}-channel images")
        x = (x - m.view(1, -1, 1, 1)) / s.view(1, -1, 1, 1)
    return x.contiguous()


def _to_channels(x: torch.Tensor, channels: int | None) -> torch.Tensor:
    """``x`` ``(B, C, H, W)`` with ``channels`` channels: gray replicated, RGB reduced to luminance (None: as is)."""
    if channels is None or x.shape[1] == channels:
        return x
    if x.shape[1] == 1:
        return x.expand(-1, channels, -1, -1)  # (B, C, H, W), gray replicated
    if channels == 1:
        w = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)  # ITU-R 601 luma, as Pillow's "L"
        return (x * w).sum(1, keepdim=True)  # (B, 1, H, W)
    raise ValueError(f"cannot convert {x.shape[1]}-channel images to {channels} channels")


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int | None) -> Batch:
    """Texts -> ``{"input_ids", "attention_mask"}`` int64 ``(B, T)``, padded to the longest, truncated to max_length."""
    enc = tokenizer(list(texts), padding="longest", truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}


def make_batches(
    inputs: np.ndarray | Sequence[str],
    labels: np.ndarray | Sequence[int],
    batch_size: int,
    kind: str,
    tokenizer: Any = None,
    max_length: int | None = None,
    **image: Any,
) -> list[Labelled]:
    """Inputs in order (no shuffling) as model batches and int64 labels ``(B,)``.

    ``kind="image"``: ``{"pixel_values": float32 (B, C, H, W)}``; ``image``: the preprocessing keywords of
    :func:`images_to_tensor` (``mean``, ``std``, ``size``, ``channels``; for image files also ``resize``,
    ``crop_pct``, ``interpolation``: :func:`image_kw` of an artifact's preprocessing).
    ``kind="text"``: ``{"input_ids", "attention_mask"}`` int64 ``(B, T)`` (needs ``tokenizer``).
    """
    if kind not in ("image", "text"):
        raise ValueError(f"kind must be 'image' or 'text', got {kind!r}")
    if kind == "text" and tokenizer is None:
        raise ValueError("text batches need a tokenizer")
    n = len(labels)
    if len(inputs) != n:
        raise ValueError(f"{len(inputs)} inputs but {n} labels")
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    out = []
    for i in range(0, n, batch_size):
        chunk = inputs[i : i + batch_size]
        if kind == "image":
            images = chunk if isinstance(chunk, list) else np.asarray(chunk)
            batch = {"pixel_values": images_to_tensor(images, **image)}
        else:
            batch = tokenize(tokenizer, chunk, max_length)
        out.append((batch, y_all[i : i + batch_size]))
    return out


def image_kw(prep: dict[str, Any]) -> dict[str, Any]:
    """The image keywords of :func:`make_batches` from an artifact's ``preprocessing``."""
    return {k: prep.get(k) for k in IMAGE_KEYS}


def data_batcher(
    inputs: np.ndarray | list[str], labels: np.ndarray, prep: dict[str, Any], tok: Any, tcfg: TrainConfig
) -> GetBatch:
    """A training step's batch of ``inputs`` preprocessed per ``prep``, augmented per ``tcfg`` (images: crops, then
    flips), as a function of the example indices and the step."""
    kind = prep["type"]

    def get(idx: np.ndarray, step: int) -> Labelled:
        x = [inputs[i] for i in idx] if isinstance(inputs, list) else inputs[idx]
        ((batch, y),) = make_batches(
            x, labels[idx], len(idx), kind, tokenizer=tok, max_length=prep.get("max_length"), **image_kw(prep)
        )
        if kind == "image" and tcfg.crop_scale < 1:
            batch = crop(batch, step, tcfg.seed, tcfg.crop_scale)
        if kind == "image" and tcfg.hflip:
            batch = flip(batch, step, tcfg.seed)
        return batch, y

    return get


def val_batches(
    inputs: np.ndarray | Sequence[str], labels: Any, prep: dict[str, Any], tok: Any, tcfg: TrainConfig
) -> tuple[list[Labelled], int]:
    """The first ``tcfg.max_eval`` validation examples as batches for the end-of-training accuracy, and their count."""
    n = min(tcfg.max_eval, len(labels))
    x = inputs[:n] if not isinstance(inputs, list) else list(inputs[:n])
    batches = make_batches(
        x,
        np.asarray(labels)[:n],
        tcfg.eval_batch_size,
        prep["type"],
        tokenizer=tok,
        max_length=prep.get("max_length"),
        **image_kw(prep),
    )
    return batches, n
