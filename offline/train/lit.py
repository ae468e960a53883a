"""LiT (locked-text tuning, Zhai et al. 2022) zero-shot model trained here: the real CLIP stand-in.

No CLIP weights install from the package registries, so the zero-shot family's real model is
built the locked-text way: an OpenCLIP ``CustomTextCLIP`` whose text tower is the packaged,
pretrained all-MiniLM-L6-v2 (open_clip's Hugging Face text tower: ``hf_model_name`` = the local
folder, mean pooling, no projection, so text embeddings are MiniLM's own sentence embeddings)
kept frozen, and whose image tower, an open_clip ``VisionTransformer``, is trained
contrastively on Fashion-MNIST captions (``"A photo of a {label}."`` and a few paraphrases).

Loss: the image-to-text half of the CLIP loss over the de-duplicated captions of the batch's
template: every image is pulled to its class caption and pushed from the other classes'
captions (with a dozen distinct captions, the text-to-image half would treat same-class images
as negatives). The text tower being frozen, the caption embeddings are computed once.

The model is an ordinary OpenCLIP model: :func:`save_openclip` writes its state dict and
model config so that ``open_clip.create_model(name, pretrained=file)`` loads it back. It is made by
:mod:`offline.models.loaders` (:func:`lit_model_config`, :func:`make_lit_model`, :func:`init_image_tower`,
:func:`load_tokenizer`, importable from here too).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from offline.data import Data, Split
from offline.families.attention import SlicedMultiheadAttention
from offline.models.loaders import init_image_tower, lit_model_config, load_tokenizer, make_lit_model
from offline.train import TrainConfig, accuracy, fit, images_to_tensor, recorded

log = logging.getLogger("hydra.lit")

TEMPLATE = "A photo of a {label}."  # the zero-shot prompt (the paper's, after CLIP)
TRAIN_TEMPLATES = (  # paraphrases seen in training, so the image tower matches the sentence, not one string
    TEMPLATE,
    "a photo of the {label}.",
    "a black and white photo of a {label}.",
    "a low resolution photo of a {label}.",
    "a picture of a {label}.",
    "an image of a {label}.",
    "{label}",
)
MAX_LOGIT_SCALE = math.log(100.0)  # CLIP's clamp of the learnt temperature
LIT_TRAIN_LOG_ATTR = "_hydra_lit_log"

LIT_PRESETS: dict[str, dict[str, Any]] = {
    # 28x28 inputs, 7x7 patches (17 tokens): fast enough for a build under 5 minutes on 2 cores.
    # head_width 32 = MiniLM's head width, so both towers' heads are scored jointly.
    "lit_fast": {
        "vision": {"image_size": 28, "patch_size": 7, "width": 128, "layers": 4, "head_width": 32, "mlp_ratio": 2.0},
        "train": {
            "steps": 200,
            "batch_size": 128,
            "lr": 2e-3,
            "weight_decay": 0.05,
            "warmup_frac": 0.05,
            "label_smoothing": 0.0,
            "grad_clip": 1.0,
            "hflip": True,
        },
    },
    # the image tower of the pretrained Fashion backbone (offline.train.pretrain; base.image_init): timm's ViT layout
    # (no ln_pre, LayerNorm eps 1e-6), 4x4 patches, 6 layers of 6 heads of 32; a short LiT run aligns it to the text
    "lit_backbone": {
        "vision": {
            "image_size": 28,
            "patch_size": 4,
            "width": 192,
            "layers": 6,
            "head_width": 32,
            "mlp_ratio": 4.0,
            "no_ln_pre": True,
            "norm_kwargs": {"eps": 1e-6},
        },
        "train": {
            "steps": 120,
            "batch_size": 128,
            "lr": 5e-4,
            "weight_decay": 0.05,
            "warmup_frac": 0.1,
            "label_smoothing": 0.0,
            "grad_clip": 1.0,
            "hflip": True,
        },
    },
    "lit_full": {
        "vision": {"image_size": 28, "patch_size": 4, "width": 192, "layers": 6, "head_width": 32, "mlp_ratio": 2.0},
        "train": {
            "steps": 3000,
            "batch_size": 128,
            "lr": 1.5e-3,
            "weight_decay": 0.05,
            "warmup_frac": 0.05,
            "label_smoothing": 0.0,
            "grad_clip": 1.0,
            "hflip": True,
        },
    },
}


def prompts(class_names: Sequence[str], template: str = TEMPLATE) -> list[str]:
    return [template.format(label=c) for c in class_names]


def tokenize_prompts(
    tokenizer: Any, texts: Sequence[str], max_length: int = 32, padding: str = "longest"
) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask"}`` int64 ``(L, T)``, padded to the longest (or ``"max_length"``)."""
    enc = tokenizer(list(texts), padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}


