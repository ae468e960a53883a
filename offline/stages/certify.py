"""The guarantees stage: the served model's guarantees fitted on the calibration split
(:mod:`offline.method.guarantee_fits`:
prediction sets, OOD p-values, answers with a risk bound, the drift alarm's reference) and the report's section of
them. Without a calibration split there are none."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from offline.method.calibration import calibrate_threshold
from offline.method.corruptions import SHIFT_PREFIX
from offline.method.guarantee_fits import CalibrationOutputs, Fitted, evaluate_guarantees, fit_guarantees
from offline.method.ood_fit import LAYERS, Run, scores_np
from offline.stages.calibrate import Calibration, ZeroShotCalibration
from offline.stages.context import BuildContext
from offline.stages.datasets import Batch, EvalSets, ZeroShotSets, collect_logits
from offline.stages.evaluation import Method, method_stats
from service.core.progress import stage as progress_stage
from service.core.uncertainty import summarize

__all__ = [
    "Guarantees",
    "classifier_guarantees",
    "served_outputs",
    "zero_shot_guarantees",
    "zero_shot_guarantees_report",
]


@dataclass
class Guarantees:
    """The served model's fitted guarantees (``guarantees.safetensors``, the manifest's block) and the report's
    section; both None without a calibration split."""

    fitted: Fitted | None = None
    report: dict[str, Any] | None = None
    outputs: dict[str, CalibrationOutputs] = field(default_factory=dict)  # the served answers it was fitted on


# ----------------------------------------------------------------------------- classifiers
def classifier_guarantees(
    ctx: BuildContext, methods: dict[str, Method], cal: Calibration, sets: EvalSets
) -> Guarantees:
    """The served model's guarantees (fitted on the calibration split; the candidate thresholds and drift bins from
    validation) and the report's section: every method with its own temperature and its own statistics of the
    served score's family, its own OOD threshold on validation."""
    if not sets.calibration:
        return Guarantees()
    g = ctx.config.guarantees
    hydra = methods["hydra"]
    record = ctx.data.splits.get("id", {}).get("calibration", {})
    cal_outs = served_outputs(hydra.runs["calibration"], cal, sets.labels("calibration"))
    fitted = fit_guarantees(
        g, cal_outs, served_outputs(hydra.runs["val"], cal, sets.labels("val")), cal.metric, cal.threshold, record
    )
    with progress_stage("guarantees (every method, drift simulations)"):
        by_method, thresholds = _every_method(ctx, methods, cal, sets)
        report = evaluate_guarantees(g, by_method, thresholds, cal.metric)
    ctx.timer.lap("guarantees (every method, drift simulations)")
    return Guarantees(fitted, report)


def _every_method(
    ctx: BuildContext, methods: dict[str, Method], cal: Calibration, sets: EvalSets
) -> tuple[dict[str, dict[str, CalibrationOutputs]], dict[str, float]]:
    """Every method's answers on the calibration split, validation, ID test, each OOD test set and each shifted copy
    of ID test inputs, at its own temperature with its own OOD statistics (Hydra: the served ones), and its OOD
    threshold on validation."""
    layers = cal.layers if cal.metric == LAYERS else None
    names = ["calibration", "val", "test", *(n for n in sets.named() if n.startswith(("ood:", SHIFT_PREFIX)))]
    classes = len(ctx.data.class_names)
    by_method, thresholds = {}, {}
    for name, m in methods.items():
        if name == "ensemble_unfused":  # Hydra's members unfused: the same numbers as Hydra's up to the MLP merge
            continue
        if name == "hydra":
            T, stats = cal.temperature, cal.stats
        else:
            T, stats = method_stats(m, sets.labels("fit"), sets.labels("val"), classes, layers)
        outs = {}
        for n in names:
            run = m.runs[n]
            labels = sets.labels(n).numpy() if not n.startswith("ood:") else np.zeros(len(run[0]), dtype=np.int64)
            probs = summarize(run[0], T)["probs"].double().numpy()
            outs[n] = CalibrationOutputs(probs, labels, scores_np(run, stats, T)[cal.metric])
        by_method[name] = outs
        if name == "hydra":
            thresholds[name] = cal.threshold
        else:
            thresholds[name] = calibrate_threshold(outs["val"].ood_score, cal.metric, tpr=ctx.config.calibration.tpr)
    return by_method, thresholds


