"""The OOD stage of a build: statistics of :mod:`service.ood` fitted on ID features, the served score chosen on
the OOD validation sets, and every score's detection quality for the report.

Per member: the class means of its penultimate features, and one covariance shared by
the classes (the within-class scatter), estimated with Ledoit-Wolf shrinkage
(scikit-learn): with a few hundred inputs per class and a 384- or 768-d feature the
sample covariance is singular or nearly so, and its inverse would amplify noise
directions. The background Gaussian of relative Mahalanobis is fitted the same way on
all features around their overall mean.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.covariance import LedoitWolf

from service.ood import GaussianStats, OODStats, ensemble_scores, fit_norms, member_scores
from service.uncertainty import OOD_METRICS, ood_flag, summarize

from .calibration import calibrate_threshold
from .metrics import ood_metrics

__all__ = [
    "detection",
    "fit_gaussians",
    "fit_ood_stats",
    "flag_rate",
    "member_agreement",
    "scores_np",
    "select_score",
    "shrunk_precision",
]


def shrunk_precision(centered: np.ndarray) -> np.ndarray:
    """Inverse of the Ledoit-Wolf shrunk covariance of already centred rows ``(N, D)`` -> ``(D, D)`` float64."""
    lw = LedoitWolf(assume_centered=True, store_precision=True).fit(centered.astype(np.float64))
    return lw.precision_


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
    overall = f - f.mean(0, keepdims=True)  # (N, M, D)
    members = range(f.shape[1])
    return GaussianStats(
        means=torch.from_numpy(means),
        precision=torch.from_numpy(np.stack([shrunk_precision(within[:, m]) for m in members])),
        background_mean=torch.from_numpy(f.mean(0)),
        background_precision=torch.from_numpy(np.stack([shrunk_precision(overall[:, m]) for m in members])),
    )


# ----------------------------------------------------------------------------- statistics, selection, evaluation
def fit_ood_stats(
    fit_features: torch.Tensor, fit_labels: torch.Tensor, classes: int, val_logits: torch.Tensor,
    val_features: torch.Tensor, temperature: float,
) -> OODStats:  # fmt: skip
    """The statistics every score needs: Gaussians on the fit split's features ``(N, M, D)``, then each per-member
    score's norms (and MI's) on the ID validation outputs, at ``temperature``."""
    gaussians = fit_gaussians(fit_features, fit_labels, classes)
    per_member = member_scores(val_logits, val_features, gaussians, temperature)
    mi = summarize(val_logits, temperature)["mutual_information"]
    return OODStats(gaussians, fit_norms({**per_member, "mutual_information": mi}))


def scores_np(logits: torch.Tensor, features: torch.Tensor | None, stats: OODStats | None, T: float) -> dict:
    """Every score of :func:`service.ood.ensemble_scores` as float64 arrays ``(N,)``."""
    return {k: v.double().numpy() for k, v in ensemble_scores(logits, features, stats, T).items()}


def flag_rate(scores: np.ndarray, metric: str, threshold: float) -> float:
    """Share of ``scores`` the served rule flags (``service.uncertainty.ood_flag``)."""
    return float(ood_flag(torch.from_numpy(np.asarray(scores, dtype=np.float64)), metric, threshold).float().mean())


# the served score when the build has no OOD validation data (the Mahalanobis distance was selected in both demo
# settings with the shipped recipe: benchmarks/results/recipe); MSP for models without features
NO_OOD_DATA_ORDER = ("mahalanobis", "msp")


def select_score(
    id_val: dict[str, np.ndarray], ood_val: dict[str, dict[str, np.ndarray]], tpr: float, forced: str | None = None
) -> tuple[str, dict[str, dict[str, Any]]]:
    """The served score and every candidate's validation figures.

    Each candidate's threshold lets ``tpr`` of the ID validation inputs through
    (:func:`offline.calibration.calibrate_threshold`); its recall on each OOD validation set is the share that set
    flags. The score with the best mean recall over the sets is served (ties: the earlier in ``OOD_METRICS``'s
    order, probability scores first); ``forced`` (``calibration.ood_score``) overrides the choice. Without OOD
    validation sets the first available of :data:`NO_OOD_DATA_ORDER` is served.
    """
    candidates: dict[str, dict[str, Any]] = {}
    for name in (n for n in OOD_METRICS if n in id_val):
        t = calibrate_threshold(id_val[name], name, tpr=tpr)
        recall = {s: flag_rate(scores[name], name, t) for s, scores in ood_val.items()}
        candidates[name] = {"threshold": t, "id_val_flag_rate": flag_rate(id_val[name], name, t),
                            "val_recall": recall, "val_mean_recall": float(np.mean(list(recall.values())))
                            if recall else None}  # fmt: skip
    if forced is not None:
        if forced not in candidates:
            raise ValueError(f"calibration.ood_score {forced!r} cannot be computed for this model; "
                             f"available: {sorted(candidates)}")  # fmt: skip
        return forced, candidates
    if not ood_val:  # nothing to rank by: the feature score that led on every demo setting, else MSP
        return next(n for n in NO_OOD_DATA_ORDER if n in candidates), candidates
    best = max(candidates, key=lambda n: (candidates[n]["val_mean_recall"] or 0.0, -list(OOD_METRICS).index(n)))
    return best, candidates


def detection(id_scores: dict[str, np.ndarray], ood: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Per score: AUROC and FPR at 95 % TPR on each OOD set (OOD positive) and their means over the sets."""
    out: dict[str, Any] = {}
    for name, s_id in id_scores.items():
        sign = -1.0 if OOD_METRICS[name] else 1.0  # ood_metrics wants higher = more OOD
        per = {k: ood_metrics(sign * s_id, sign * v[name]) for k, v in ood.items()}
        per = {k: {"auroc": m["auroc"], "fpr95": m["fpr95"]} for k, m in per.items()}
        avg = {m: float(np.mean([v[m] for v in per.values()])) for m in ("auroc", "fpr95")} if per else {}
        out[name] = {"ood": per, "avg": avg}
    return out


def member_agreement(logits: torch.Tensor, features: torch.Tensor | None, stats: OODStats | None, T: float) -> dict:
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
