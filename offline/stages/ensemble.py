"""Head scores -> members: the batches head scoring reads, the strategy's ranking of the base model's heads (Taylor,
circuits, random: :mod:`offline.method.head_scores`) and the M pruned members sampled from it
(:mod:`offline.method.members`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from offline.compute import on_device
from offline.config import BuildConfig
from offline.families import FamilyAdapter
from offline.families.clip import CLIPAdapter
from offline.method.fusion import fuse
from offline.method.head_scores import circuit_ranking, random_ranking, taylor_prune
from offline.method.members import Budget, pool_size, sample_members
from offline.stages.context import BuildContext, Timer, compute_of
from offline.stages.datasets import Batch, Batches, batches_of, circuit_batches, concat, sample_indices, take

__all__ = [
    "Fused",
    "Members",
    "ScoringBatches",
    "budget_of",
    "fuse_members",
    "build_members",
    "scoring_batches",
    "seeds_of",
    "taylor_members",
    "zero_shot_members",
]


@dataclass
class ScoringBatches:
    """What head scoring needs: Taylor's gradient batches, circuit extraction's ID and OOD validation batches."""

    calib: Batches  # [(batch, labels)] from the training split, for Taylor gradients
    val_id: list[Batch]  # circuit extraction ID batches
    val_y: torch.Tensor  # (n,) their labels
    val_ood: list[Batch]  # circuit extraction OOD batches (OOD *validation* sets only)

    @classmethod
    def of(cls, calib: Batches, val: Batches, ood: Batches) -> ScoringBatches:
        return cls(calib, [b for b, _ in val], torch.cat([y for _, y in val]), [b for b, _ in ood])

    def to(self, device: torch.device) -> ScoringBatches:
        """Every tensor on ``device`` (scoring on a GPU reads them many times: copied once)."""

        def on(b: Batch) -> Batch:
            return {k: v.to(device) for k, v in b.items()}

        return ScoringBatches(
            [(on(b), y.to(device)) for b, y in self.calib],
            [on(b) for b in self.val_id],
            self.val_y.to(device),
            [on(b) for b in self.val_ood],
        )


@dataclass
class Members:
    """The pruned members (each the base model with heads sliced away) and the manifest's ``strategy`` record."""

    models: list[nn.Module]
    strategy: dict[str, Any]


def scoring_batches(ctx: BuildContext) -> ScoringBatches:
    """A classifier's scoring batches: Taylor's gradient batches (``hydra.calib_samples`` training inputs, seeded)
    and circuit extraction's validation batches: as many ID inputs, and every OOD validation set in equal shares."""
    cfg, data, prep, tok = ctx.config, ctx.data, ctx.base.preprocessing, ctx.base.tokenizer
    n_cal = min(cfg.hydra.calib_samples, len(data.train.labels))
    cal_idx = sample_indices(len(data.train.labels), n_cal, cfg.data.seed)
    calib = batches_of(take(data.train.inputs, cal_idx), data.train.labels[cal_idx], prep, tok, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val = circuit_batches(take(data.val.inputs, np.arange(n_val)), data.val.labels[:n_val], prep, tok)
    per_set = max(1, n_val // max(1, len(data.ood_val)))
    ood = concat([take(v, np.arange(min(per_set, len(v)))) for v in data.ood_val.values()])
    return ScoringBatches.of(calib, val, circuit_batches(ood, [0] * len(ood), prep, tok))


def budget_of(cfg: BuildConfig) -> Budget:
    h = cfg.hydra
    return Budget(per_layer=h.prune_per_layer) if h.prune_per_layer is not None else Budget(total=h.prune_total)


def seeds_of(cfg: BuildConfig) -> list[int]:
    """One pruning seed per member: ``hydra.seeds``, else 0..M-1."""
    h = cfg.hydra
    return list(h.seeds) if h.seeds is not None else list(range(h.members))


def taylor_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, calib: Batches, counts: list[int]
) -> tuple[list[nn.Module], dict[str, Any]]:
    """One Taylor-pruned member per seed, pruning ``counts[l]`` heads of layer ``l`` from its candidate pool."""
    h = cfg.hydra
    heads = adapter.heads(base)
    pools = [pool_size(r, n, h.pool) for r, n in zip(counts, heads, strict=True)]
    members = []
    for s in seeds_of(cfg):
        seed = s if h.members > 1 else None
        members.append(taylor_prune(adapter, base, calib, counts, pool_per_layer=pools, seed=seed, progress=True).model)
    budget = vars(budget_of(cfg))
    info = {"name": "taylor", "seeds": seeds_of(cfg), "budget": budget, "pool": h.pool, "pool_per_layer": pools}
    return members, info


def build_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, scoring: ScoringBatches, timer: Timer
) -> tuple[list[nn.Module], dict[str, Any]]:
    """The M pruned members of ``cfg.hydra.strategy`` and the manifest's ``strategy`` record; head scoring runs on
    the build device under its autocast (``build.device``, ``build.precision``), the members come back on the CPU.

    The stages call it with the context's parts; the benchmarks call it with their own batches."""
    compute = compute_of(cfg)
    if not compute.cuda and compute.precision == "fp32":
        return _build_members(cfg, adapter, base, scoring, timer)
    with on_device(compute, base), compute.autocast():
        members, info = _build_members(cfg, adapter, base, scoring.to(compute.device), timer)
    return [m.to("cpu").float() for m in members], info