def served_outputs(run: Run, cal: Calibration, labels: torch.Tensor) -> CalibrationOutputs:
    """The served model's answer on one split: ensemble probabilities at the served temperature, the served OOD
    score, the labels (what the guarantees are fitted and checked on)."""
    probs = summarize(run[0], cal.temperature)["probs"].double().numpy()
    return CalibrationOutputs(probs, labels.numpy(), scores_np(run, cal.stats, cal.temperature)[cal.metric])


# ----------------------------------------------------------------------------- zero-shot models
def zero_shot_guarantees(
    ctx: BuildContext, fused_fn: Callable[[Batch], torch.Tensor], cal: ZeroShotCalibration, sets: ZeroShotSets
) -> Guarantees:
    """The guarantees of a zero-shot model on the calibration split: sets and risk rules for the build's labels and
    template, OOD p-values of the served score (label-free unless a probability score is forced). Keeps the served
    answers on ``calibration`` and ``val`` (the report's)."""
    if sets.calibration is None:
        return Guarantees()
    outs = {
        name: zero_shot_outputs(collect_logits(fused_fn, batches), torch.cat([y for _, y in batches]), cal, name)
        for name, batches in (("calibration", sets.calibration), ("val", sets.val))
    }
    c = cal.calibration
    record = ctx.data.splits.get("id", {}).get("calibration", {})
    fitted = fit_guarantees(
        ctx.config.guarantees,
        outs["calibration"],
        outs["val"],
        c.metric,
        c.threshold,
        record,
        label_free=cal.scores is not None,
    )
    return Guarantees(fitted, outputs=outs)


def zero_shot_outputs(
    logits: torch.Tensor, labels: torch.Tensor, cal: ZeroShotCalibration, name: str
) -> CalibrationOutputs:
    """The served answer on one set: probabilities of the build's labels at the served temperature, the served OOD
    score (the label-free score of set ``name``, or the probability score of ``logits``), the labels."""
    c = cal.calibration
    s = summarize(logits, c.temperature)
    score = cal.scores[name][c.selected] if cal.scores is not None else s[c.metric].double().numpy()
    return CalibrationOutputs(s["probs"].double().numpy(), labels.numpy(), np.asarray(score, dtype=np.float64))


def zero_shot_guarantees_report(
    ctx: BuildContext, hydra: Method, cal: ZeroShotCalibration, sets: ZeroShotSets, guarantees: Guarantees
) -> Guarantees:
    """The report's guarantees section of a zero-shot build
    (:func:`offline.method.guarantee_fits.evaluate_guarantees`), for
    the served model alone: the build's labels and template, its served score on the calibration split, ID test and
    each OOD test set. (Single and the members have no label-free statistics of their own to compare like with
    like.)"""
    if guarantees.fitted is None:
        return guarantees
    outs = dict(guarantees.outputs)
    outs["test"] = zero_shot_outputs(hydra.runs["test"][0], torch.cat([y for _, y in sets.test]), cal, "test")
    for name, run in hydra.runs.items():
        if name.startswith("ood:"):
            outs[name] = zero_shot_outputs(run[0], torch.zeros(len(run[0]), dtype=torch.int64), cal, name)
    c = cal.calibration
    with progress_stage("guarantees (drift simulations)"):
        report = evaluate_guarantees(ctx.config.guarantees, {"hydra": outs}, {"hydra": c.threshold}, c.metric)
    ctx.timer.lap("guarantees (drift simulations)")
    return dataclasses.replace(guarantees, report=report)
