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
model config so that ``open_clip.create_model(name, pretrained=file)`` loads it back.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .families.clip import SlicedMultiheadAttention
from .train import TrainConfig, accuracy, fit, images_to_tensor, minilm_path

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
        "vision": {"image_size": 28, "patch_size": 7, "width": 128, "layers": 4, "head_width": 32,
                   "mlp_ratio": 2.0},
        "train": {"steps": 200, "batch_size": 128, "lr": 2e-3, "weight_decay": 0.05, "warmup_frac": 0.05,
                  "label_smoothing": 0.0, "grad_clip": 1.0, "hflip": True},
    },
    # the image tower of the pretrained Fashion backbone (offline.pretrain; base.image_init): timm's ViT layout
    # (no ln_pre, LayerNorm eps 1e-6), 4x4 patches, 6 layers of 6 heads of 32; a short LiT run aligns it to the text
    "lit_backbone": {
        "vision": {"image_size": 28, "patch_size": 4, "width": 192, "layers": 6, "head_width": 32,
                   "mlp_ratio": 4.0, "no_ln_pre": True, "norm_kwargs": {"eps": 1e-6}},
        "train": {"steps": 120, "batch_size": 128, "lr": 5e-4, "weight_decay": 0.05, "warmup_frac": 0.1,
                  "label_smoothing": 0.0, "grad_clip": 1.0, "hflip": True},
    },
    "lit_full": {
        "vision": {"image_size": 28, "patch_size": 4, "width": 192, "layers": 6, "head_width": 32,
                   "mlp_ratio": 2.0},
        "train": {"steps": 3000, "batch_size": 128, "lr": 1.5e-3, "weight_decay": 0.05, "warmup_frac": 0.05,
                  "label_smoothing": 0.0, "grad_clip": 1.0, "hflip": True},
    },
}


def lit_model_config(
    vision: dict[str, Any],
    text_path: str | None = None,
    pooler: str = "mean_pooler",
    proj: str | None = None,
    embed_dim: int | None = None,
) -> dict[str, Any]:
    """An OpenCLIP model config (the JSON open_clip keeps per architecture) for a LiT ``CustomTextCLIP``.

    ``vision``: ``CLIPVisionCfg`` fields; ``text_path``: a local Hugging Face BERT folder (default:
    the packaged MiniLM); ``proj=None`` keeps the text tower's own embedding space, which needs
    ``embed_dim`` = the text width (filled in from the folder's config).
    """
    text_path = str(text_path or minilm_path())
    if embed_dim is None:
        embed_dim = int(json.loads((Path(text_path) / "config.json").read_text())["hidden_size"])
    return {
        "embed_dim": embed_dim,
        "custom_text": True,
        "quick_gelu": False,
        "vision_cfg": dict(vision),
        "text_cfg": {
            "hf_model_name": text_path,
            "hf_tokenizer_name": text_path,
            "hf_proj_type": proj,
            "hf_pooler_type": pooler,
            "context_length": 32,
        },
    }


def make_lit_model(model_cfg: dict[str, Any], pretrained_text: bool = True, seed: int = 0) -> nn.Module:
    """The ``CustomTextCLIP`` of ``model_cfg``: pretrained text tower from its local folder, random image tower."""
    from open_clip.model import CustomTextCLIP

    torch.manual_seed(seed)
    cfg = {k: v for k, v in model_cfg.items() if k != "custom_text"}
    text_cfg = {**cfg.pop("text_cfg"), "hf_model_pretrained": pretrained_text}
    try:
        model = CustomTextCLIP(**cfg, text_cfg=text_cfg)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the text tower from {text_cfg['hf_model_name']!r} offline") from e
    return model.eval()


