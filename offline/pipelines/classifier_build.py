"""The classifier build (families ``vit`` and ``bert``): a chain of :mod:`offline.stages` over one build context::

    data -> base model -> head scores -> members -> fine-tune -> fuse -> calibrate -> evaluate -> guarantees
      -> export -> artifact

``build(cfg, out)`` writes one artifact directory (format: ``docs/artifact.md``). The base model
comes from ``base.source``: ``train-vit`` (a small timm ViT trained here), ``timm:<name>``
(optionally a local checkpoint in ``base.path``), ``minilm`` (the packaged all-MiniLM-L6-v2) or
``hf:<folder>``. A build may also run one stage per process (``--stage``, :data:`STAGES`), the
processes sharing ``out/.checkpoints``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from offline import train as train_mod
from offline.compute import on_device
from offline.config import BuildConfig, ConfigError, check_budget
from offline.data import Data
from offline.families import get_adapter
from offline.pipelines.baselines import baseline_methods
from offline.pipelines.bases import base_loader, train_config
from offline.stages.calibrate import Calibration, calibrate_ood
from offline.stages.certify import Guarantees, classifier_guarantees
from offline.stages.context import BaseModel, BuildContext, Timer
from offline.stages.datasets import EvalSets, eval_sets, load_data
from offline.stages.ensemble import Fused, Members, build_members, fuse_members, scoring_batches
from offline.stages.evaluation import Evaluation, classifier_models, evaluate_classifier, standard_methods
from offline.stages.finetune import finetune_members, finetune_one, member_checkpoints
from offline.stages.package import (
    Exports,
    export_classifier,
    model_outputs,
    ood_spec,
    prepare_out,
    provenance,
    report_extra,
    save_weights,
    write_artifact,
)
from service.core.artifact import Manifest
from service.core.families import FAMILIES
from service.core.progress import stage as progress_stage

__all__ = ["STAGES", "base_checkpoint_dir", "build", "finish", "heads_of_base", "load_base", "scoring_batches"]

STAGES = ("base", "score", "member", "finish")  # --stage: the parts of a build one process (pod, GPU) can run


# ----------------------------------------------------------------------------- base model
def heads_of_base(cfg: BuildConfig) -> list[int] | None:
    """Head counts of the base model read cheaply (config files, a model on the meta device), to check the budget
    before heavy work; the family's adapter counts them."""
    src, adapter = cfg.base.source, get_adapter(cfg.family)
    if src == "train-vit":
        arch = {**train_mod.PRESETS[cfg.base.preset]["arch"], **cfg.base.arch}
        return [int(arch["num_heads"])] * int(arch["depth"])
    if src == "minilm" or src.startswith("hf:"):
        path = cfg.base.path or (train_mod.minilm_path() if src == "minilm" else src[3:])
        conf = Path(path) / "config.json"
        return adapter.config_heads(json.loads(conf.read_text())) if conf.is_file() else None
    if src.startswith("timm:"):
        with torch.device("meta"):
            m = timm.create_model(src[5:], pretrained=False, **cfg.base.arch)
        return adapter.heads(m)
    return None


def base_checkpoint_dir(cfg: BuildConfig, out: Path | None, data: Data | None = None) -> Path | None:
    """Where the base model's training checkpoints go: ``base.cache_dir/<family>-<hash of base and data settings>``
    (and, with ``data``, of the training split's index hash: a base is reused only on the same images), else
    ``out/.checkpoints/base``."""
    if cfg.base.cache_dir:
        digest = hashlib.sha256(json.dumps(_cache_key(cfg, data), sort_keys=True, default=str).encode()).hexdigest()
        return Path(cfg.base.cache_dir) / f"{cfg.family}-{digest[:16]}"
    if out is None:
        return None
    return out / ".checkpoints" / ("base" if cfg.base.seed is None else f"base-seed{cfg.base.seed}")


def _cache_key(cfg: BuildConfig, data: Data | None) -> dict[str, Any]:
    """What determines a trained base: the family, the base and data settings, the training split's index hash."""
    # neither the cache folder nor the Deep Ensemble's size changes this base; an unset seed keeps older keys
    base = {
        k: v
        for k, v in dataclasses.asdict(cfg.base).items()
        if k not in ("cache_dir", "deep_ensemble") and not (k == "seed" and v is None)
    }
    settings = {
        k: v
        for k, v in dataclasses.asdict(cfg.data).items()
        if k not in ("max_fit", "max_calibration")  # not used in training
        and not (k in ("augment", "crop_scale") and cfg.data.augment is None)  # unset: older keys hold
    }
    key: dict[str, Any] = {"family": cfg.family, "base": base, "data": settings}
    train = ((getattr(data, "splits", None) or {}).get("id") or {}).get("train") or {}
    if train.get("index_sha256"):
        key["train_index"] = train["index_sha256"]
    return key


