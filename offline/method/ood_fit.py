"""The OOD stage of a build: statistics of :mod:`service.core.ood` fitted on ID features, the served score chosen on
the OOD validation sets, and every score's detection quality for the report.

Per member: the class means of its penultimate features, and one covariance shared by
the classes (the within-class scatter), estimated with Ledoit-Wolf shrinkage
(scikit-learn): with a few hundred inputs per class and a 384- or 768-d feature the
sample covariance is singular or nearly so, and its inverse would amplify noise
directions. The background Gaussian of relative Mahalanobis has the features' overall
mean and the covariance of the classes' mixture: the shrunk within-class covariance plus
the between-class scatter of the class means (the sample identity total = within +
between). Shrinking the background covariance on its own instead gave it another
Ledoit-Wolf intensity (0.003 against 0.010 on 400 text features of 384 dimensions), so
the two Gaussians disagreed in every direction the classes share, by a factor that grows
with an input's distance: far-away inputs got *lower* relative scores than ID ones
(AUROC 14-16 % on the text artifact). With the mixture covariance the two agree exactly
outside the span of the class means, and the relative score measures only what it is
meant to: where an input lies among the classes, against where all ID inputs lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.covariance import LedoitWolf

from offline.method.calibration import calibrate_threshold
from offline.method.ensemble_metrics import ood_metrics
from service.core.ood import (
    LAYER_REDUCTIONS,
    GaussianStats,
    LayerStats,
    OODStats,
    combine,
    ensemble_scores,
    fit_norms,
    layer_pair_scores,
    mahalanobis,
    member_scores,
    reduce_layers,
    standardize,
)
from service.core.scores import outlier_sign
from service.core.uncertainty import OOD_METRICS, ood_flag, summarize

__all__ = [
    "LAYERS",
    "LayerChoice",
    "Run",
    "background_stats",
    "base_score",
    "columns_of",
    "label_free_scores",
    "detection",
    "fit_gaussians",
    "fit_layer_stats",
    "fit_ood_stats",
    "layer_candidates",
    "layer_candidate_name",
    "parse_layer_candidate",
    "restrict_layers",
    "with_layers",
    "flag_rate",
    "member_agreement",
    "scores_np",
    "select_score",
    "mixture_precision",
    "shrunk_covariance",
    "shrunk_precision",
]


def shrunk_precision(centered: np.ndarray) -> np.ndarray:
    """Inverse of the Ledoit-Wolf shrunk covariance of already centred rows ``(N, D)`` -> ``(D, D)`` float64."""
    return shrunk_covariance(centered)[1]


def shrunk_covariance(centered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(covariance, precision)`` ``(D, D)`` float64: Ledoit-Wolf shrinkage of already centred rows ``(N, D)``."""
    lw = LedoitWolf(assume_centered=True, store_precision=True).fit(centered.astype(np.float64))
    return lw.covariance_, lw.precision_


