"""Quality benchmark: the paper's table (Single, Deep Ensemble, MC Dropout, pruned singles, Hydra) and its ablations.

Both real settings of this project are run with the builder's own pieces
(``offline.pipelines.classifier_build``, ``offline.train``, ``offline.method.head_scores``, ``offline.method.members``,
``offline.method.fusion``, ``offline.method.ensemble_metrics``):

* ``image``: a small ViT trained here on 6 Fashion-MNIST classes; near-OOD = the 4
  held-out classes, far-OOD = sklearn digits and synthetic noise.
* ``text``: the packaged MiniLM fine-tuned on tweet sentiment; near-OOD = neutral
  tweets, far-OOD = BBC News sentences.

Methods (all evaluated at temperature 1, OOD score = MSP, OOD positive):

* ``single``: the base model of seed s (s = 0, 1, 2: the spread of a single run).
* ``deep_ensemble``: the base models of seeds 0, 1, 2 (image: trained from scratch;
  text: three fine-tunes of the pretrained encoder, head init and batch order by seed).
* ``mc_dropout``: the seed-0 base with dropout on at inference (``samples`` 3 and 10;
  the ViT trained here has no dropout, so its Dropout modules get ``p = mc_p`` only
  for sampling; MiniLM keeps its own 0.1).
* ``taylor`` / ``circavg``: the seed-0 base with the least important heads pruned
  (Taylor scores / CircAvg ranking, deterministic), fine-tuned like a member.
* ``hydra_taylor`` / ``hydra_circ``: the fused Hydra of the seed-0 base. Hydra seed k
  uses pruning seeds ``k*M .. k*M+M-1`` and member fine-tuning seed k, so the rows
  of seeds 0, 1, 2 give the spread over the randomness of Hydra's own construction.

The settings themselves (each one's recipe at each size, its data and batches) are in
``benchmarks/quality_setting.py``. Trained models are cached under ``.cache/benchmarks/`` (safetensors): base models per
(setting, sizes, preset, seed), circuit rankings per base and budget, fine-tuned
members through ``offline.train``'s resumable checkpoints (keyed by base, kept
heads and fine-tuning config), so reruns and ablations reuse them.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.quality_setting import (
    DEFAULT_CACHE,
    ROOT,
    SETTINGS,
    Batch,
    Context,
    Spec,
    build_config,
    digest,
    prepare,
    setting_spec,
    with_spec,
)
from offline import train as train_mod
from offline.method.ensemble_metrics import evaluate_predictions
from offline.method.fusion import fuse
from offline.method.head_scores import circuit_ranking
from offline.method.members import Budget, pool_size, sample_members
from offline.pipelines.classifier_build import base_checkpoint_dir
from offline.stages import ScoringBatches, Timer, build_members, collect_logits

# the benchmark's API; its settings (recipes, data, batches) live in benchmarks/quality_setting.py
__all__ = [
    "BUILDER_BASES",
    "DEFAULT_CACHE",
    "METHODS",
    "ROOT",
    "SETTINGS",
    "Context",
    "Spec",
    "base_model",
    "build_config",
    "builder_base_dir",
    "by_kind",
    "circuit_order",
    "digest",
    "finetune",
    "hydra_row",
    "logits_of",
    "mc_dropout_model",
    "mean_std",
    "metrics_row",
    "prepare",
    "pruned_members",
    "run_ablations",
    "run_setting",
    "setting_spec",
    "with_spec",
]

log = logging.getLogger("hydra.bench.quality")

BUILDER_BASES = ROOT / ".cache" / "bases"  # the base.cache_dir of offline/configs/*-full*.yaml
METHODS = ("single", "deep_ensemble", "mc_dropout", "taylor", "circavg", "hydra_taylor", "hydra_circ")


# ----------------------------------------------------------------------------- models (cached)
def _train_config(spec: Spec, part: str, seed: int, progress: bool, **over: Any) -> train_mod.TrainConfig:
    preset = train_mod.PRESETS[spec.preset][part]
    steps = {"steps": spec.base_steps} if part == "train" and spec.base_steps else {}
    return train_mod.TrainConfig(**{**preset, **steps, "seed": seed, "progress": progress, **over})


def _new_base(ctx: Context, seed: int) -> nn.Module:
    """An untrained base of the setting's architecture (text: the pretrained encoder with a new head of ``seed``)."""
    n = len(ctx.data.class_names)
    if ctx.spec.family == "vit":
        from timm.models.vision_transformer import VisionTransformer

        torch.manual_seed(seed)
        return VisionTransformer(**{**train_mod.PRESETS[ctx.spec.preset]["arch"], "num_classes": n})
    model, _ = train_mod.load_minilm_classifier(n, seed=seed)
    return model