def deep_ensemble_bases(ctx: BuildContext) -> list[nn.Module]:
    """The other base models of the Deep Ensemble baseline (``base.deep_ensemble``): trained exactly like the base
    on the same data, with the training seeds after its own; each resumable and cached like it."""
    cfg = ctx.config
    first = train_config(cfg).seed
    bases = []
    for seed in range(first + 1, first + cfg.base.deep_ensemble):
        other = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, seed=seed, deep_ensemble=0))
        torch.manual_seed(seed)  # a timm head reset draws from the global generator
        bases.append(load_base(other, ctx.data, ctx.out).model)
    if bases:
        ctx.timer.lap(f"Deep Ensemble baseline ({len(bases)} more base models)")
    return bases


def load_base(cfg: BuildConfig, data: Data, out: Path | None = None) -> BaseModel:
    """The base classifier (eval) with the artifact's preprocessing, its tokenizer (text; else None) and its
    description for the manifest."""
    ckpt = base_checkpoint_dir(cfg, out, data)
    row = get_adapter(cfg.family).row
    if row.task != "classification":
        mine = ", ".join(f.name for f in FAMILIES.values() if f.task == "classification")
        raise ConfigError(f"family {cfg.family!r} is not a classifier family ({mine}); it is a {row.task} family")
    return base_loader(cfg.family)(cfg, data, ckpt)


# ----------------------------------------------------------------------------- the build
def build(cfg: BuildConfig, out: Path, stage: str | None = None, member: int | None = None) -> Path:
    """Build the classifier artifact of ``cfg`` into ``out`` and return it; or run one ``stage`` of it.

    Stages share ``out/.checkpoints`` (a volume every pod mounts): ``base`` trains the base model (and the Deep
    Ensemble baseline's), ``score`` scores the heads and records the members' kept heads, ``member`` fine-tunes
    member ``member`` (one per process: members train in parallel), ``finish`` collects them (each must have
    finished), fuses, calibrates, evaluates and exports. Every stage reloads the data and the base from disk; the
    artifact equals a one-process build's."""
    out = Path(out)
    torch.manual_seed(cfg.data.seed)
    timer = Timer()
    check_request(cfg, out, stage, member)
    data = load_data(cfg)
    timer.lap("data")
    ctx = BuildContext.create(cfg, out, data, load_base(cfg, data, out), timer)
    check_budget(cfg, ctx.adapter.heads(ctx.base.model))
    timer.lap("base model")
    others = deep_ensemble_bases(ctx) if stage in (None, "base", "finish") else []
    if stage == "base":
        return save_stage(ctx, "base")
    members = scored_members(ctx, stage)
    if stage == "score":
        return save_stage(ctx, "score")
    if stage == "member":
        return finetune_member(ctx, members, member)
    if stage == "finish":
        check_members_done(ctx)
    members = finetune_members(ctx, members)
    fused = fuse_members(ctx, members)
    baselines = baseline_methods(ctx, ctx.base.model) if cfg.base.baselines else {}
    if stage == "finish":  # the manifest's timings: every stage's, each under its own name
        timer.times = {**stage_times(out), **timer.times}
    return finish(ctx, [ctx.base.model, *others], members, fused, baselines)


def finish(
    ctx: BuildContext,
    bases: list[nn.Module],
    members: Members,
    fused: Fused,
    baselines: dict[str, Any] | None = None,
) -> Path:
    """Calibrate, evaluate, export and write the artifact. Every evaluation input goes through the server's
    preprocessing of the artifact (:func:`offline.stages.datasets.eval_sets`); the fused model returns its members'
    features too, for the OOD statistics (:func:`offline.stages.calibrate.calibrate_ood`). ``bases``: the base
    model, then the Deep Ensemble baseline's other base models (``base.deep_ensemble``), if any; ``baselines``: the
    efficient-ensemble baselines (``base.baselines``, :func:`offline.pipelines.baselines.baseline_methods`)."""
    prepare_out(ctx)
    sets = eval_sets(ctx)
    fused.model.with_features = True  # (logits, features): the served model and its exports carry both ...
    fused.model.with_layer_features = True  # ... and, for now, the layer features: kept if the served score reads them
    with on_device(ctx.evaluation, fused.model, *bases, *members.models):
        methods = standard_methods(classifier_models(ctx, bases, members, fused, baselines), sets)
        ctx.timer.lap("evaluation outputs (every method on every set)")
        with progress_stage("calibration"):
            cal = calibrate_ood(ctx, methods["hydra"].fn, methods["hydra"].runs, sets)
        ctx.timer.lap("calibration")
        evaluation = evaluate_classifier(ctx, methods, sets, cal)
        guarantees = classifier_guarantees(ctx, methods, cal, sets)
    save_weights(ctx.out, fused.model, cal, guarantees.fitted)
    exports = export_classifier(ctx, fused, cal, sets)
    return write_classifier(ctx, members, fused, sets, cal, evaluation, guarantees, exports)


