"""The training loop: :func:`fit` trains a model in place, deterministically and resumably.

Batches are drawn without replacement from seeded per-epoch permutations that depend only on ``(seed, step)``
(:func:`batch_indices`), made in order by ``tcfg.workers`` DataLoader processes (:func:`step_batches`), so a
run is a deterministic function of its config; with a :class:`Resume` folder it checkpoints every
``tcfg.checkpoint_every`` steps (:mod:`offline.train.checkpoints`), and a run interrupted at any point resumes from its
last checkpoint to the same final weights as an uninterrupted run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from offline.compute import Compute
from offline.train import checkpoints
from offline.train.batches import Batch, GetBatch, Labelled
from offline.train.parts import trainable_names
from offline.train.presets import TrainConfig
from offline.train.schedule import make_optimizer, make_scheduler
from service.core.progress import bar as progress_bar

Forward = Callable[[nn.Module, Batch], torch.Tensor]  # (model, batch) -> logits (B, C)

# fields added after runs were recorded (distillation, partial fine-tuning), and their defaults
_RECIPE_FIELDS = {"distill_weight": 0.0, "distill_temperature": 1.0, "last_blocks": 0, "train_params": ()}
# fields added after checkpoints existed, and their defaults
_LATER_FIELDS = {"precision": "fp32", "crop_scale": 1.0, **_RECIPE_FIELDS}


@dataclass(frozen=True)
class Resume:
    """Where a resumable run keeps its checkpoints, and what else than its config and data size determines it
    (``key``: the model, its data recipe; a checkpoint made with another key is not resumed)."""

    folder: Path
    key: Any = None


def recorded(tcfg: TrainConfig) -> dict[str, Any]:
    """``tcfg`` as records keep it: every field, but those added later (distillation, partial fine-tuning) only
    when they are set, so the records of runs that predate them still read the same."""
    return {k: v for k, v in vars(tcfg).items() if k not in _RECIPE_FIELDS or v != _RECIPE_FIELDS[k]}


def fingerprint(tcfg: TrainConfig, n: int, extra: Any) -> str:
    """What a checkpoint must match to be resumed: the config fields that change the result, data size, model."""
    cfg = {k: v for k, v in asdict(tcfg).items() if k not in ("progress", "checkpoint_every", "device", "workers")}
    for k, default in _LATER_FIELDS.items():  # at their defaults they change nothing: older checkpoints still match
        if cfg[k] == default:
            del cfg[k]
    return json.dumps({"train": cfg, "n": n, "model": extra}, sort_keys=True, default=str)


# ----------------------------------------------------------------------------- the batches of each step
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

    def __init__(self, get_batch: GetBatch, n: int, tcfg: TrainConfig, start: int) -> None:
        self.get_batch, self.n, self.tcfg, self.start = get_batch, n, tcfg, start

    def __len__(self) -> int:
        return max(0, self.tcfg.steps - self.start)

    def __getitem__(self, k: int) -> Labelled:
        step = self.start + k
        return self.get_batch(batch_indices(self.n, self.tcfg.batch_size, step, self.tcfg.seed), step)


def step_batches(get_batch: GetBatch, n: int, tcfg: TrainConfig, start: int, pin: bool) -> torch.utils.data.DataLoader:
    """The batches of steps ``start..``, in order, made by ``tcfg.workers`` processes (pinned memory for CUDA)."""
    w = tcfg.workers
    # its own generator: the loader's base-seed draw must not advance the global one (dropout; resumed runs)
    return torch.utils.data.DataLoader(
        _Steps(get_batch, n, tcfg, start),
        batch_size=None,
        shuffle=False,
        num_workers=w,
        pin_memory=pin,
        prefetch_factor=2 if w else None,
        generator=torch.Generator().manual_seed(tcfg.seed),
    )


# ----------------------------------------------------------------------------- the loop
@dataclass
class _Optimisation:
    """One run's trainable parameters, optimizer and learning-rate schedule, on ``compute``."""

    compute: Compute
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR

    teacher: nn.Module | None = None  # distillation: its logits on each batch are soft targets

    def step(self, model: nn.Module, forward: Forward, batch: Batch, y: torch.Tensor, tcfg: TrainConfig) -> float:
        """One optimisation step on ``batch`` (labels ``y`` ``(B,)``); its loss."""
        batch = self.compute.batch(batch)
        with self.compute.autocast():
            logits = forward(model, batch)  # (B, C)
        loss = F.cross_entropy(logits.float(), y.to(self.compute.device), label_smoothing=tcfg.label_smoothing)
        if self.teacher is not None and tcfg.distill_weight > 0:
            with torch.no_grad(), self.compute.autocast():
                soft = forward(self.teacher, batch).float()  # (B, C)
            kd = distillation_loss(logits.float(), soft, tcfg.distill_temperature)
            loss = (1 - tcfg.distill_weight) * loss + tcfg.distill_weight * kd
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if tcfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, tcfg.grad_clip)
        self.opt.step()
        self.sched.step()
        return float(loss.detach())


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(logits / T))``, batch mean (Hinton et al. 2015: the ``T^2``
    keeps the gradients' scale as ``T`` changes)."""
    log_p = F.log_softmax(logits / temperature, dim=-1)  # (B, C)
    log_q = F.log_softmax(teacher_logits / temperature, dim=-1)  # (B, C)
    return F.kl_div(log_p, log_q, reduction="batchmean", log_target=True) * temperature**2


def _unfreeze(model: nn.Module, names: Sequence[str]) -> tuple[list[nn.Parameter], dict[str, bool]]:
    """Only the parameters ``names`` of ``model`` require gradients: ``(those parameters, the flags before)``."""
    was_grad = {n_: p.requires_grad for n_, p in model.named_parameters()}
    train_set = set(names)
    for n_, p in model.named_parameters():
        p.requires_grad_(n_ in train_set)
    return [p for n_, p in model.named_parameters() if n_ in train_set], was_grad


def fit(
    model: nn.Module,
    forward: Forward,
    get_batch: GetBatch,
    n: int,
    tcfg: TrainConfig,
    desc: str = "train",
    resume: Resume | None = None,
    teacher: nn.Module | None = None,
) -> list[float]:
    """Train ``model`` in place for ``tcfg.steps`` steps on ``n`` examples; the per-step losses of this run.

    ``get_batch(indices, step)`` gives the model batch and int64 labels ``(B,)`` of those examples;
    ``forward(model, batch)`` the logits ``(B, C)``. Only the parts in ``tcfg.unfreeze`` (of the last
    ``tcfg.last_blocks`` blocks, when set) train, or the parameters ``tcfg.train_params`` names. A ``teacher``
    (not trained) adds distillation from ``forward(teacher, batch)`` when ``tcfg.distill_weight > 0``. With
    ``resume`` the run saves every ``tcfg.checkpoint_every`` steps into ``resume.folder`` and resumes from the
    last checkpoint there whose config, data size and ``resume.key`` match.
    """
    if n < 1:
        raise ValueError(f"{desc}: no training examples")
    torch.manual_seed(tcfg.seed)
    compute = Compute.of(tcfg.device, tcfg.precision)
    model.to(compute.device)
    names = list(tcfg.train_params) or trainable_names(model, tcfg.unfreeze, tcfg.last_blocks)
    if not names:
        raise ValueError(f"{desc}: unfreeze={tcfg.unfreeze!r} leaves no parameter to train")
    params, was_grad = _unfreeze(model, names)
    opt = make_optimizer(model, names, tcfg)
    if teacher is not None:
        teacher.to(compute.device).eval()
    run = _Optimisation(compute, params, opt, make_scheduler(opt, tcfg), teacher)
    key = fingerprint(tcfg, n, resume.key if resume is not None else None)
    folder = Path(resume.folder) if resume is not None else None
    start = checkpoints.restore(folder, model, run.opt, run.sched, key) if folder is not None else 0
    losses: list[float] = []
    model.train()
    bar = progress_bar(range(start, tcfg.steps), desc=desc, initial=start, total=tcfg.steps, wanted=tcfg.progress)
    # Subnormal floats (AdamW's second moments and the gradients of near-silent units reach them within a few hundred
    # steps) take a slow path on x86 CPUs: a 2.7M-parameter ViT trained at 2.9 s per step with them and 0.51 s with
    # them flushed to zero (AMD EPYC, 2 threads). Flushing changes the results only below 1e-38, deterministically.
    flush = compute.device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        for step, (batch, y) in zip(bar, step_batches(get_batch, n, tcfg, start, pin=compute.cuda), strict=True):
            losses.append(run.step(model, forward, batch, y, tcfg))
            if step % 10 == 0 or step == tcfg.steps - 1:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.4f}", lr=f"{run.sched.get_last_lr()[0]:.2e}")
            done, every = step + 1, tcfg.checkpoint_every
            if folder is not None and every > 0 and (done % every == 0 or done == tcfg.steps):
                checkpoints.save(folder, done, model, run.opt, run.sched, key)  # the final one: instant reruns
    finally:
        if flush:
            torch.set_flush_denormal(False)
        bar.close()
        for n_, p in model.named_parameters():
            p.requires_grad_(was_grad[n_])
        model.eval()
    for m in (model, teacher) if teacher is not None else (model,):
        m.to("cpu")
    return losses


@torch.inference_mode()
def accuracy(model: nn.Module, forward: Forward, batches: Sequence[Labelled]) -> float:
    """Top-1 accuracy of ``forward(model, batch)`` logits ``(B, C)`` over labelled batches."""
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for batch, y in batches:
        logits = forward(model, {k: v.to(device) for k, v in batch.items()})
        correct += int((logits.argmax(-1).cpu() == y).sum())
        total += len(y)
    return correct / max(1, total)