@torch.no_grad()
def caption_features(
    model: nn.Module, tokenizer: Any, class_names: Sequence[str], templates: Sequence[str], max_length: int = 32
) -> torch.Tensor:
    """Normalised frozen-text embeddings of every (template, class) caption: ``(n_templates, C, D)``."""
    model.eval()
    feats = [
        model.encode_text(tokenize_prompts(tokenizer, prompts(class_names, t), max_length)["input_ids"], normalize=True)
        for t in templates
    ]
    return torch.stack(feats)


class _LockedTextLoss(nn.Module):
    """The trainable part (image tower + logit scale) with the frozen caption embeddings; logits ``(B, C)``."""

    def __init__(self, clip: nn.Module, text: torch.Tensor) -> None:
        super().__init__()
        self.visual = clip.visual
        self.logit_scale = clip.logit_scale
        self.register_buffer("text", text)  # (n_templates, C, D), normalised

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        img = F.normalize(self.visual(batch["pixel_values"]), dim=-1)  # (B, D)
        txt = self.text[batch["template"]]  # (B, C, D): each image against its template's captions
        scale = self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()
        return scale * torch.einsum("bd,bcd->bc", img, txt)


def pixel_batch(
    images: np.ndarray | Sequence[str],
    mean: Sequence[float],
    std: Sequence[float],
    size: Sequence[int],
    channels: int = 3,
) -> torch.Tensor:
    """uint8 ``(B, H, W)`` (or image files) -> normalised float ``(B, channels, H', W')`` (gray replicated, as an RGB
    server sends)."""
    return images_to_tensor(images, mean, std, size, channels)