def _build_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, scoring: ScoringBatches, timer: Timer
) -> tuple[list[nn.Module], dict[str, Any]]:
    h = cfg.hydra
    heads = adapter.heads(base)
    budget = budget_of(cfg)
    k = h.shared_blocks  # the shared trunk's layers keep every head
    if h.strategy == "taylor":
        counts = [0] * k + budget.per_layer_counts(heads[k:])
        members, info = taylor_members(cfg, adapter, base, scoring.calib, counts)
        timer.lap("taylor scoring and pruning")
        return members, ({**info, "shared_blocks": k} if k else info)
    info: dict[str, Any] = {"name": h.strategy, "seeds": seeds_of(cfg), "budget": vars(budget), "pool": h.pool}
    if k:
        info["shared_blocks"] = k
    if h.strategy == "random":
        ranking = random_ranking(heads, seed=cfg.data.seed)
    else:
        score = h.strategy.split("-", 1)[1]
        ranking = _circuit_ranking(cfg, adapter, base, scoring, info)
        timer.lap(f"circuit extraction ({score})")
    info["ranking"] = [list(x) for x in ranking]
    keeps = sample_members(ranking, heads, budget, seeds_of(cfg), pool=h.pool, shared=k)
    return [adapter.prune_to(base, keep) for keep in keeps], info


def _circuit_ranking(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, scoring: ScoringBatches, info: dict[str, Any]
) -> list[tuple[int, int]]:
    """The circuit ranking of ``hydra.strategy`` (``circuit-<score>``) over as many heads as the members' candidate
    pools need (per layer with a per-layer budget; none of a shared trunk's); its scores go into ``info``."""
    h, budget, heads = cfg.hydra, budget_of(cfg), adapter.heads(base)
    k = h.shared_blocks
    score = h.strategy.split("-", 1)[1]
    args = (adapter, base, scoring.val_id, scoring.val_y, scoring.val_ood)
    if budget.total is not None:
        size = pool_size(budget.total, sum(heads[k:]), h.pool)
        caps = [0] * k + list(heads[k:]) if k else None
        res = circuit_ranking(*args, score=score, budget=size, max_per_layer=caps)
    else:
        caps = [0] * k + [pool_size(budget.per_layer, n, h.pool) for n in heads[k:]]
        res = circuit_ranking(*args, score=score, budget=sum(caps), max_per_layer=caps)
    info.update(circuit_scores=res.scores, circuit_base_score=res.base_score)
    return res.ranking


def zero_shot_members(ctx: BuildContext, scoring: ScoringBatches) -> Members:
    """A zero-shot model's members: by joint circuits over both towers or random ranking (:func:`build_members`), or
    by Taylor on the vision tower only (the towers' Taylor scales differ)."""
    cfg, base, adapter = ctx.config, ctx.base.model, ctx.adapter
    if cfg.hydra.strategy != "taylor":
        return Members(*build_members(cfg, adapter, base, scoring, ctx.timer))
    assert isinstance(adapter, CLIPAdapter)
    heads = adapter.heads(base)
    lv = adapter.num_vision_layers(base)
    counts = budget_of(cfg).per_layer_counts(heads[:lv]) + [0] * (len(heads) - lv)  # the vision tower only
    base.requires_grad_(False)
    base.visual.requires_grad_(True)  # gradients only where heads are scored
    members, info = taylor_members(cfg, adapter, base, scoring.calib, counts)
    base.requires_grad_(False)
    ctx.timer.lap("taylor scoring and pruning (vision tower)")
    return Members(members, {**info, "towers": "vision only"})


@dataclass
class Fused:
    """The members fused into one model (:mod:`offline.method.fusion`): one forward pass, member logits
    ``(B, M, C)``."""

    model: nn.Module  # a service.core fused model, in eval mode
    config: dict[str, Any]  # its config: with the weights, what the artifact stores


def fuse_members(ctx: BuildContext, members: Members) -> Fused:
    """The members fused with ``hydra.mlp`` (one shared MLP per layer, or each member's own) and
    ``hydra.shared_blocks`` (the shared trunk)."""
    h = ctx.config.hydra
    model, config = fuse(ctx.adapter, members.models, mlp=h.mlp, shared_blocks=h.shared_blocks)
    ctx.timer.lap("fusion")
    return Fused(model, config)