def mixture_precision(within_cov: np.ndarray, means: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Precision ``(D, D)`` of the class mixture's covariance: ``within_cov (D, D)`` plus the between-class scatter
    ``Σ_k w_k (μ_k - μ)(μ_k - μ)ᵀ`` of the class means ``(C, D)`` weighted by their counts ``(C,)``."""
    w = counts / counts.sum()
    centred = means - (w[:, None] * means).sum(0)
    between = (centred * w[:, None]).T @ centred  # (D, D), rank <= C-1
    return np.linalg.inv(within_cov + between)


def fit_gaussians(features: torch.Tensor, labels: torch.Tensor, classes: int) -> GaussianStats:
    """Fit :class:`GaussianStats` on ID ``features (N, M, D)`` with labels ``(N,)`` in ``0..classes-1``.

    Raises ``ValueError`` naming the class when one has no input (its mean would be undefined).
    """
    if features.dim() != 3 or labels.shape != (features.shape[0],):
        raise ValueError(f"features (N, M, D) and labels (N,), got {tuple(features.shape)}, {tuple(labels.shape)}")
    f = features.detach().to(torch.float64).cpu().numpy()  # (N, M, D)
    y = labels.cpu().numpy()
    counts = np.bincount(y, minlength=classes)
    if (counts == 0).any():
        raise ValueError(f"class {int(np.argmin(counts))} has no input to fit its mean on")
    means = np.stack([f[y == k].mean(0) for k in range(classes)], axis=1)  # (M, C, D)
    within = f - means.transpose(1, 0, 2)[y]  # (N, M, D): each input minus its class mean
    fits = [shrunk_covariance(within[:, m]) for m in range(f.shape[1])]  # (covariance, precision) per member
    return GaussianStats(
        means=torch.from_numpy(means),
        precision=torch.from_numpy(np.stack([p for _, p in fits])),
        background_mean=torch.from_numpy(f.mean(0)),  # = the class means weighted by their counts
        background_precision=torch.from_numpy(
            np.stack([mixture_precision(c, means[m], counts.astype(np.float64)) for m, (c, _) in enumerate(fits)])
        ),
    )


# one method's outputs on one set: logits (N, M, C), penultimate features (N, M, D) or None, layer features
# (N, M, L-1, d) or None (offline.stages.datasets.collect)
Run = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
LAYERS = "mahalanobis_layers"  # the multi-layer score; its candidates are named LAYERS@<ids>[:<reduce>]


@dataclass(frozen=True)
class LayerChoice:
    """What ``mahalanobis_layers`` reads and how it combines it: the blocks ``ids`` and the reduction, one of
    :data:`service.core.ood.LAYER_REDUCTIONS`."""

    ids: tuple[int, ...]
    reduce: str = "max"
    # one Gaussian of the ID inputs per (member, layer) instead of one per class: an early layer's pooled features
    # carry little of the class, and the distance to all ID inputs moves more under a pixel-level shift
    label_free: bool = False


FREE = "free"  # the suffix of a label-free layer candidate's name


def layer_candidate_name(ids: Sequence[int], reduce: str = "max", label_free: bool = False) -> str:
    """``mahalanobis_layers@0,2`` (the largest column), ``mahalanobis_layers@0,2:mean``, ``...:members``; label-free
    layer Gaussians add ``:free`` (``mahalanobis_layers@0,2:max:free``)."""
    suffix = "" if reduce == "max" and not label_free else f":{reduce}"
    return f"{LAYERS}@{','.join(str(i) for i in ids)}{suffix}{':' + FREE if label_free else ''}"


def parse_layer_candidate(name: str) -> LayerChoice:
    """The :class:`LayerChoice` of a :func:`layer_candidate_name`."""
    spec = name.split("@", 1)[1]
    ids, _, rest = spec.partition(":")
    reduce, _, free = rest.partition(":")
    return LayerChoice(tuple(int(i) for i in ids.split(",")), reduce or "max", free == FREE)


# ----------------------------------------------------------------------------- statistics, selection, evaluation
def fit_ood_stats(
    fit_features: torch.Tensor,
    fit_labels: torch.Tensor,
    classes: int,
    val_logits: torch.Tensor,
    val_features: torch.Tensor,
    temperature: float,
) -> OODStats:
    """The statistics every score needs: Gaussians on the fit split's features ``(N, M, D)``, then each per-member
    score's norms (and MI's) on the ID validation outputs, at ``temperature``."""
    gaussians = fit_gaussians(fit_features, fit_labels, classes)
    per_member = member_scores(val_logits, val_features, gaussians, temperature)
    mi = summarize(val_logits, temperature)["mutual_information"]
    return OODStats(gaussians, fit_norms({**per_member, "mutual_information": mi}))


def fit_layer_stats(
    fit_layers: torch.Tensor,
    fit_labels: torch.Tensor,
    classes: int,
    val_layers: torch.Tensor,
    val_mahalanobis: torch.Tensor,
    ids: tuple[int, ...] | None = None,
    reduce: str = "max",
    label_free: bool = False,
) -> LayerStats:
    """:class:`service.core.ood.LayerStats` of layers ``ids`` (default: all): Gaussians per (member, layer) on the fit
    split's layer features ``(N, M, L-1, d)`` (one per class, or with ``label_free`` one of all the fit inputs), the
    pairs' and the columns' norms on ID validation (``val_layers``; ``val_mahalanobis (N',)``: the last feature's
    combined ``mahalanobis`` on the same inputs, column 0); ``reduce``: how the served score combines the columns."""
    ids = tuple(range(fit_layers.shape[2])) if ids is None else tuple(ids)
    N, M, _, d = fit_layers.shape
    k = len(ids)
    if label_free:
        fit_labels, classes = torch.zeros(N, dtype=torch.int64), 1
    g = fit_gaussians(fit_layers[:, :, list(ids)].reshape(N, M * k, d), fit_labels, classes)
    n = val_layers.shape[0]
    md = mahalanobis(val_layers[:, :, list(ids)].reshape(n, M * k, d), g)  # (N', M*K)
    pair_norms = fit_norms({"p": md})["p"]
    per_layer = standardize(md, *pair_norms).view(n, M, k).mean(dim=1)  # (N', K), as service.core.ood.layer_scores
    cols = torch.cat([val_mahalanobis.to(torch.float64).unsqueeze(1), per_layer.to(torch.float64)], dim=1)
    column_norms = (cols.mean(0), cols.std(0).clamp_min(1e-12))
    return LayerStats(ids, g, pair_norms, column_norms, reduce)


def restrict_layers(stats: LayerStats, ids: tuple[int, ...], reduce: str = "max") -> LayerStats:
    """The statistics of the layers ``ids`` (a subset of ``stats.ids``) out of ``stats``, combined by ``reduce``:
    Gaussians and norms are per (member, layer) and per column, so a subset's are the corresponding slices."""
    pos = [stats.ids.index(i) for i in ids]
    k, M = len(stats.ids), stats.members
    pairs = [m * k + p for m in range(M) for p in pos]  # member-major, as LayerStats orders them
    g = stats.gaussians
    sub = GaussianStats(g.means[pairs], g.precision[pairs], g.background_mean[pairs], g.background_precision[pairs])
    cols = [0] + [1 + p for p in pos]
    return LayerStats(
        tuple(ids),
        sub,
        tuple(t[pairs] for t in stats.pair_norms),  # type: ignore[arg-type]
        tuple(t[cols] for t in stats.column_norms),  # type: ignore[arg-type]
        reduce,
    )


MAX_SCORE_LAYERS = 3  # the most layers mahalanobis_layers reads: its cost at batch 1 must not grow with depth


def layer_candidates(n_layers: int) -> list[tuple[int, ...]]:
    """The layer sets ``mahalanobis_layers`` may read, chosen among on validation: every layer alone, every pair
    and, with at most :data:`MAX_SCORE_LAYERS` layers, all of them (in that order: ties go to the smaller set).

    At most three layers, because the score streams one ``(d, d)`` precision per member and layer at batch 1:
    reading all 11 blocks of a ViT-B/16 costs 6.6 % of its bf16 forward on 2 EPYC cores (``bench_fusion.py
    --methods hydra hydra_ood_layers``), three about a quarter of that."""
    singles = [(i,) for i in range(n_layers)]
    pairs = [(i, j) for i in range(n_layers) for j in range(i + 1, n_layers)]
    every = [tuple(range(n_layers))] if 2 < n_layers <= MAX_SCORE_LAYERS else []
    return singles + pairs + every


def base_score(name: str) -> str:
    """The served score a candidate name stands for (``mahalanobis_layers@0,2`` -> ``mahalanobis_layers``)."""
    return name.split("@", 1)[0]


def with_layers(stats: OODStats, layers: LayerStats | None) -> OODStats:
    """``stats`` with the multi-layer statistics ``layers``."""
    return OODStats(stats.gaussians, stats.norms, layers)


def scores_np(run: Run, stats: OODStats | None, T: float) -> dict:
    """Every score of :func:`service.core.ood.ensemble_scores` of one run (logits, features, layer features) as float64
    arrays ``(N,)``."""
    logits, features, layers = run
    return {
        k: v.double().numpy() for k, v in ensemble_scores(logits, features, stats, T, layer_features=layers).items()
    }


def layer_columns(run: Run, stats: OODStats, full: LayerStats, T: float) -> np.ndarray:
    """The members' standardised columns of ``mahalanobis_layers`` for every layer of ``full`` ``(N, M, K+1)``
    (:func:`service.core.ood.reduce_layers`' input): each member's last-feature score, then each layer's; a
    candidate's score is its columns reduced (:func:`candidate_scores`), so each is computed once for all
    candidates."""
    logits, features, layers = run
    per_member = member_scores(logits, features, stats.gaussians, T)["mahalanobis"]
    return columns_of(standardize(per_member, *stats.norms["mahalanobis"]), layers, full)


def columns_of(last: torch.Tensor, layers: torch.Tensor, full: LayerStats) -> np.ndarray:
    """:func:`layer_columns` from the members' standardised last-feature scores ``(N, M)`` and the layer features."""
    return torch.cat([last.to(torch.float64).unsqueeze(2), layer_pair_scores(layers, full)], 2).numpy()


def background_stats(fit: torch.Tensor, val: torch.Tensor) -> OODStats:
    """Label-free statistics (zero-shot: the labels come with each request): one Gaussian per member of the ID
    embeddings ``fit (N, M, D)`` (``mahalanobis`` is then the distance to the ID images, whatever the labels) and its
    norms on ``val (N', M, D)``."""
    g = fit_gaussians(fit, torch.zeros(fit.shape[0], dtype=torch.int64), classes=1)
    return OODStats(g, fit_norms({"mahalanobis": mahalanobis(val, g)}))


def label_free_scores(features: torch.Tensor, stats: OODStats) -> torch.Tensor:
    """The combined ``mahalanobis`` ``(N,)`` of :func:`background_stats` (as
    :func:`service.core.ood.ensemble_scores`)."""
    assert stats.gaussians is not None
    return combine(mahalanobis(features, stats.gaussians), *stats.norms["mahalanobis"])


def candidate_scores(columns: np.ndarray, full: LayerStats, ids: tuple[int, ...], reduce: str = "max") -> np.ndarray:
    """``mahalanobis_layers`` ``(N,)`` of the layer set ``ids`` combined by ``reduce``, from :func:`layer_columns`'
    ``(N, M, K+1)``."""
    pos = [0] + [1 + full.ids.index(i) for i in ids]  # the columns of restrict_layers(full, ids): norms sliced alike
    norms = (full.column_norms[0][pos], full.column_norms[1][pos])
    return reduce_layers(torch.from_numpy(columns[:, :, pos]), norms, reduce).numpy()


def layer_candidate_scores(columns: np.ndarray, full: LayerStats, label_free: bool = False) -> dict[str, np.ndarray]:
    """Every ``mahalanobis_layers`` candidate's scores ``(N,)`` by name: each layer set of :func:`layer_candidates`
    with each reduction of :data:`service.core.ood.LAYER_REDUCTIONS` (``members`` only with several members);
    ``label_free``: ``full`` holds label-free layer Gaussians (the names say so)."""
    reductions = [r for r in LAYER_REDUCTIONS if r != "members" or columns.shape[1] > 1]
    return {
        layer_candidate_name(ids, r, label_free): candidate_scores(columns, full, ids, r)
        for ids in layer_candidates(len(full.ids))
        for r in reductions
    }


def flag_rate(scores: np.ndarray, metric: str, threshold: float) -> float:
    """Share of ``scores`` the served rule flags (``service.core.uncertainty.ood_flag``; ``metric`` may be a candidate
    name, :func:`base_score`)."""
    flags = ood_flag(torch.from_numpy(np.asarray(scores, dtype=np.float64)), base_score(metric), threshold)
    return float(flags.float().mean())


# the served score when the build has no OOD validation data (the Mahalanobis distance was selected in both demo
# settings with the shipped recipe: benchmarks/results/recipe); MSP for models without features
NO_OOD_DATA_ORDER = ("mahalanobis", "msp")


def select_score(
    id_val: dict[str, np.ndarray], ood_val: dict[str, dict[str, np.ndarray]], tpr: float, forced: str | None = None
) -> tuple[str, dict[str, dict[str, Any]]]:
    """The served score and every candidate's validation figures.

    Each candidate's threshold lets ``tpr`` of the ID validation inputs through
    (:func:`offline.method.calibration.calibrate_threshold`); its recall on each OOD validation set is the share that
    set flags. The score with the best mean recall over the sets is served (ties: the earlier in ``OOD_METRICS``'s
    order, probability scores first); ``forced`` (``calibration.ood_score``) overrides the choice. Without OOD
    validation sets the first available of :data:`NO_OOD_DATA_ORDER` is served.
    """
    candidates: dict[str, dict[str, Any]] = {}
    order = [n for n in OOD_METRICS if n in id_val] + [n for n in id_val if n not in OOD_METRICS]
    for name in order:  # the served scores in OOD_METRICS' order, then candidate variants (mahalanobis_layers@...)
        t = calibrate_threshold(id_val[name], base_score(name), tpr=tpr)
        recall = {s: flag_rate(scores[name], name, t) for s, scores in ood_val.items()}
        candidates[name] = {
            "threshold": t,
            "id_val_flag_rate": flag_rate(id_val[name], name, t),
            "val_recall": recall,
            "val_mean_recall": float(np.mean(list(recall.values()))) if recall else None,
        }
    if forced is not None:
        served = [n for n in candidates if base_score(n) == forced]
        if not served:
            raise ValueError(
                f"calibration.ood_score {forced!r} cannot be computed for this model; "
                f"available: {sorted({base_score(n) for n in candidates})}"
            )
        if len(served) == 1:
            return served[0], candidates
        candidates_of = {n: candidates[n] for n in served}  # the forced score's best variant on validation
        return max(served, key=lambda n: (candidates_of[n]["val_mean_recall"] or 0.0, -order.index(n))), candidates
    if not ood_val:  # nothing to rank by: the feature score that led on every demo setting, else MSP
        return next(n for n in NO_OOD_DATA_ORDER if n in candidates), candidates
    best = max(candidates, key=lambda n: (candidates[n]["val_mean_recall"] or 0.0, -order.index(n)))
    return best, candidates


def detection(id_scores: dict[str, np.ndarray], ood: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Per score: AUROC and FPR at 95 % TPR on each OOD set (OOD positive) and their means over the sets."""
    out: dict[str, Any] = {}
    for name, s_id in id_scores.items():
        sign = outlier_sign(base_score(name))  # ood_metrics wants higher = more OOD
        per = {k: ood_metrics(sign * s_id, sign * v[name]) for k, v in ood.items()}
        per = {k: {"auroc": m["auroc"], "fpr95": m["fpr95"]} for k, m in per.items()}
        avg = {m: float(np.mean([v[m] for v in per.values()])) for m in ("auroc", "fpr95")} if per else {}
        out[name] = {"ood": per, "avg": avg}
    return out


def member_agreement(logits: torch.Tensor, features: torch.Tensor | None, stats: OODStats | None, T: float) -> dict:
    # the per-member scores only (the multi-layer score combines members per layer first)
    """How alike the members' OOD scores are on the given inputs: per per-member score, the mean pairwise Spearman
    rank correlation across members (1: the members rank every input the same; an ensemble then adds nothing to
    the ranking)."""
    if stats is None or logits.shape[1] < 2:
        return {}
    out = {}
    for name, s in member_scores(logits, features, stats.gaussians, T).items():
        m = s.double().numpy()  # (N, M)
        pairs = [spearmanr(m[:, i], m[:, j]).statistic for i in range(m.shape[1]) for j in range(i + 1, m.shape[1])]
        out[name] = float(np.mean(pairs))
    return out