def init_image_tower(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Start ``model``'s image tower (an open_clip ``VisionTransformer``) from a timm ``VisionTransformer``
    checkpoint of the same shape (``offline.pretrain``'s backbone); the embedding projection stays as initialised.

    The mapping is exact for grey images sent as RGB (the LiT tower's input): timm's patch embedding has a bias and
    one input channel, open_clip's none and three, so the weights are split evenly over the three (equal) channels
    and the bias is added to every patch position's embedding; timm's blocks are open_clip's one for one
    (``qkv`` = ``in_proj``, rows q, k, v). The tower must have no ``ln_pre`` and LayerNorm eps 1e-6, as timm's
    ViT (``vision_cfg``: ``no_ln_pre``, ``norm_kwargs``). Every tensor's shape is checked; returns a record.
    """
    from safetensors.torch import load_file

    from service.core.artifact import file_sha256

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"base.image_init {path} is not a file")
    src = {k: v.float() for k, v in load_file(str(path)).items()}
    v = model.visual
    if not isinstance(v.ln_pre, nn.Identity):
        raise ValueError("base.image_init needs a vision tower without ln_pre (vision_cfg no_ln_pre: true)")
    conv = src["patch_embed.proj.weight"]  # (d, c, p, p)
    d, c = conv.shape[:2]
    dst_c = v.conv1.weight.shape[1]
    if c not in (1, dst_c):
        raise ValueError(f"base.image_init has {c} input channels, the tower {dst_c}")
    out: dict[str, torch.Tensor] = {
        "conv1.weight": conv.expand(-1, dst_c, -1, -1) / dst_c if c == 1 else conv,
        "class_embedding": src["cls_token"].reshape(d),
        "positional_embedding": src["pos_embed"].reshape(-1, d).clone(),
        "ln_post.weight": src["norm.weight"], "ln_post.bias": src["norm.bias"],
    }
    out["positional_embedding"][1:] += src.get("patch_embed.proj.bias", torch.zeros(d))  # the bias, per patch
    pairs = {"norm1": "ln_1", "attn.qkv": "attn.in_proj_", "attn.proj": "attn.out_proj", "norm2": "ln_2",
             "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}  # fmt: skip
    for i in range(len(v.transformer.resblocks)):
        for a, b in pairs.items():
            for kind in ("weight", "bias"):
                name = f"{b}{kind}" if b.endswith("_") else f"{b}.{kind}"  # in_proj_weight, ln_1.weight, ...
                out[f"transformer.resblocks.{i}.{name}"] = src[f"blocks.{i}.{a}.{kind}"]
    own = v.state_dict()
    bad = [f"{k} {tuple(t.shape)} vs {tuple(own[k].shape)}" for k, t in out.items() if k not in own or
           t.shape != own[k].shape]  # fmt: skip
    if bad:
        raise ValueError(f"base.image_init {path} does not fit the image tower: {bad[:3]}")
    missing = sorted(set(own) - set(out) - {"proj"})
    if missing:
        raise ValueError(f"base.image_init {path} leaves {missing[:3]} of the image tower unset")
    with torch.no_grad():
        for k, t in out.items():
            own[k].copy_(t)
    return {"path": str(path), "sha256": file_sha256(path), "tensors": len(out)}


def load_tokenizer(model_cfg: dict[str, Any]) -> Any:
    """The Hugging Face tokenizer of the LiT text tower (from its local folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg["text_cfg"]["hf_tokenizer_name"])


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
    feats = [model.encode_text(tokenize_prompts(tokenizer, prompts(class_names, t), max_length)["input_ids"],
                               normalize=True) for t in templates]
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
    images: np.ndarray, mean: Sequence[float], std: Sequence[float], size: Sequence[int], channels: int = 3
) -> torch.Tensor:
    """uint8 ``(B, H, W)`` -> normalised float ``(B, channels, H', W')`` (gray replicated, as an RGB server sends)."""
    return images_to_tensor(images, mean, std, size, channels)


def train_lit(
    model: nn.Module,
    tokenizer: Any,
    class_names: Sequence[str],
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    tcfg: TrainConfig,
    prep: dict[str, Any],
    templates: Sequence[str] = TRAIN_TEMPLATES,
    max_length: int = 32,
) -> nn.Module:
    """Train ``model``'s image tower (and logit scale) in place against its frozen text tower; eval mode.

    Args:
        model: a LiT ``CustomTextCLIP`` (:func:`make_lit_model`).
        class_names: label names, in label order; captions are ``template.format(label=name)``.
        x_tr, y_tr: uint8 images ``(N, H, W)`` and int64 labels ``(N,)``; x_val, y_val: the same for validation.
        prep: ``mean``, ``std`` (per channel), ``size`` [H, W], ``channels`` of the image tower input.

    Records ``{"val_zero_shot_accuracy", "final_loss", "seconds", ...}`` on the model (``_hydra_lit_log``).
    """
    t0 = time.perf_counter()
    text = caption_features(model, tokenizer, class_names, templates, max_length)  # (nT, C, D)
    head = _LockedTextLoss(model, text)
    y_tr = np.asarray(y_tr, dtype=np.int64)
    size, mean, std, ch = prep["size"], prep["mean"], prep["std"], prep.get("channels", 3)

    def get_batch(idx: np.ndarray, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(tcfg.seed * 7_919 + step + 1)
        chunk = [x_tr[i] for i in idx] if isinstance(x_tr, list) else x_tr[idx]  # arrays, or a user's image files
        x = pixel_batch(chunk, mean, std, size, ch)  # (B, C, H, W)
        if tcfg.hflip:
            flip = torch.rand(len(idx), generator=g) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        template = torch.randint(len(templates), (len(idx),), generator=g)
        return {"pixel_values": x, "template": template}, torch.as_tensor(y_tr[idx])

    # nn.MultiheadAttention's training path copies q/k/v around; the same weights in this project's
    # self-attention train about a quarter faster. The open_clip modules are put back afterwards.
    blocks = model.visual.transformer.resblocks
    originals = [blk.attn for blk in blocks]
    for blk in blocks:
        blk.attn = SlicedMultiheadAttention.from_attention(blk.attn, range(blk.attn.num_heads))
    try:
        losses = fit(head, lambda m, b: m(b), get_batch, len(y_tr), tcfg, desc="LiT image tower")
    finally:
        with torch.no_grad():
            for blk, mha in zip(blocks, originals, strict=True):
                for name, p in blk.attn.named_parameters():
                    mha.get_parameter(name).copy_(p)
                blk.attn = mha
    with torch.no_grad():
        model.logit_scale.clamp_(max=MAX_LOGIT_SCALE)
    model.eval()
    acc = zero_shot_accuracy(model, tokenizer, class_names, x_val, y_val, prep, max_length=max_length)
    info = {"val_zero_shot_accuracy": acc, "val_examples": len(y_val), "final_loss": float(np.mean(losses[-20:])),
            "steps_run": len(losses), "seconds": round(time.perf_counter() - t0, 1),
            "logit_scale": float(model.logit_scale.detach().exp()), "templates": list(templates), "train": asdict(tcfg)}
    setattr(model, LIT_TRAIN_LOG_ATTR, info)
    log.info("LiT: zero-shot val accuracy %.4f (%d steps, %.1f s, logit scale %.1f)", acc, len(losses),
             info["seconds"], info["logit_scale"])
    return model


@torch.inference_mode()
def zero_shot_accuracy(
    model: nn.Module,
    tokenizer: Any,
    class_names: Sequence[str],
    images: np.ndarray,
    labels: np.ndarray,
    prep: dict[str, Any],
    template: str = TEMPLATE,
    max_length: int = 32,
    batch_size: int = 256,
) -> float:
    """Top-1 zero-shot accuracy of ``model`` with prompts ``template`` on uint8 images ``(N, H, W)``."""
    if len(labels) == 0:
        return float("nan")
    text = model.encode_text(tokenize_prompts(tokenizer, prompts(class_names, template), max_length)["input_ids"],
                             normalize=True)  # (C, D)
    batches = [({"pixel_values": pixel_batch(images[i : i + batch_size], prep["mean"], prep["std"], prep["size"],
                                             prep.get("channels", 3))},
                torch.as_tensor(np.asarray(labels[i : i + batch_size], dtype=np.int64)))
               for i in range(0, len(labels), batch_size)]
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