def builder_base_dir(spec: Spec, seed: int, cache_dir: Path = BUILDER_BASES) -> Path | None:
    """The builder's cached base of the same recipe (``base.cache_dir`` of ``offline/build.py``), if there is one.

    ``offline.pipelines.classifier_build.load_base`` trains with seed 0 and keys its cache by (family, base, data)
    config; the benchmark's seed-0 base has exactly that recipe, so a full benchmark run after the full builds
    resumes from the build's base instead of training it again (the benchmark never creates that folder).
    ``fit``'s checkpoint fingerprint (training config, data size, architecture) still has to match.
    """
    if seed != train_mod.TrainConfig.seed:
        return None
    cfg = build_config(spec)
    cfg = replace(cfg, base=replace(cfg.base, cache_dir=str(cache_dir)))
    folder = base_checkpoint_dir(cfg, None)
    return folder if folder is not None and folder.is_dir() else None


def base_model(ctx: Context, seed: int) -> nn.Module:
    """The base classifier trained (image) or fine-tuned (text) with ``seed``; cached as safetensors."""
    from safetensors.torch import load_model, save_model

    path = ctx.cache / f"base-seed{seed}.safetensors"
    d = ctx.data
    if path.is_file():
        model = _new_base(ctx, seed)
        load_model(model, str(path), strict=True)
        return model.eval()
    tcfg = _train_config(ctx.spec, "train", seed, ctx.progress)
    shared = builder_base_dir(ctx.spec, seed)
    t0 = time.perf_counter()
    if ctx.spec.family == "vit":
        arch = {**train_mod.PRESETS[ctx.spec.preset]["arch"], "num_classes": len(d.class_names)}
        model = train_mod.train_base_vit(d.train, d.val, arch, tcfg, checkpoint_dir=shared)
    else:
        model = train_mod.finetune_bert(
            _new_base(ctx, seed), ctx.tok, d.train, d.val, tcfg, max_length=ctx.spec.max_length, checkpoint_dir=shared
        )
    save_model(model, str(path))
    info = {
        **getattr(model, train_mod.TRAIN_LOG_ATTR, {}),
        "seconds_total": round(time.perf_counter() - t0, 1),
        "train": train_mod.recorded(tcfg),
        "builder_checkpoint": str(shared) if shared else None,
    }
    path.with_suffix(".json").write_text(json.dumps(info, indent=1, default=str))
    return model.eval()


