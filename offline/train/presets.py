"""The training recipe: :class:`TrainConfig` (one run) and the presets the builds name (``base.preset``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline.train.parts import unfreeze_parts

# Fashion-MNIST pixel statistics: the normalisation of the ViT trained here (same values as the pipeline's prep).
GRAY_MEAN, GRAY_STD = (0.2860,), (0.3530,)


def _vit_preset(embed_dim: int, depth: int, train: tuple[int, float], finetune: tuple[int, float]) -> dict[str, Any]:
    """A small ViT trained here on 28x28 grayscale: the presets differ only in width, depth and ``(steps, lr)``."""
    return {
        # 6 heads so that pruning 2 per layer keeps 4 (2/3)
        "arch": {
            "img_size": 28,
            "patch_size": 4,
            "in_chans": 1,
            "embed_dim": embed_dim,
            "depth": depth,
            "num_heads": 6,
            "mlp_ratio": 2.0,
            "class_token": True,
            "global_pool": "token",
        },
        "train": _vit_run(steps=train[0], lr=train[1], warmup_frac=0.05),
        "finetune": _vit_run(steps=finetune[0], lr=finetune[1], warmup_frac=0.1, unfreeze="attention+mlp+norm+head"),
    }


def _vit_run(steps: int, lr: float, warmup_frac: float, **extra: Any) -> dict[str, Any]:
    """A run of a ViT on images: the image presets differ only in these and in ``extra`` (crops, unfreezing)."""
    return {
        "steps": steps,
        "batch_size": 128,
        "lr": lr,
        "weight_decay": 0.05,
        "warmup_frac": warmup_frac,
        "label_smoothing": 0.1,
        "grad_clip": 1.0,
        "hflip": True,
        **extra,
    }


def _bert_run(steps: int, batch_size: int, lr: float, warmup_frac: float) -> dict[str, Any]:
    """A MiniLM run: the text presets differ only in these; the word embeddings stay frozen."""
    return {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "weight_decay": 0.01,
        "warmup_frac": warmup_frac,
        "label_smoothing": 0.0,
        "grad_clip": 1.0,
        "unfreeze": "attention+mlp+norm+head",
    }


PRESETS: dict[str, dict[str, Any]] = {
    # small ViTs trained here: (steps, peak lr) of training from scratch and of member fine-tuning
    "vit_fast": _vit_preset(embed_dim=96, depth=4, train=(500, 2e-3), finetune=(100, 3e-4)),
    "vit_full": _vit_preset(embed_dim=144, depth=6, train=(2400, 1.5e-3), finetune=(500, 2e-4)),
    # a pretrained image backbone (offline.train.pretrain, or a user's checkpoint of the same domain) fine-tuned:
    # short, at a low learning rate, with the same flips and milder crops than pretraining; members as the presets above
    "vit_pretrained": {
        "train": _vit_run(steps=150, lr=2e-4, warmup_frac=0.1, crop_scale=0.6),
        "finetune": _vit_run(steps=60, lr=2e-4, warmup_frac=0.1, unfreeze="attention+mlp+norm+head"),
    },
    # MiniLM (all-MiniLM-L6-v2) fine-tuned for tweet sentiment; the word embeddings stay frozen: on CPU their
    # dense gradient and AdamW update (11.7M parameters) cost about a third of each step
    "bert_fast": {
        "train": _bert_run(steps=80, batch_size=32, lr=1e-4, warmup_frac=0.1),
        "finetune": _bert_run(steps=60, batch_size=12, lr=5e-5, warmup_frac=0.1),
    },
    "bert_full": {
        "train": _bert_run(steps=1200, batch_size=32, lr=5e-5, warmup_frac=0.06),
        "finetune": _bert_run(steps=400, batch_size=32, lr=3e-5, warmup_frac=0.1),
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
    # knowledge distillation (fit's teacher): the loss is (1 - w) * CE(labels) + w * T^2 * KL(teacher_T || model_T)
    # with softmaxes at temperature T (Hinton et al. 2015); w = 0 trains on the labels alone
    distill_weight: float = 0.0
    distill_temperature: float = 1.0
    grad_clip: float | None = 1.0  # max global gradient norm (None = no clipping)
    seed: int = 0  # seeds the initialisation, dropout and the batch order
    unfreeze: str = "all"  # parts that train: "all" or "+"-joined attention, mlp, norm, head, embed
    last_blocks: int = 0  # only the last N transformer blocks train (with the final norm and head); 0 = every block
    train_params: tuple[str, ...] = ()  # the parameters that train, by name (an adapter's); empty: unfreeze's parts
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
        if not 0 <= self.distill_weight <= 1 or self.distill_temperature <= 0:
            raise ValueError(
                f"distill_weight must be in [0, 1] and distill_temperature > 0, got {self.distill_weight} and "
                f"{self.distill_temperature}"
            )
        if self.last_blocks < 0:
            raise ValueError(f"last_blocks must be >= 0, got {self.last_blocks}")
        self.betas = tuple(self.betas)
        unfreeze_parts(self.unfreeze)  # validates
