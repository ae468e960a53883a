"""The evaluation stage: every model of the report (the base model, each member, fused Hydra, the unfused ensemble
and, with ``base.deep_ensemble``, the Deep Ensemble) run on every evaluation set, and the report's rows.

Each model is a :class:`Method`: how to run it on a batch, its size, the temperature its main row is scored at, and
its outputs on every set (``runs``). A row holds the metrics of
:func:`offline.method.ensemble_metrics.evaluate_predictions`, the
method at its own fitted temperature, every OOD score's detection with the method's own statistics, its size and
its latency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from offline.data.foreign import foreign_images
from offline.method.calibration import fit_temperature
from offline.method.ensemble_metrics import evaluate_predictions
from offline.method.ood_fit import (
    LayerChoice,
    Run,
    detection,
    fit_layer_stats,
    fit_ood_stats,
    flag_rate,
    member_agreement,
    scores_np,
)
from offline.method.ood_fit import with_layers as with_layer_stats
from offline.report import measure_latency
from offline.stages.calibrate import Calibration, ZeroShotCalibration
from offline.stages.context import BuildContext
from offline.stages.datasets import Batch, EvalSets, ZeroShotSets, collect, collect_logits, with_features
from offline.stages.ensemble import Fused, Members
from offline.stages.shift_eval import shift_metrics
from service.core.fused_clip import zero_shot_logits
from service.core.ood import OODStats
from service.core.progress import bar as progress_bar
from service.core.uncertainty import SUMMARY_SCORES, ood_flag

__all__ = [
    "Evaluation",
    "Method",
    "Models",
    "Outputs",
    "classifier_models",
    "evaluate",
    "evaluate_classifier",
    "evaluate_zero_shot",
    "joined",
    "method_stats",
    "n_params",
    "served_flag",
    "standard_methods",
    "zero_shot_methods",
    "zero_shot_models",
]

Outputs = tuple[torch.Tensor, dict[str, torch.Tensor]]  # member logits (N, M, C) on ID test, per OOD test set


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@dataclass
class Method:
    """One row of the report: how to run it on a batch, its size, the temperature its main row is scored at, and its
    outputs on every evaluation set (``runs``: set name -> logits and, when it has them, features)."""

    fn: Callable[[Batch], Any]  # batch -> logits (B, C) or (B, M, C), or (logits, features); a list for an ensemble
    params: int
    temperature: float = 1.0
    runs: dict[str, Run] = field(default_factory=dict, repr=False)

    @property
    def outputs(self) -> Outputs:
        """Logits on ID test and on each OOD test set."""
        ood = {k[4:]: v[0] for k, v in self.runs.items() if k.startswith("ood:")}
        return self.runs["test"][0], ood


@dataclass
class Models:
    """The models every build reports, each a :class:`Method` not yet run: the base model, each member, fused Hydra
    (at its served temperature) and the Deep Ensemble's other base models (``base.deep_ensemble``), if any."""

    single: Method
    members: list[Method]
    hydra: Method
    others: list[Method] = field(default_factory=list)
    baselines: dict[str, Method] = field(default_factory=dict)  # base.baselines (offline.pipelines.baselines), by name


@dataclass
class Evaluation:
    """The report's part of a build: one row per method, the plots' data, and the served flag on the test sets."""

    rows: list[dict[str, Any]]
    plots: dict[str, Any]
    served: dict[str, Any] | None  # the served OOD flag on the test sets (None: a zero-shot probability score)
    extra: dict[str, Any] = field(default_factory=dict)  # more facts the report shows next to its tables
    shift: dict[str, Any] = field(default_factory=dict)  # per method, its figures on each shifted copy (shift_metrics)


