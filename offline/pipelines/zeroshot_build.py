"""The zero-shot build (family ``clip``): a chain of :mod:`offline.stages` over one build context::

    data -> base CLIP -> joint head scores -> members -> fuse -> calibrate -> evaluate -> guarantees
      -> export both encoders -> artifact

``offline.build`` calls :func:`build_zero_shot` for ``family: clip``.

Base model (``base.source``):

* ``lit``: an OpenCLIP ``CustomTextCLIP`` with the packaged MiniLM as frozen text tower and an image
  tower trained here on the ID classes' captions (:mod:`offline.train.lit`; preset ``base.preset``, e.g.
  ``lit_fast``; ``base.arch`` overrides its vision config, ``base.steps`` its step count). The trained
  model is cached under ``$HYDRA_CACHE_DIR/lit`` (default ``.cache/lit``) by a hash of everything
  that determines it, so a rebuild with other Hydra settings does not retrain it.
* ``openclip:<model name or config .json>`` with ``base.path`` = a local ``open_clip_pytorch_model.bin``
  / ``.safetensors``: loaded by open_clip's own ``create_model(name, pretrained=path)``
  (e.g. ``openclip:ViT-B-32`` with the ``laion2b_s34b_b79k`` file).

Zero-shot classification uses the prompts ``"A photo of a {label}."`` of the data's class names.
Heads are scored jointly over both towers (flat layer index: vision layers, then text layers; see
``offline/families/clip.py``): circuits by zero-shot accuracy / MSP-AUROC / their average; Taylor on
the vision tower only (the towers' Taylor scales differ, as the paper notes).

Artifact: the zero-shot layout of ``docs/artifact.md``, which describes every file and manifest field: the fused
``service.core.fused_clip.FusedCLIP`` weights, both encoders' TorchScript and ONNX exports, the tokenizer and the
report. The manifest is built as ``service.core.artifact.Manifest``, whose validation is the format's.

Serving: embed the labels' prompts once with the text encoder, ``(L, M, D)``; per request embed the
images, ``(B, M, D)``; member logits ``(B, M, L) = logit_scale · einsum("bmd,lmd->bml")``
(``+ logit_bias``), divided by ``uncertainty.temperature``, then ``service.core.uncertainty.summarize``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offline.config import BuildConfig, ConfigError, check_budget
from offline.families.clip import CLIPAdapter, split_heads
from offline.pipelines.bases import load_base_clip
from offline.stages.calibrate import ZeroShotCalibration, calibrate_zero_shot
from offline.stages.certify import Guarantees, zero_shot_guarantees, zero_shot_guarantees_report
from offline.stages.context import BuildContext, Timer
from offline.stages.datasets import (
    EVAL_BATCH,
    Batch,
    Batches,
    concat,
    load_data,
    prompt_batch,
    sample_indices,
    take,
    zero_shot_sets,
)
from offline.stages.ensemble import Fused, Members, ScoringBatches, fuse_members, zero_shot_members
from offline.stages.evaluation import Evaluation, evaluate_zero_shot, zero_shot_methods, zero_shot_models
from offline.stages.package import (
    Exports,
    export_zero_shot,
    label_free_spec,
    model_spec,
    prepare_out,
    provenance,
    save_weights,
    write_artifact,
    zero_shot_extra,
)
from offline.train import lit
from service.core.artifact import Manifest
from service.core.progress import stage as progress_stage

__all__ = [
    "HEAD_INDEX",
    "build_zero_shot",
    "finish_zero_shot",
    "ood_sample",
    "prompt_batch",
    "zero_shot_batches",
]

log = logging.getLogger("hydra.build")

HEAD_INDEX = (
    "joint layer index: vision tower layers 0..Lv-1, then text tower layers Lv..Lv+Lt-1; "
    "heads are indices into the base model's heads of that layer"
)


# ----------------------------------------------------------------------------- the scoring batches
def zero_shot_batches(
    images: np.ndarray, labels: np.ndarray, prep: dict, prompts: Batch, batch_size: int = EVAL_BATCH
) -> Batches:
    """Images in order as ``({"pixel_values": (B, 3, H, W), "input_ids": (L, T), "attention_mask": (L, T)}, y)``."""
    out = []
    for i in range(0, len(labels), batch_size):
        x = lit.pixel_batch(images[i : i + batch_size], prep["mean"], prep["std"], prep["size"], prep["channels"])
        out.append(({"pixel_values": x, **prompts}, torch.as_tensor(np.asarray(labels[i : i + batch_size]))))
    return out


def ood_sample(ood_sets: dict[str, Any], n: int, seed: int) -> Any:
    """``n`` OOD validation images drawn evenly from every set (seeded), so no single set drives the circuits;
    arrays or a user's image files alike (none without OOD data)."""
    names = sorted(ood_sets)
    if not names:
        return []
    rng = np.random.default_rng(seed)
    per, extra = divmod(n, len(names))
    parts = []
    for i, name in enumerate(names):
        x = ood_sets[name]
        k = min(len(x), per + (1 if i < extra else 0))
        parts.append(take(x, np.sort(rng.choice(len(x), size=k, replace=False))))
    return concat(parts)


