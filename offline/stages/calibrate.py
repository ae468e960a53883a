"""The calibration stage: the served ensemble's temperature and OOD score and threshold, fitted on validation data
only (:mod:`offline.method.calibration`, :mod:`offline.method.ood_fit`).

A classifier's score is chosen among the probability, logit and feature scores (:func:`calibrate_ood`); a zero-shot
model's is a probability score (:func:`calibrate`) or, by default, the label-free distance of its image embeddings
to the ID images (:func:`calibrate_label_free`), since a request brings its own labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from offline.config import BuildConfig
from offline.data.foreign import foreign_images
from offline.method.calibration import calibrate_threshold, fit_temperature
from offline.method.ood_fit import (
    LAYERS,
    LayerChoice,
    Run,
    background_stats,
    base_score,
    columns_of,
    fit_layer_stats,
    fit_ood_stats,
    flag_rate,
    label_free_scores,
    layer_candidate_name,
    layer_candidate_scores,
    layer_columns,
    parse_layer_candidate,
    restrict_layers,
    scores_np,
    select_score,
    with_layers,
)
from offline.stages.context import BuildContext
from offline.stages.datasets import (
    Batch,
    Batches,
    EvalSets,
    ZeroShotSets,
    collect,
    collect_logits,
    eval_batches,
    unlabelled,
)
from offline.stages.ensemble import Fused
from service.core.manifest import Uncertainty
from service.core.ood import LayerStats, OODStats, mahalanobis, standardize
from service.core.uncertainty import SUMMARY_SCORES, summarize
from service.core.uncertainty import ood_score as ood_score_of

__all__ = [
    "Calibration",
    "ImageRun",
    "ZeroShotCalibration",
    "best_layers",
    "calibrate",
    "calibrate_label_free",
    "calibrate_ood",
    "calibrate_zero_shot",
    "forced_score",
    "image_feature_runs",
    "layer_candidate_name",
    "served_label_free",
]


@dataclass
class Calibration:
    """The served ensemble's temperature and OOD score and threshold, fitted on validation data only."""

    temperature: float
    metric: str  # the served OOD score
    threshold: float
    tpr: float  # share of ID validation inputs the threshold lets through
    ood_val_flagged: float  # mean share of the OOD validation sets it flags
    stats: OODStats | None = None  # the statistics of the logit and feature scores (classifiers)
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)  # every score's validation figures
    forced: bool = False  # the config named the score
    selected: str = ""  # the candidate served (metric, or mahalanobis_layers@<ids>[:<reduce>])
    layers: LayerChoice | None = None  # what mahalanobis_layers reads and how: served, else the best candidate's

    def uncertainty(self) -> Uncertainty:
        """The manifest's ``uncertainty`` block, typed."""
        return Uncertainty(
            temperature=self.temperature, ood_score=self.metric, ood_threshold=self.threshold, tpr=self.tpr
        )


def forced_score(cfg: BuildConfig) -> str | None:
    """``calibration.ood_score`` when it names a score; None for ``auto`` (selected on the OOD validation sets)."""
    return None if cfg.calibration.ood_score == "auto" else cfg.calibration.ood_score


def best_layers(candidates: dict[str, dict[str, Any]], selected: str) -> LayerChoice | None:
    """The layer set and reduction of the served candidate when it is ``mahalanobis_layers``, else the best layer
    candidate's on validation (the report shows what the layers would give); None without layer candidates."""
    if base_score(selected) == LAYERS:
        return parse_layer_candidate(selected)
    names = [n for n in candidates if base_score(n) == LAYERS]
    if not names:
        return None
    return parse_layer_candidate(max(names, key=lambda n: (candidates[n]["val_mean_recall"] or 0.0, -names.index(n))))


def _served(
    cfg: BuildConfig,
    temperature: float,
    id_val: dict[str, np.ndarray],
    ood_val: dict[str, dict[str, np.ndarray]],
    stats: OODStats | None,
    layers: dict[bool, LayerStats] | None,
) -> Calibration:
    """The served score among every candidate's validation scores (``id_val``; ``ood_val`` per OOD validation set):
    the best mean recall unless the config names one; a ``mahalanobis_layers`` candidate serves the statistics of its
    layers out of ``layers`` (:class:`service.core.ood.LayerStats` of every layer, by whether label-free)."""
    forced = forced_score(cfg)
    selected, candidates = select_score(id_val, ood_val, cfg.calibration.tpr, forced)
    metric = base_score(selected)
    choice = best_layers(candidates, selected)
    if metric == LAYERS and layers is not None and stats is not None and choice is not None:
        stats = with_layers(stats, restrict_layers(layers[choice.label_free], choice.ids, choice.reduce))
    c = candidates[selected]
    recall = c["val_mean_recall"] or 0.0
    tpr = cfg.calibration.tpr
    return Calibration(
        temperature, metric, c["threshold"], tpr, recall, stats, candidates, forced is not None, selected, choice
    )