# ----------------------------------------------------------------------------- running every method
def standard_methods(models: Models, sets: EvalSets) -> dict[str, Method]:
    """The rows every build reports, with their runs on every set of ``sets``: the base model, each member, fused
    Hydra and the unfused ensemble of the same members (their outputs concatenated); with ``models.others`` (more
    base models, trained like the first), the Deep Ensemble of the base and them; then the baselines, by name."""
    methods = {"single": models.single}
    for i, m in enumerate(models.members):
        methods[f"member_{i}"] = m
    methods["hydra"] = models.hydra
    methods.update(models.baselines)
    extra = models.others
    named = sets.named()
    with progress_bar(desc="evaluation (methods x sets)", total=(len(methods) + len(extra)) * len(named)) as bar:
        for m in [*methods.values(), *extra]:
            m.runs = {}
            for name, batches in named.items():
                m.runs[name] = collect(m.fn, batches)
                bar.update(1)
    member_fns = [m.fn for m in models.members]
    methods["ensemble_unfused"] = Method(
        lambda b: [f(b) for f in member_fns],
        sum(m.params for m in models.members),
        runs=joined([m.runs for m in models.members]),
    )
    if extra:
        single = models.single
        methods["deep_ensemble"] = Method(
            lambda b: [single.fn(b)] + [m.fn(b) for m in extra],
            single.params + sum(m.params for m in extra),
            runs=joined([single.runs] + [m.runs for m in extra]),
        )
    return methods


def joined(runs: list[dict[str, Run]]) -> dict[str, Run]:
    """Several models' runs as one ensemble's: logits ``(N, M, C)``, features ``(N, M, D)`` and layer features
    ``(N, M, L-1, d)`` concatenated along the member axis, set by set."""

    def cat(name: str, i: int) -> torch.Tensor | None:
        return torch.cat([r[name][i] for r in runs], dim=1) if runs[0][name][i] is not None else None

    return {name: (torch.cat([r[name][0] for r in runs], dim=1), cat(name, 1), cat(name, 2)) for name in runs[0]}


def classifier_models(
    ctx: BuildContext,
    bases: Sequence[nn.Module],
    members: Members,
    fused: Fused,
    baselines: dict[str, tuple[Callable[[Batch], Any], int]] | None = None,
) -> Models:
    """A classifier build's models on the evaluation device (``build.device``, under ``build.eval_precision``): each
    single model with its penultimate and layer features (:func:`offline.stages.datasets.with_features`), the fused
    model as served. ``bases``: the base model, then the Deep Ensemble's others; ``baselines``: name -> (batch ->
    outputs, parameters) (:func:`offline.pipelines.baselines.baseline_methods`)."""
    ev, adapter = ctx.evaluation, ctx.adapter
    run = ev.wrap if ev.cuda or ev.precision != "fp32" else (lambda f: f)

    def hooked(m: nn.Module) -> Method:  # logits, penultimate and layer features of a single (timm / HF) model
        return Method(run(with_features(lambda b: adapter.forward(m, b), m, adapter.layer_modules(m))), n_params(m))

    hydra = Method(run(lambda b: fused.model(**b)), n_params(fused.model))
    others = [hooked(m) for m in bases[1:]]
    extra = {name: Method(run(fn), params) for name, (fn, params) in (baselines or {}).items()}
    return Models(hooked(bases[0]), [hooked(m) for m in members.models], hydra, others, extra)


def zero_shot_models(ctx: BuildContext, members: Members, fused: Fused, prompts: Batch) -> Models:
    """A zero-shot build's models: batch -> zero-shot logits of the build's labels, the label prompts embedded once
    as the server does."""
    adapter, base, model = ctx.adapter, ctx.base.model, fused.model
    with torch.inference_mode():
        text_emb = model.encode_text(prompts["input_ids"], prompts["attention_mask"])  # (L, M, D)
        text_feats = {id(m): adapter.encode_text(m, prompts) for m in [base, *members.models]}  # (L, D) each

    def fused_fn(b: Batch) -> torch.Tensor:
        return zero_shot_logits(
            model.encode_image(b["pixel_values"]), text_emb, model.logit_scale.exp(), model.logit_bias
        )

    def single(m: nn.Module) -> Method:
        return Method(lambda b: adapter.logits(m, adapter.encode_image(m, b), text_feats[id(m)]), n_params(m))

    return Models(single(base), [single(m) for m in members.models], Method(fused_fn, n_params(model)))


def zero_shot_methods(ctx: BuildContext, models: Models, sets: ZeroShotSets, temperature: float) -> dict[str, Method]:
    """Every method of a zero-shot build run on ID test and the OOD test sets, Hydra at the served ``temperature``;
    and the base model at its own temperature fitted on validation (``single_ts``): a baseline for the ensemble's
    calibration."""
    models.hydra.temperature = temperature
    methods = standard_methods(models, sets.evaluation())
    single = methods["single"]
    val_y = torch.cat([y for _, y in sets.val])
    t_single = (
        fit_temperature(collect_logits(single.fn, sets.val), val_y) if ctx.config.calibration.temperature else 1.0
    )
    methods["single_ts"] = Method(single.fn, single.params, t_single, runs=single.runs)
    return methods