def _caption_batcher(
    train: Split, tcfg: TrainConfig, prep: dict[str, Any], n_templates: int
) -> Callable[[np.ndarray, int], tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """A training step's images (flipped per ``tcfg.hflip``) with a caption template each, and their labels, as a
    function of the example indices and the step."""
    x_tr, y_tr = train.inputs, np.asarray(train.labels, dtype=np.int64)
    size, mean, std, ch = prep["size"], prep["mean"], prep["std"], prep.get("channels", 3)

    def get_batch(idx: np.ndarray, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(tcfg.seed * 7_919 + step + 1)
        chunk = [x_tr[i] for i in idx] if isinstance(x_tr, list) else x_tr[idx]  # arrays, or a user's image files
        x = pixel_batch(chunk, mean, std, size, ch)  # (B, C, H, W)
        if tcfg.hflip:
            flip = torch.rand(len(idx), generator=g) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        template = torch.randint(n_templates, (len(idx),), generator=g)
        return {"pixel_values": x, "template": template}, torch.as_tensor(y_tr[idx])

    return get_batch


def _fit_image_tower(model: nn.Module, head: _LockedTextLoss, get_batch: Any, n: int, tcfg: TrainConfig) -> list[float]:
    """:func:`fit` of ``head`` (``model``'s image tower and logit scale) on ``n`` examples; the losses.

    nn.MultiheadAttention's training path copies q/k/v around; the same weights in this project's
    self-attention train about a quarter faster. The open_clip modules are put back afterwards, trained.
    """
    blocks = model.visual.transformer.resblocks
    originals = [blk.attn for blk in blocks]
    for blk in blocks:
        blk.attn = SlicedMultiheadAttention.from_attention(blk.attn, range(blk.attn.num_heads))
    try:
        return fit(head, lambda m, b: m(b), get_batch, n, tcfg, desc="LiT image tower")
    finally:
        with torch.no_grad():
            for blk, mha in zip(blocks, originals, strict=True):
                for name, p in blk.attn.named_parameters():
                    mha.get_parameter(name).copy_(p)
                blk.attn = mha


def train_lit(
    model: nn.Module,
    tokenizer: Any,
    data: Data,
    tcfg: TrainConfig,
    prep: dict[str, Any],
    templates: Sequence[str] = TRAIN_TEMPLATES,
    max_length: int = 32,
) -> nn.Module:
    """Train ``model``'s image tower (and logit scale) in place against its frozen text tower; eval mode.

    Args:
        model: a LiT ``CustomTextCLIP`` (:func:`make_lit_model`).
        data: ``class_names`` (label order; captions are ``template.format(label=name)``), ``train``: uint8 images
            ``(N, H, W)`` (or image files) and int64 labels ``(N,)``, ``val``: the same for validation.
        prep: ``mean``, ``std`` (per channel), ``size`` [H, W], ``channels`` of the image tower input.

    Records ``{"val_zero_shot_accuracy", "final_loss", "seconds", ...}`` on the model (``_hydra_lit_log``).
    """
    t0 = time.perf_counter()
    text = caption_features(model, tokenizer, data.class_names, templates, max_length)  # (nT, C, D)
    head = _LockedTextLoss(model, text)
    get_batch = _caption_batcher(data.train, tcfg, prep, len(templates))
    losses = _fit_image_tower(model, head, get_batch, len(data.train.labels), tcfg)
    with torch.no_grad():
        model.logit_scale.clamp_(max=MAX_LOGIT_SCALE)
    model.eval()
    acc = zero_shot_accuracy(model, tokenizer, data.class_names, data.val, prep, max_length=max_length)
    info = {
        "val_zero_shot_accuracy": acc,
        "val_examples": len(data.val.labels),
        "final_loss": float(np.mean(losses[-20:])),
        "steps_run": len(losses),
        "seconds": round(time.perf_counter() - t0, 1),
        "logit_scale": float(model.logit_scale.detach().exp()),
        "templates": list(templates),
        "train": recorded(tcfg),
    }
    setattr(model, LIT_TRAIN_LOG_ATTR, info)
    log.info(
        "LiT: zero-shot val accuracy %.4f (%d steps, %.1f s, logit scale %.1f)",
        acc,
        len(losses),
        info["seconds"],
        info["logit_scale"],
    )
    return model


@torch.inference_mode()
def zero_shot_accuracy(
    model: nn.Module,
    tokenizer: Any,
    class_names: Sequence[str],
    val: Split,
    prep: dict[str, Any],
    template: str = TEMPLATE,
    max_length: int = 32,
    batch_size: int = 256,
) -> float:
    """Top-1 zero-shot accuracy of ``model`` with prompts ``template`` on ``val``: uint8 images ``(N, H, W)`` and
    their labels."""
    images, labels = val.inputs, val.labels
    if len(labels) == 0:
        return float("nan")
    ids = tokenize_prompts(tokenizer, prompts(class_names, template), max_length)["input_ids"]
    text = model.encode_text(ids, normalize=True)  # (C, D)
    mean, std, size, ch = prep["mean"], prep["std"], prep["size"], prep.get("channels", 3)
    batches = [
        (
            {"pixel_values": pixel_batch(images[i : i + batch_size], mean, std, size, ch)},
            torch.as_tensor(np.asarray(labels[i : i + batch_size], dtype=np.int64)),
        )
        for i in range(0, len(labels), batch_size)
    ]
    return accuracy(model, lambda m, b: m.encode_image(b["pixel_values"], normalize=True) @ text.T, batches)


def save_openclip(model: nn.Module, model_cfg: dict[str, Any], folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.json`` (open_clip model config) and ``<name>.safetensors`` (state dict) into ``folder``.

    ``open_clip.add_model_config(folder / f"{name}.json")`` then
    ``open_clip.create_model(name, pretrained=str(folder / f"{name}.safetensors"))`` loads it back.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg_path, w_path = folder / f"{name}.json", folder / f"{name}.safetensors"
    cfg_path.write_text(json.dumps(model_cfg, indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(w_path))
    return cfg_path, w_path


__all__ = [
    "LIT_PRESETS",
    "TEMPLATE",
    "TRAIN_TEMPLATES",
    "caption_features",
    "init_image_tower",
    "lit_model_config",
    "load_tokenizer",
    "make_lit_model",
    "pixel_batch",
    "prompts",
    "save_openclip",
    "tokenize_prompts",
    "train_lit",
    "zero_shot_accuracy",
]