# ----------------------------------------------------------------------------- classifiers
def calibrate_ood(ctx: BuildContext, fn: Callable[[Batch], Any], runs: dict[str, Run], sets: EvalSets) -> Calibration:
    """The served score of a classifier: temperature on ID validation, the OOD statistics (Gaussians on the fit
    split's features, norms on validation), every score's threshold at ``calibration.tpr`` and recall on each OOD
    validation set; the best mean recall is served unless the config names a score. ``fn``, ``runs``: the fused
    model and its outputs on ``sets`` (validation and the fit split are read; the OOD validation sets are run here).
    With layer features every layer set of :func:`offline.method.ood_fit.layer_candidates` is a ``mahalanobis_layers``
    candidate of its own."""
    cfg, classes = ctx.config, len(ctx.data.class_names)
    hydra, fit, y_fit = runs["val"], runs["fit"], sets.labels("fit")
    ood_val = {name: collect(fn, b) for name, b in sets.ood_val.items()}
    val_l, val_f, val_layers = hydra
    T = fit_temperature(val_l, sets.labels("val")) if cfg.calibration.temperature else 1.0
    stats = fit_ood_stats(fit[1], y_fit, classes, val_l, val_f, T) if fit[1] is not None else None
    id_val = scores_np((val_l, val_f, None), stats, T)
    ood = {name: scores_np((run[0], run[1], None), stats, T) for name, run in ood_val.items()}
    full: dict[bool, LayerStats] | None = None
    if stats is not None and val_layers is not None and fit[2] is not None and val_layers.shape[2] > 0:
        val_md = torch.from_numpy(id_val["mahalanobis"])
        full = {f: fit_layer_stats(fit[2], y_fit, classes, val_layers, val_md, label_free=f) for f in (False, True)}
        for free, layers in full.items():
            id_val |= layer_candidate_scores(layer_columns(hydra, stats, layers, T), layers, free)
            for name, run in ood_val.items():
                ood[name] |= layer_candidate_scores(layer_columns(run, stats, layers, T), layers, free)
    return _served(cfg, T, id_val, ood, stats, full)


# ----------------------------------------------------------------------------- zero-shot models
def calibrate(
    cfg: BuildConfig, fused_fn: Callable[[Batch], torch.Tensor], val: Batches, ood_val: Batches
) -> Calibration:
    """Probability scores only (zero-shot): temperature of the fused ensemble on ID validation data, then the OOD
    threshold at ``calibration.tpr`` (``auto``: MSP)."""
    val_logits = collect_logits(fused_fn, val)
    val_y = torch.cat([y for _, y in val])
    T = fit_temperature(val_logits, val_y) if cfg.calibration.temperature else 1.0
    metric = forced_score(cfg) or "msp"  # a probability score: offline.config refuses the others for zero-shot
    id_scores = ood_score_of(summarize(val_logits, T), metric).numpy()
    threshold = calibrate_threshold(id_scores, metric, tpr=cfg.calibration.tpr)
    flagged = 0.0
    if ood_val:  # a user's data may have no OOD inputs
        ood_scores = ood_score_of(summarize(collect_logits(fused_fn, ood_val), T), metric).numpy()
        flagged = flag_rate(ood_scores, metric, threshold)
    return Calibration(T, metric, threshold, cfg.calibration.tpr, flagged, forced=forced_score(cfg) is not None)


ImageRun = tuple[torch.Tensor, torch.Tensor | None]  # image embeddings (N, M, D), layer features (N, M, L-1, d)


@dataclass
class ZeroShotCalibration:
    """A zero-shot model's calibration, and with the label-free score (the default) every candidate's scores on every
    set of :func:`image_feature_runs` and the served flag on the test sets (the report's)."""

    calibration: Calibration
    scores: dict[str, dict[str, np.ndarray]] | None = None  # None: a probability score is served
    served: dict[str, Any] | None = None