# ----------------------------------------------------------------------------- the report's rows
def calibrated_metrics(m: Method, y_val: torch.Tensor, y_test: np.ndarray) -> dict[str, float]:
    """The method at its own temperature fitted on ID validation: ``temperature`` and the ID metrics there."""
    T = fit_temperature(m.runs["val"][0], y_val)
    probs = torch.softmax(m.runs["test"][0] / T, -1).numpy()
    metrics = evaluate_predictions(probs, y_test, {})
    return {
        "temperature": T,
        **{k: v for k, v in metrics.items() if k in ("acc", "nll", "brier", "ece", "aece", "aurc")},
    }


def method_stats(
    m: Method, y_fit: torch.Tensor, y_val: torch.Tensor, classes: int, layers: LayerChoice | None = None
) -> tuple[float, OODStats | None]:
    """The method's own temperature (fitted on ID validation) and OOD statistics (Gaussians on the fit split, norms
    on validation; ``layers``: what ``mahalanobis_layers`` reads and how, Hydra's): the same treatment as Hydra's."""
    (val_l, val_f, val_layers), (_, fit_f, fit_layers) = m.runs["val"], m.runs["fit"]
    T = fit_temperature(val_l, y_val)
    stats = fit_ood_stats(fit_f, y_fit, classes, val_l, val_f, T) if fit_f is not None else None
    if stats is not None and layers and fit_layers is not None and val_layers is not None:
        val_md = torch.from_numpy(scores_np((val_l, val_f, None), stats, T)["mahalanobis"])
        reduce = layers.reduce if val_layers.shape[1] > 1 else "max"  # one member: its largest column
        fitted = fit_layer_stats(
            fit_layers, y_fit, classes, val_layers, val_md, layers.ids, reduce, label_free=layers.label_free
        )
        stats = with_layer_stats(stats, fitted)
    return T, stats


def ood_detection(
    m: Method, y_fit: torch.Tensor, y_val: torch.Tensor, classes: int, layers: LayerChoice | None = None
) -> dict[str, Any]:
    """Every OOD score of the method (:func:`method_stats`) and its detection quality per OOD test set: Single and
    the members with the same scores as Hydra."""
    T, stats = method_stats(m, y_fit, y_val, classes, layers)
    id_scores = scores_np(m.runs["test"], stats, T)
    ood = {k[4:]: scores_np(v, stats, T) for k, v in m.runs.items() if k.startswith("ood:")}
    return detection(id_scores, ood)