def scoring_batches(ctx: BuildContext, prompts: Batch) -> ScoringBatches:
    """Taylor's gradient batches and circuit extraction's ID / OOD validation batches, each with the prompts."""
    cfg, data, prep = ctx.config, ctx.data, ctx.base.preprocessing
    n = min(cfg.hydra.calib_samples, len(data.train.labels))
    cal_idx = sample_indices(len(data.train.labels), n, cfg.data.seed)
    calib = zero_shot_batches(take(data.train.inputs, cal_idx), data.train.labels[cal_idx], prep, prompts, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val = zero_shot_batches(take(data.val.inputs, np.arange(n_val)), data.val.labels[:n_val], prep, prompts, 256)
    ood_x = ood_sample(data.ood_val, n_val, cfg.data.seed)
    ood = zero_shot_batches(ood_x, np.zeros(len(ood_x), dtype=np.int64), prep, prompts, 256)
    return ScoringBatches.of(calib, val, ood)


# ----------------------------------------------------------------------------- the build
def build_zero_shot(cfg: BuildConfig, out: Path) -> Path:
    """Build the zero-shot artifact of ``cfg`` into ``out`` (see the module docstring) and return it."""
    torch.manual_seed(cfg.data.seed)
    timer = Timer()
    data = load_data(cfg)
    if data.modality != "image":
        raise ConfigError(f"family clip needs image data, got {data.modality} data")
    words = cfg.data.label_words
    if words and set(words) != set(data.class_names):
        extra, missing = sorted(set(words) - set(data.class_names)), sorted(set(data.class_names) - set(words))
        raise ConfigError(
            f"data.label_words must give a word for each class {list(data.class_names)}: "
            + "; ".join(p for p in (f"unknown {extra}" if extra else "", f"missing {missing}" if missing else "") if p)
        )
    timer.lap("data")
    ctx = BuildContext.create(cfg, Path(out), data, load_base_clip(cfg, data), timer)
    adapter, base = ctx.adapter, ctx.base.model
    assert isinstance(adapter, CLIPAdapter)
    heads = adapter.heads(base)
    check_budget(cfg, heads[: adapter.num_vision_layers(base)] if cfg.hydra.strategy == "taylor" else heads)
    timer.lap("base model")
    prompts = prompt_batch(ctx, data.class_names, lit.TEMPLATE)
    members = zero_shot_members(ctx, scoring_batches(ctx, prompts))
    if cfg.hydra.finetune_steps > 0:
        log.warning("hydra.finetune_steps is ignored for zero-shot builds: members are used without training")
    return finish_zero_shot(ctx, members, fuse_members(ctx, members), prompts)


def finish_zero_shot(ctx: BuildContext, members: Members, fused: Fused, prompts: Batch) -> Path:
    """Calibrate, evaluate, export and write the artifact; evaluation images go through the server's preprocessing
    (:func:`offline.stages.datasets.zero_shot_sets`), each batch with the label ``prompts``."""
    prepare_out(ctx)
    sets = zero_shot_sets(ctx, prompts)
    models = zero_shot_models(ctx, members, fused, prompts)
    with progress_stage("calibration"):
        cal = calibrate_zero_shot(ctx, fused, models.hydra.fn, sets)
        guarantees = zero_shot_guarantees(ctx, models.hydra.fn, cal, sets)
    ctx.timer.lap("calibration")
    methods = zero_shot_methods(ctx, models, sets, cal.calibration.temperature)
    evaluation = evaluate_zero_shot(ctx, methods, sets, cal)
    if ctx.config.data.label_words:  # every row again, with the prompts of the user's words for the same classes
        words = [ctx.config.data.label_words[c] for c in ctx.data.class_names]
        alt = zero_shot_models(ctx, members, fused, prompt_batch(ctx, words, lit.TEMPLATE))
        alt_methods = zero_shot_methods(ctx, alt, sets, cal.calibration.temperature)
        evaluation.rows += [
            {**r, "method": f"{r['method']}@words"} for r in evaluate_zero_shot(ctx, alt_methods, sets, cal).rows
        ]
        evaluation.extra["label_words"] = dict(zip(ctx.data.class_names, words, strict=True))
    guarantees = zero_shot_guarantees_report(ctx, methods["hydra"], cal, sets, guarantees)
    save_weights(ctx.out, fused.model, cal.calibration, guarantees.fitted)
    exports = export_zero_shot(ctx, fused, cal.calibration, sets, prompts)
    t_single = methods["single_ts"].temperature
    return write_zero_shot(ctx, members, fused, cal, evaluation, guarantees, exports, t_single)


def write_zero_shot(
    ctx: BuildContext,
    pruned: Members,
    fusion: Fused,
    calibrated: ZeroShotCalibration,
    evaluation: Evaluation,
    fitted: Guarantees,
    checked: Exports,
    t_single: float,
) -> Path:
    """The report, then the manifest of a zero-shot artifact (:func:`offline.stages.package.write_artifact`);
    ``t_single``: the base model's own temperature (the report's ``single_ts`` row)."""
    cfg, data, adapter, timer = ctx.config, ctx.data, ctx.adapter, ctx.timer
    base, prep, base_desc = ctx.base.model, ctx.base.preprocessing, ctx.base.description
    members, strategy, fcfg, cal = pruned.models, pruned.strategy, fusion.config, calibrated.calibration
    exports, precision, guarantees = checked.exports, checked.precision, fitted.fitted

    def manifest(metrics: dict[str, Any]) -> Manifest:
        return Manifest(
            name=cfg.name,
            family="clip",
            task="zero-shot",
            base_model=base_desc,
            members=len(members),
            heads=[split_heads(base, adapter.kept_heads(m)) for m in members],
            head_index=HEAD_INDEX,
            strategy=strategy,
            labels=list(data.class_names),
            zero_shot={
                "template": lit.TEMPLATE,
                "logit_scale": fcfg["logit_scale"],
                "logit_bias": fcfg["logit_bias"],
                "embed_dim": fcfg["embed_dim"],
            },
            preprocessing=prep,
            uncertainty=cal.uncertainty(),
            model=model_spec(fcfg, cal),
            exports=exports,
            precision=precision,
            metrics=metrics,
            data=data.splits,
            build=provenance(cfg, timer),
            ood=label_free_spec(cal, data),
            guarantees=guarantees.spec if guarantees is not None else None,
        )

    title = f"{cfg.name}: zero-shot Hydra ({strategy['name']}, M={len(members)})"
    return write_artifact(ctx, manifest, evaluation, title, zero_shot_extra(ctx, calibrated, t_single, fitted))