def calibrate_zero_shot(
    ctx: BuildContext, fused: Fused, fused_fn: Callable[[Batch], torch.Tensor], sets: ZeroShotSets
) -> ZeroShotCalibration:
    """The temperature on ID validation (``fused_fn``: batch -> the fused model's zero-shot logits), then the served
    score: the label-free distance unless the config forces a probability score (:func:`calibrate_label_free`)."""
    cal = calibrate(ctx.config, fused_fn, sets.val, sets.ood_val)
    if forced_score(ctx.config) in SUMMARY_SCORES:
        return ZeroShotCalibration(cal)
    runs = image_feature_runs(ctx, fused.model, sets)
    cal, scores = calibrate_label_free(ctx.config, cal.temperature, runs)
    return ZeroShotCalibration(cal, scores, served_label_free(cal, scores))


@torch.inference_mode()
def image_feature_runs(ctx: BuildContext, fused: nn.Module, sets: ZeroShotSets) -> dict[str, ImageRun]:
    """The fused image tower's embeddings and layer features on every set: ``fit`` (the statistics), ``val`` (their
    norms, the thresholds), ``oodval:<name>`` (selection), ``test``, ``ood:<name>`` and ``foreign`` (the report)."""
    data, pre = ctx.data, sets.pre
    named: dict[str, Batches] = {
        "fit": eval_batches(pre, data.fit_split.inputs, data.fit_split.labels)[0],
        "val": sets.val,
        "test": sets.test,
        **{f"ood:{n}": b for n, b in sets.ood_test.items()},
        **{f"oodval:{n}": unlabelled(pre, x) for n, x in data.ood_val.items()},
    }
    if sets.calibration is not None:
        named["calibration"] = sets.calibration
    named["foreign"] = unlabelled(pre, [f.pixels for f in foreign_images()], sort=False)
    out = {}
    for name, batches in named.items():
        parts = [fused.image_features(b["pixel_values"]) for b, _ in batches]
        layers = [p[1] for p in parts]
        embeddings = torch.cat([p[0] for p in parts]).float()
        out[name] = (embeddings, torch.cat(layers).float() if layers and layers[0] is not None else None)
    return out


def calibrate_label_free(
    cfg: BuildConfig, temperature: float, runs: dict[str, ImageRun]
) -> tuple[Calibration, dict[str, dict[str, np.ndarray]]]:
    """The served OOD score of a zero-shot model: label-free, since the labels come with each request. One Gaussian
    per member of the ID images' embeddings (the fit split), ``mahalanobis`` the distance to it; the image tower's
    layers as :func:`calibrate_ood` uses them (``mahalanobis_layers`` candidates); the threshold at
    ``calibration.tpr`` of ID validation images and the best mean recall over the OOD validation sets, as for the
    classifiers. The flag does not depend on the labels of a request. Also returns every candidate's scores on every
    set of ``runs`` (the report's)."""
    fit, val = runs["fit"], runs["val"]
    stats = background_stats(fit[0], val[0])
    scores = {name: {"mahalanobis": label_free_scores(emb, stats).numpy()} for name, (emb, _) in runs.items()}
    full = None
    if val[1] is not None and fit[1] is not None and val[1].shape[2] > 0:
        zeros = torch.zeros(fit[1].shape[0], dtype=torch.int64)
        full = fit_layer_stats(fit[1], zeros, 1, val[1], torch.from_numpy(scores["val"]["mahalanobis"]))
        for name, (emb, layers) in runs.items():
            last = standardize(mahalanobis(emb, stats.gaussians), *stats.norms["mahalanobis"])  # type: ignore[arg-type]
            scores[name] |= layer_candidate_scores(columns_of(last, layers, full), full)
    ood_val = {name[7:]: v for name, v in scores.items() if name.startswith("oodval:")}
    layers = None if full is None else {False: full}  # one Gaussian of the ID images already: no per-class variant
    return _served(cfg, temperature, scores["val"], ood_val, stats, layers), scores


def served_label_free(cal: Calibration, scores: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """The served label-free flag on the test sets (ID test: false alarms; each OOD test set and the foreign-image
    set per kind: recall), as the report's ``served_flag``; ``scores``: :func:`calibrate_label_free`'s."""
    score = {name: v[cal.selected] for name, v in scores.items()}
    kinds = [f.kind for f in foreign_images()]
    flags = np.asarray(score["foreign"]) > cal.threshold
    recall = {n[4:]: flag_rate(v, cal.metric, cal.threshold) for n, v in score.items() if n.startswith("ood:")}
    return {
        "score": cal.metric,
        "threshold": cal.threshold,
        "id_test_flag_rate": flag_rate(score["test"], cal.metric, cal.threshold),
        "recall": recall,
        "foreign": float(flags.mean()),
        "foreign_by_kind": {k: float(flags[[kk == k for kk in kinds]].mean()) for k in dict.fromkeys(kinds)},
    }