def evaluate(
    methods: dict[str, Method],
    sets: EvalSets,
    y_test: np.ndarray,
    ood_kinds: dict[str, str],
    metric: str,
    latency: tuple[Batch, Batch],
    classes: int | None = None,
    layers: LayerChoice | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Report rows and the plots' data. Each row: the metrics at the method's temperature (scored with the probability
    score ``metric``), size, latency on the ``latency`` batches of 1 and 8 inputs; with validation outputs also the
    method at its own fitted temperature (``calibrated``), and with fit outputs every OOD score's detection
    (``ood_scores``)."""
    one, eight = latency
    rows = []
    plots: dict[str, Any] = {"labels": y_test, "ood_kinds": ood_kinds}
    for name, m in methods.items():
        logits, ood_logits = m.outputs
        probs = torch.softmax(logits / m.temperature, -1).numpy()
        ood_probs = {n: torch.softmax(v / m.temperature, -1).numpy() for n, v in ood_logits.items()}
        row = {"method": name, **evaluate_predictions(probs, y_test, ood_probs, ood_score=metric)}
        row["temperature"] = m.temperature
        if sets.val is not None:
            row["calibrated"] = calibrated_metrics(m, sets.labels("val"), y_test)
        if sets.fit is not None and sets.val is not None and classes is not None:
            row["ood_scores"] = ood_detection(m, sets.labels("fit"), sets.labels("val"), classes, layers)
        row["params"] = m.params
        row["latency_ms"] = {
            "batch1": measure_latency(lambda f=m.fn: f(one)),
            "batch8": measure_latency(lambda f=m.fn: f(eight)),
        }
        rows.append(row)
        plots[name] = {"member_probs_id": probs, "member_probs_ood": ood_probs}
    return rows, plots


def ood_flag_np(scores: np.ndarray, metric: str, threshold: float) -> np.ndarray:
    """The served flag ``(N,)`` bool of scores ``(N,)`` (:func:`service.core.uncertainty.ood_flag`)."""
    return ood_flag(torch.from_numpy(np.asarray(scores, dtype=np.float64)), metric, threshold).numpy()


def served_flag(hydra: Method, cal: Calibration) -> tuple[dict[str, Any], dict[str, Any]]:
    """The served flag on test data, as fixed on validation: ``(report record, plot data)`` with the ID test flag
    rate (false alarms) and the recall on each OOD test set."""
    tested = {k: v for k, v in hydra.runs.items() if k == "test" or k.startswith("ood:") or k.startswith("foreign")}
    score = {name: scores_np(run, cal.stats, cal.temperature)[cal.metric] for name, run in tested.items()}
    ood = {k[4:]: v for k, v in score.items() if k.startswith("ood:")}
    record = {
        "score": cal.metric,
        "threshold": cal.threshold,
        "id_test_flag_rate": flag_rate(score["test"], cal.metric, cal.threshold),
        "recall": {k: flag_rate(v, cal.metric, cal.threshold) for k, v in ood.items()},
    }
    if "foreign" in score:  # per input, in the set's order (the caller groups them by kind)
        record["foreign"] = ood_flag_np(score["foreign"], cal.metric, cal.threshold).tolist()
    return record, {"score": cal.metric, "threshold": cal.threshold, "id": score["test"], "ood": ood}


# ----------------------------------------------------------------------------- the stage, per task
def evaluate_classifier(ctx: BuildContext, methods: dict[str, Method], sets: EvalSets, cal: Calibration) -> Evaluation:
    """A classifier's report rows and plots, scored with the served probability score (MSP unless the served score
    is one), the served flag on the test sets (per kind of the foreign-image set) and how alike the members' OOD
    scores are (``member_rank_correlation_ood``)."""
    data, hydra = ctx.data, methods["hydra"]
    ood_kinds = {name: kind for name, (_, kind) in data.ood_test.items()}
    metric = cal.metric if cal.metric in SUMMARY_SCORES else "msp"  # the main rows' score: a probability score
    latency = ({k: v[:1] for k, v in sets.latency.items()}, sets.latency)
    classes = len(data.class_names)
    rows, plots = evaluate(methods, sets, sets.test_labels, ood_kinds, metric, latency, classes, cal.layers)
    served, plots["served"] = served_flag(hydra, cal)
    ood_all = [hydra.runs[k] for k in hydra.runs if k.startswith("ood:")]
    agreement: dict[str, float] = {}
    if ood_all:
        logits, features = torch.cat([r[0] for r in ood_all]), torch.cat([r[1] for r in ood_all])
        agreement = member_agreement(logits, features, cal.stats, cal.temperature)
    if sets.foreign:  # the served flag per kind of the foreign-image set
        kinds = [f.kind for f in foreign_images()]
        flags = served["foreign"]
        served["foreign_by_kind"] = {
            k: float(np.mean([f for f, kk in zip(flags, kinds, strict=True) if kk == k])) for k in dict.fromkeys(kinds)
        }
        served["foreign"] = float(np.mean(flags))
    ctx.timer.lap("evaluation")
    return Evaluation(rows, plots, served, {"member_rank_correlation_ood": agreement}, shift_metrics(methods, sets))


def evaluate_zero_shot(
    ctx: BuildContext, methods: dict[str, Method], sets: ZeroShotSets, cal: ZeroShotCalibration
) -> Evaluation:
    """A zero-shot build's report rows and plots, scored with the served probability score (MSP unless the served
    score is one); latency is the image side's per call (the label prompts are embedded once)."""
    example = sets.test[0][0]
    one, eight = ({**example, "pixel_values": example["pixel_values"][:k]} for k in (1, 8))
    ood_kinds = {name: kind for name, (_, kind) in ctx.data.ood_test.items()}
    served = cal.calibration.metric
    metric = served if served in SUMMARY_SCORES else "msp"  # the main rows' score: a probability score
    rows, plots = evaluate(methods, sets.evaluation(), ctx.data.test.labels, ood_kinds, metric, (one, eight))
    ctx.timer.lap("evaluation")
    return Evaluation(rows, plots, cal.served)