def circuit_order(ctx: Context, base: nn.Module, base_seed: int, prune_per_layer: int) -> list[tuple[int, int]]:
    """CircAvg ranking of ``base`` (least useful first) for a per-layer budget, as ``build_members`` makes; cached."""
    heads = ctx.adapter.heads(base)
    caps = [pool_size(prune_per_layer, n, None) for n in heads]
    path = ctx.cache / f"circuit-avg-seed{base_seed}-caps{digest(caps)}-n{ctx.spec.n_circuit}.json"
    if path.is_file():
        return [tuple(x) for x in json.loads(path.read_text())["ranking"]]
    t0 = time.perf_counter()
    res = circuit_ranking(
        ctx.adapter,
        base,
        ctx.val_id,
        ctx.val_y,
        ctx.val_ood,
        score="avg",
        budget=sum(caps),
        max_per_layer=caps,
        progress=ctx.progress,
    )
    path.write_text(
        json.dumps(
            {
                "ranking": res.ranking,
                "scores": res.scores,
                "base_score": res.base_score,
                "caps": caps,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return [tuple(x) for x in res.ranking]


def finetune(ctx: Context, member: nn.Module, base_seed: int, ft_seed: int, desc: str) -> nn.Module:
    """Fine-tune a pruned member like the builder does (``finetune_member``); its checkpoint doubles as the cache."""
    if ctx.spec.finetune_steps <= 0:
        return member.eval()
    tcfg = _train_config(
        ctx.spec, "finetune", ft_seed, ctx.progress, steps=ctx.spec.finetune_steps, unfreeze=ctx.cfg.hydra.unfreeze
    )
    ident = {"base": base_seed, "heads": ctx.adapter.kept_heads(member)}
    # progress bars do not change the member: the key holds run.py's default (True) whatever --quiet says
    folder = ctx.cache / "members" / digest({**ident, "train": train_mod.recorded(replace(tcfg, progress=True))})
    # the key of a --quiet run before 2026-11-23 (progress=False in the hash): adopted, not retrained
    legacy = ctx.cache / "members" / digest({**ident, "train": train_mod.recorded(replace(tcfg, progress=False))})
    if legacy.is_dir() and not folder.exists():
        legacy.rename(folder)
    return train_mod.finetune_member(
        ctx.adapter, member, ctx.data, ctx.prep, ctx.tok, tcfg, resume=train_mod.Resume(folder), desc=desc
    ).eval()


def pruned_members(
    ctx: Context,
    base: nn.Module,
    base_seed: int,
    strategy: str,
    pruning_seeds: Sequence[int],
    ft_seeds: Sequence[int],
    prune_per_layer: int | None = None,
) -> list[nn.Module]:
    """Fine-tuned members of ``base``: one per pruning seed (``taylor`` | ``circ``), each fine-tuned with its ft seed.

    ``taylor`` goes through ``offline.stages.build_members`` (one member: deterministic top-r pruning);
    ``circ`` samples from the cached CircAvg ranking with ``sample_members`` as ``build_members`` does.
    ``circ-top`` keeps exactly the best heads (the CircAvg-pruned single).
    """
    r = ctx.spec.prune_per_layer if prune_per_layer is None else prune_per_layer
    if len(ft_seeds) != len(pruning_seeds):
        raise ValueError(f"{len(pruning_seeds)} pruning seeds but {len(ft_seeds)} fine-tuning seeds")
    heads = ctx.adapter.heads(base)
    if strategy == "taylor":
        cfg = build_config(ctx.spec, "taylor", pruning_seeds, len(pruning_seeds), r)
        scoring = ScoringBatches(ctx.calib, ctx.val_id, ctx.val_y, ctx.val_ood)
        members, _ = build_members(cfg, ctx.adapter, base, scoring, Timer())
    elif strategy in ("circ", "circ-top"):
        ranking = circuit_order(ctx, base, base_seed, r)
        if strategy == "circ-top":
            keeps = sample_members(ranking, heads, Budget(per_layer=r), [0], pool=1.0)
        else:
            keeps = [sample_members(ranking, heads, Budget(per_layer=r), [s])[0] for s in pruning_seeds]
        members = [ctx.adapter.prune_to(base, k) for k in keeps]
    else:
        raise ValueError(f"unknown strategy {strategy!r}; expected taylor, circ or circ-top")
    return [
        finetune(ctx, m, base_seed, fs, f"{strategy} member (prune seed {ps}, ft seed {fs})")
        for m, ps, fs in zip(members, pruning_seeds, ft_seeds, strict=True)
    ]


# ----------------------------------------------------------------------------- evaluation
def logits_of(ctx: Context, fn: Callable[[Batch], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Member logits ``(N, M, C)`` of ``fn`` on the ID test set and on each OOD test set."""
    return collect_logits(fn, ctx.test), {n: collect_logits(fn, b) for n, b in ctx.ood_test.items()}


def metrics_row(ctx: Context, logits: torch.Tensor, ood_logits: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``offline.method.ensemble_metrics.evaluate_predictions`` of member logits (T = 1, MSP), with each OOD set's
    kind."""
    probs = torch.softmax(logits.float(), -1).numpy()
    ood_probs = {n: torch.softmax(v.float(), -1).numpy() for n, v in ood_logits.items()}
    m = evaluate_predictions(probs, ctx.y_test, ood_probs, ood_score="msp")
    for name, v in m["ood"].items():
        v["kind"] = ctx.ood_kinds[name]
    m["members"] = int(logits.shape[1])
    return m


def mc_dropout_model(model: nn.Module, p: float) -> nn.Module:
    """A copy of ``model`` in train mode (dropout on); Dropout modules with ``p == 0`` get ``p`` (ViT trained here)."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, nn.Dropout) and mod.p == 0:
            mod.p = p
    return m.train()


def _params(models: Sequence[nn.Module]) -> int:
    return sum(p.numel() for m in models for p in m.parameters())


def _row(ctx: Context, method: str, seed: int, logits, ood_logits, **extra: Any) -> dict[str, Any]:
    return {
        "setting": ctx.spec.setting,
        "method": method,
        "seed": seed,
        "mode": ctx.spec.mode,
        **metrics_row(ctx, logits, ood_logits),
        **extra,
    }


def run_setting(
    ctx: Context,
    hydra_seeds: Sequence[int] = (0, 1, 2),
    ensemble_seeds: Sequence[int] = (0, 1, 2),
    methods: Sequence[str] = METHODS,
) -> list[dict[str, Any]]:
    """Every quality row of one setting (see the module docstring for what each method is)."""
    ad, M = ctx.adapter, ctx.spec.members
    need_all = "single" in methods or "deep_ensemble" in methods
    bases = {s: base_model(ctx, s) for s in (ensemble_seeds if need_all else ensemble_seeds[:1])}
    base = bases[ensemble_seeds[0]]
    rows = _base_rows(ctx, bases, ensemble_seeds, methods) if need_all else []
    if "mc_dropout" in methods:
        rows += _mc_dropout_rows(ctx, base)
    b0 = ensemble_seeds[0]
    for method, strategy in (("taylor", "taylor"), ("circavg", "circ-top")):  # the pruned singles
        if method in methods:
            (m,) = pruned_members(ctx, base, b0, strategy, [0], [0])
            lg, ol = logits_of(ctx, lambda b, m=m: ad.forward(m, b))
            rows.append(_row(ctx, method, 0, lg, ol, params=_params([m]), heads=ad.kept_heads(m)))
    for method, strategy in (("hydra_taylor", "taylor"), ("hydra_circ", "circ")):
        if method not in methods:
            continue
        for k in hydra_seeds:
            seeds = [k * M + i for i in range(M)]
            members = pruned_members(ctx, base, b0, strategy, seeds, [k] * M)
            rows.append(hydra_row(ctx, method, k, members, pruning_seeds=seeds, ft_seed=k))
    return rows


def _base_rows(
    ctx: Context, bases: dict[int, nn.Module], ensemble_seeds: Sequence[int], methods: Sequence[str]
) -> list[dict[str, Any]]:
    """The rows of the base models: ``single`` per seed and the ``deep_ensemble`` of all of them."""
    ad = ctx.adapter
    rows: list[dict[str, Any]] = []
    base_out = {s: logits_of(ctx, lambda b, m=m: ad.forward(m, b)) for s, m in bases.items()}
    if "single" in methods:
        for s, (lg, ol) in base_out.items():
            rows.append(_row(ctx, "single", s, lg, ol, params=_params([bases[s]])))
    if "deep_ensemble" in methods and len(bases) > 1:
        lg = torch.cat([base_out[s][0] for s in ensemble_seeds], 1)
        ol = {n: torch.cat([base_out[s][1][n] for s in ensemble_seeds], 1) for n in ctx.ood_test}
        rows.append(
            _row(ctx, "deep_ensemble", 0, lg, ol, params=_params(list(bases.values())), base_seeds=list(ensemble_seeds))
        )
    return rows


def _mc_dropout_rows(ctx: Context, base: nn.Module) -> list[dict[str, Any]]:
    """MC Dropout of ``base``: one row per sample count of the spec, all from the same samples."""
    ad, spec = ctx.adapter, ctx.spec
    mc = mc_dropout_model(base, spec.mc_p)
    S = max(spec.mc_samples)
    torch.manual_seed(0)
    lg, ol = logits_of(ctx, lambda b: torch.stack([ad.forward(mc, b) for _ in range(S)], 1))  # (B, S, C)
    return [
        _row(
            ctx,
            "mc_dropout",
            0,
            lg[:, :k],
            {n: v[:, :k] for n, v in ol.items()},
            samples=k,
            params=_params([base]),
            dropout_p=spec.mc_p if spec.family == "vit" else "model's own (0.1)",
        )
        for k in spec.mc_samples
    ]


def hydra_row(ctx: Context, method: str, seed: int, members: Sequence[nn.Module], **extra: Any) -> dict[str, Any]:
    """Row of the fused Hydra of ``members`` (what is served), with the unfused ensemble's headline numbers."""
    ad = ctx.adapter
    fused, _ = fuse(ad, members)
    lg, ol = logits_of(ctx, lambda b: fused(**b))
    row = _row(ctx, method, seed, lg, ol, params=_params([fused]), heads=[ad.kept_heads(m) for m in members], **extra)
    ul = logits_of(ctx, lambda b: torch.stack([ad.forward(m, b) for m in members], 1))
    u = metrics_row(ctx, *ul)
    row["unfused"] = {k: u[k] for k in ("acc", "nll", "ece", "mi_id", "mi_ood")} | {"ood_avg": u["ood_avg"]}
    return row


# ----------------------------------------------------------------------------- ablations
def run_ablations(ctx: Context, strategy: str = "taylor") -> list[dict[str, Any]]:
    """The paper's ablations on this setting, Hydra seed 0, ``strategy`` (taylor | circ) members.

    * ``members``: M in ``spec.ablation_members`` (pruning seeds 0..M-1).
    * ``heads_kept``: heads pruned per layer in ``spec.ablation_prune``.
    * ``diversity``: which randomness differs between the 3 members: ``none`` (same heads, same
      batch order: 3 identical members), ``order`` (same heads, fine-tuning seeds 0, 1, 2),
      ``pruning`` (pruning seeds 0, 1, 2, one batch order: the default) and ``both``.
    """
    ad, spec = ctx.adapter, ctx.spec
    base = base_model(ctx, 0)
    H = ad.heads(base)
    rows: list[dict[str, Any]] = []
    method = f"hydra_{'circ' if strategy == 'circ' else 'taylor'}"

    def add(ablation: str, value: Any, members: list[nn.Module], **extra: Any) -> None:
        r = hydra_row(ctx, method, 0, members, **extra)
        rows.append({"ablation": ablation, "value": value, **r})

    for M in spec.ablation_members:
        add("members", M, pruned_members(ctx, base, 0, strategy, list(range(M)), [0] * M))
    for r in spec.ablation_prune:
        kept = f"{H[0] - r}/{H[0]}"
        add(
            "heads_kept",
            kept,
            pruned_members(ctx, base, 0, strategy, [0, 1, 2], [0, 0, 0], prune_per_layer=r),
            prune_per_layer=r,
        )
    variants = {
        "none": ([0, 0, 0], [0, 0, 0]),
        "order": ([0, 0, 0], [0, 1, 2]),
        "pruning": ([0, 1, 2], [0, 0, 0]),
        "both": ([0, 1, 2], [0, 1, 2]),
    }
    for name, (ps, fs) in variants.items():
        add("diversity", name, pruned_members(ctx, base, 0, strategy, ps, fs), pruning_seeds=ps, ft_seeds=fs)
    return rows


# ----------------------------------------------------------------------------- aggregation
def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value) of finite ``values``; NaN mean if none."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return float("nan"), float("nan")
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def by_kind(row: dict[str, Any], kind: str, metric: str) -> float:
    """``metric`` averaged over the row's OOD sets of ``kind`` (near | far)."""
    vals = [v[metric] for v in row["ood"].values() if v["kind"] == kind]
    return float(np.mean(vals)) if vals else float("nan")
