"""The optimisation recipe: AdamW (or SGD) with weight decay on the matrices only, and the learning-rate schedule
(linear warm-up, then cosine decay)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from offline.train.presets import TrainConfig


def lr_factor(step: int, steps: int, warmup_frac: float, min_lr_frac: float = 0.0) -> float:
    """Multiplier of the peak lr at 0-based ``step``: linear warm-up, then cosine decay to ``min_lr_frac``."""
    warm = int(round(warmup_frac * steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_optimizer(model: nn.Module, names: Sequence[str], tcfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of the parameters ``names`` of ``model``: biases, norms, positions and the class token
    without weight decay."""
    params = dict(model.named_parameters())
    no_decay = [params[n] for n in names if params[n].dim() <= 1 or n.endswith(("pos_embed", "cls_token"))]
    decay = [params[n] for n in names if not (params[n].dim() <= 1 or n.endswith(("pos_embed", "cls_token")))]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if tcfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=tcfg.lr, momentum=tcfg.momentum, nesterov=tcfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=tcfg.betas)


def make_scheduler(opt: torch.optim.Optimizer, tcfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """``opt``'s learning rate per step: :func:`lr_factor` of the peak."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, tcfg.steps, tcfg.warmup_frac, tcfg.min_lr_frac)
    )