def write_classifier(
    ctx: BuildContext,
    pruned: Members,
    fusion: Fused,
    sets: EvalSets,
    cal: Calibration,
    evaluation: Evaluation,
    fitted: Guarantees,
    checked: Exports,
) -> Path:
    """The report, then the manifest of a classifier artifact (:func:`offline.stages.package.write_artifact`)."""
    cfg, data, adapter, timer = ctx.config, ctx.data, ctx.adapter, ctx.timer
    prep, base_desc, latency = ctx.base.preprocessing, ctx.base.description, sets.latency
    members, strategy, fused, fcfg = pruned.models, pruned.strategy, fusion.model, fusion.config
    exports, precision, guarantees = checked.exports, checked.precision, fitted.fitted

    def manifest(metrics: dict[str, Any]) -> Manifest:
        return Manifest(
            name=cfg.name,
            family=cfg.family,
            task="classification",
            base_model=base_desc,
            members=len(members),
            shared_blocks=fcfg.get("shared_blocks") or None,  # absent for none: older servers load it
            heads=[adapter.kept_heads(m) for m in members],
            strategy=strategy,
            labels=list(data.class_names),
            preprocessing=prep,
            uncertainty=cal.uncertainty(),
            ood=ood_spec(cal, data),
            model={
                "config": fcfg,
                "weights": "model.safetensors",
                "inputs": list(latency),
                "output": "logits",
                "shape": "(B, M, C)",
                "outputs": model_outputs(fused),
            },
            exports=exports,
            precision=precision,
            metrics=metrics,
            data=data.splits,
            build=provenance(cfg, timer),
            guarantees=guarantees.spec if guarantees is not None else None,
        )

    title = f"{cfg.name}: Hydra ({strategy['name']}, M={cfg.hydra.members})"
    return write_artifact(ctx, manifest, evaluation, title, report_extra(ctx, cal, evaluation, fitted))


# ----------------------------------------------------------------------------- a build over several processes
def check_request(cfg: BuildConfig, out: Path, stage: str | None, member: int | None) -> None:
    """Before any data or weights load: the pruning budget against the base's head counts when its config files
    give them cheaply, and the ``--stage`` / ``--member`` request against what ``out`` holds."""
    heads = heads_of_base(cfg)
    if heads is not None:
        check_budget(cfg, heads)
    if stage == "member" and not 0 <= (member if member is not None else -1) < cfg.hydra.members:
        raise ConfigError(f"--stage member needs --member K with 0 <= K < hydra.members={cfg.hydra.members}")
    if stage in ("member", "finish") and not (_stage_dir(out) / "members.json").is_file():
        raise ConfigError(f"--stage {stage}: no scored members in {out} (run --stage base, then --stage score)")


def _stage_dir(out: Path) -> Path:
    return out / ".checkpoints" / "stages"


def save_stage(ctx: BuildContext, name: str) -> Path:
    """Record that stage ``name`` finished, with its timings (``finish`` puts them in the manifest)."""
    d = _stage_dir(ctx.out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.timings.json").write_text(json.dumps(ctx.timer.times))
    return ctx.out


def stage_times(out: Path) -> dict[str, float]:
    """The timings the earlier stages recorded, as ``stage <name>: <lap>``."""
    times: dict[str, float] = {}
    for f in sorted(_stage_dir(out).glob("*.timings.json")):
        stage = f.name.split(".")[0]
        times.update({f"stage {stage}: {k}": v for k, v in json.loads(f.read_text()).items()})
    return times


def scored_members(ctx: BuildContext, stage: str | None) -> Members:
    """The pruned members and the strategy record: scored here (one process, or ``--stage score``, which saves the
    members' kept heads), or (``member``, ``finish``) rebuilt from the saved kept heads: a pruned member is the
    base with the other heads' weights sliced away, so the kept heads determine it."""
    path = _stage_dir(ctx.out) / "members.json"
    adapter, base = ctx.adapter, ctx.base.model
    if stage in ("member", "finish"):
        saved = json.loads(path.read_text())
        return Members([adapter.prune_to(base, k) for k in saved["kept_heads"]], saved["strategy"])
    members = Members(*build_members(ctx.config, adapter, base, scoring_batches(ctx), ctx.timer))
    if stage == "score":
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"kept_heads": [adapter.kept_heads(m) for m in members.models], "strategy": members.strategy}
        path.write_text(json.dumps(doc, default=float))
    return members


def finetune_member(ctx: BuildContext, members: Members, member: int) -> Path:
    """``--stage member``: member ``member`` fine-tuned (resumable), its timings recorded."""
    finetune_one(ctx, members.models[member], member)
    ctx.timer.lap(f"member {member} fine-tuning")
    return save_stage(ctx, f"member{member}")


def check_members_done(ctx: BuildContext) -> None:
    """``--stage finish``: every member's fine-tuning has reached its last step."""
    h = ctx.config.hydra
    if h.finetune_steps <= 0:
        return
    for i in range(h.members):
        done = train_mod.completed_steps(member_checkpoints(ctx.out, i))
        if done < h.finetune_steps:
            raise ConfigError(
                f"--stage finish: member {i} is at step {done} of {h.finetune_steps} "
                f"(run --stage member --member {i} first)"
            )
