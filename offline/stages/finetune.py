"""The fine-tuning stage: each member trained with its own recipe (:func:`member_train_config`, :func:`member_data`,
:func:`reinit_head`), resumable under ``out/.checkpoints/member<i>``, so that the members of a build split over
processes (``--stage member``) are collected by the one that finishes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from offline import data as data_mod
from offline import train as train_mod
from offline.config import BuildConfig
from offline.data import Data
from offline.stages.context import BuildContext, train_compute
from offline.stages.datasets import head_module, take
from offline.stages.ensemble import Members

__all__ = [
    "MEMBER_SEED_STRIDE",
    "finetune_members",
    "finetune_one",
    "member_checkpoints",
    "member_data",
    "member_train_config",
    "reinit_head",
]

MEMBER_SEED_STRIDE = 1009  # member i's fine-tuning seed: data.seed + stride * (i + 1) when members differ in data


def member_train_config(cfg: BuildConfig, i: int, depth: int | None = None) -> train_mod.TrainConfig:
    """Member ``i``'s fine-tuning recipe: the preset's, with the ``hydra`` levers (steps, what trains and in which
    blocks, batch order, label smoothing, learning rate, flips, distillation and member ``i``'s temperature)
    applied. ``depth``: the member's number of blocks, which a shared trunk (``hydra.shared_blocks``) needs: then
    only the blocks after it train (``finetune_blocks``, or all ``depth - shared_blocks`` of them for 0)."""
    h = cfg.hydra
    preset = train_mod.PRESETS[h.finetune_preset or cfg.base.preset]["finetune"]
    own = h.member_data != "same"
    over = {
        "steps": h.finetune_steps,
        "unfreeze": h.unfreeze,
        "seed": cfg.data.seed + (MEMBER_SEED_STRIDE * (i + 1) if own else 0),
    }
    for key, value in (("label_smoothing", h.label_smoothing), ("lr", h.lr), ("hflip", h.augment)):
        if value is not None:
            over[key] = value
    if h.finetune_blocks:
        over["last_blocks"] = h.finetune_blocks
    elif h.shared_blocks:
        if depth is None:
            raise ValueError("hydra.shared_blocks: the member's fine-tuning needs its number of blocks")
        over["last_blocks"] = depth - h.shared_blocks
    if h.distill > 0:  # left at the defaults otherwise: runs without distillation keep their checkpoints
        temps = h.distill_temperatures or [h.distill_temperature]
        over.update(distill_weight=h.distill, distill_temperature=temps[i % len(temps)])
    return train_mod.TrainConfig(**{**preset, **over, **train_compute(cfg)})


def member_data(data: Data, cfg: BuildConfig, seed: int) -> Data:
    """What a member fine-tunes on: the training split, or (``hydra.member_data: bootstrap``) a bootstrap resample
    of it drawn with ``seed`` (same size, with replacement)."""
    if cfg.hydra.member_data != "bootstrap":
        return data
    idx = np.sort(np.random.default_rng([seed, 11]).integers(0, len(data.train.labels), len(data.train.labels)))
    return dataclasses.replace(data, train=data_mod.Split(take(data.train.inputs, idx), data.train.labels[idx]))


def reinit_head(model: nn.Module, seed: int) -> None:
    """Re-initialise the classifier head (truncated normal, std 0.02; zero bias), seeded: members start apart."""
    head = head_module(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g).clamp_(-2, 2) * 0.02)
        if head.bias is not None:
            head.bias.zero_()


def finetune_members(ctx: BuildContext, members: Members) -> Members:
    """Each member fine-tuned for ``hydra.finetune_steps`` (:func:`finetune_one`); none without steps."""
    if ctx.config.hydra.finetune_steps <= 0:
        return members
    tuned = [finetune_one(ctx, m, i) for i, m in enumerate(members.models)]
    ctx.timer.lap("member fine-tuning")
    return Members(tuned, members.strategy)


def member_checkpoints(out: Path, i: int) -> Path:
    """Where member ``i``'s fine-tuning checkpoints live (shared by the stages of a build)."""
    return out / ".checkpoints" / f"member{i}"


def finetune_one(ctx: BuildContext, member: nn.Module, i: int) -> nn.Module:
    """Member ``i`` fine-tuned with its own recipe, resumable (a finished run reloads at once from its last
    checkpoint, which is how ``--stage finish`` collects members fine-tuned by other processes)."""
    cfg = ctx.config
    tcfg = member_train_config(cfg, i, ctx.adapter.num_layers(member))
    if cfg.hydra.reinit_head:
        reinit_head(member, tcfg.seed + i)
    key = {"member_data": cfg.hydra.member_data, "reinit_head": cfg.hydra.reinit_head}
    return train_mod.finetune_member(
        ctx.adapter,
        member,
        member_data(ctx.data, cfg, tcfg.seed),
        ctx.base.preprocessing,
        ctx.base.tokenizer,
        tcfg,
        resume=train_mod.Resume(member_checkpoints(ctx.out, i), key),
        desc=f"member {i}",
        teacher=ctx.base.model if cfg.hydra.distill > 0 else None,
    ).eval()
