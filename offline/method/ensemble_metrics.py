"""Evaluation metrics of an ensemble from its member probabilities ``(N, M, C)``: pure numpy functions.

One uncertainty shape everywhere: ``probs`` is ``(N, M, C)`` (inputs, members,
classes), each member's softmax; a single model is ``M = 1``. Classification
and calibration metrics score the *ensemble prediction*, the mean over members
``(N, C)`` (not the mean of the members' scores: a Brier or NLL averaged over
members rewards overconfident members and is not the ensemble's number).

OOD detection treats **OOD as the positive class** and takes scores where
**higher = more OOD** (pass ``-msp``, ``entropy`` or ``mutual_information``);
:func:`ood_scores` gives them from member probabilities. The conventions are
those of OpenOOD v1.5 (``openood/evaluators/metrics.py``):

* ``auroc``: area under the ROC curve, OOD positive.
* ``fpr95``: the false-positive rate, i.e. the fraction of **ID** inputs wrongly
  flagged OOD, at the first operating point of the ROC curve where at least 95%
  of the **OOD** inputs are flagged (TPR of OOD detection >= 0.95). Lower is better.
* ``aupr_in``: area under the precision-recall curve with ID positive and score ``-s``.
* ``aupr_out``: the same with OOD positive and score ``s``.

AUPR is scikit-learn's ``average_precision_score`` (step-wise area); OpenOOD
integrates the PR curve with the trapezoid rule, which differs from it by a
fraction of a percent on real curves.

Uncertainty fields (MSP, entropy, mutual information, disagreement) come from
``service.core.uncertainty.summarize``, the function the server answers with, so
build-time and serve-time numbers agree.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from service.core.scores import outlier_sign
from service.core.uncertainty import SUMMARY_SCORES, summarize

__all__ = [
    "N_BINS",
    "accuracy",
    "nll",
    "brier",
    "calibration_bins",
    "ece",
    "aece",
    "uncertainty",
    "ood_scores",
    "auroc",
    "fpr_at_tpr",
    "fpr95",
    "aupr_in",
    "aupr_out",
    "ood_metrics",
    "evaluate_predictions",
]

N_BINS = 15  # calibration bins, as in Guo et al. (2017) and the paper's tables
_EPS = 1e-12  # floor on the probability of the true class in the NLL (log 0 = inf)
_ALIASES = {"mi": "mutual_information"}


def _check_probs(probs: np.ndarray) -> np.ndarray:
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 3:
        raise ValueError(f"member probabilities must be (N, M, C), got shape {probs.shape}")
    if probs.shape[0] == 0:
        raise ValueError("member probabilities are empty (N = 0)")
    return probs


def _mean_and_labels(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ensemble prediction ``(N, C)`` and labels ``(N,)`` (int), with their shapes checked."""
    p = _check_probs(probs).mean(axis=1)  # (N, C)
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    if y.shape[0] != p.shape[0]:
        raise ValueError(f"{p.shape[0]} predictions but {y.shape[0]} labels")
    if y.min() < 0 or y.max() >= p.shape[1]:
        raise ValueError(f"labels must lie in [0, {p.shape[1]}), got range [{y.min()}, {y.max()}]")
    return p, y


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy of the ensemble prediction. ``probs (N, M, C)``, ``labels (N,)``; a fraction in [0, 1]."""
    p, y = _mean_and_labels(probs, labels)
    return float(np.mean(p.argmax(-1) == y))


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood (nats) of the ensemble prediction ``mean_m probs[:, m]``. ``probs (N, M, C)``."""
    p, y = _mean_and_labels(probs, labels)
    return float(-np.mean(np.log(np.maximum(p[np.arange(len(y)), y], _EPS))))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Brier score of the ensemble prediction: ``sum_c (p_c - 1[y = c])^2`` averaged over inputs, in [0, 2].

    ``probs (N, M, C)``. The members are averaged *first* (the ensemble's own
    score), unlike a mean of per-member Brier scores.
    """
    p, y = _mean_and_labels(probs, labels)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=-1)))


def calibration_bins(
    probs: np.ndarray, labels: np.ndarray, n_bins: int = N_BINS, adaptive: bool = False
) -> dict[str, np.ndarray]:
    """Per-bin confidence and accuracy of the ensemble prediction (the reliability diagram's data).

    Confidence is the ensemble's MSP. Equal-width bins ``(i/n, (i+1)/n]`` when
    ``adaptive`` is false; otherwise ``n_bins`` equal-mass bins of the inputs
    sorted by confidence (sizes differ by at most one). Empty bins have count 0
    and NaN confidence/accuracy.

    Returns ``{"confidence", "accuracy", "count", "edges"}``: the first three ``(n_bins,)``;
    ``edges (n_bins + 1,)`` are the bins' confidence limits (for equal-mass bins,
    the lowest and highest confidence inside each bin, stitched).
    """
    p, y = _mean_and_labels(probs, labels)
    conf = p.max(-1)  # (N,)
    correct = (p.argmax(-1) == y).astype(np.float64)
    if adaptive:
        order = np.argsort(conf, kind="stable")
        groups = np.array_split(order, n_bins)
        bin_of = np.empty(len(conf), dtype=np.int64)
        for b, idx in enumerate(groups):
            bin_of[idx] = b
        edges = np.array([0.0] + [conf[g].max() if len(g) else np.nan for g in groups])
    else:
        edges = np.linspace(0.0, 1.0, n_bins + 1)
        # right-closed bins (lo, hi]: confidence 1.0 falls in the last bin; 1/C > 0 keeps 0 out of play
        bin_of = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
    count = np.bincount(bin_of, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(bin_of, weights=conf, minlength=n_bins) / count
        mean_acc = np.bincount(bin_of, weights=correct, minlength=n_bins) / count
    return {"confidence": mean_conf, "accuracy": mean_acc, "count": count.astype(np.int64), "edges": edges}


def _ece_from_bins(bins: dict[str, np.ndarray]) -> float:
    count = bins["count"]
    filled = count > 0
    gaps = np.abs(bins["accuracy"][filled] - bins["confidence"][filled])
    return float(np.sum(gaps * count[filled]) / count.sum())


def ece(probs: np.ndarray, labels: np.ndarray, n_bins: int = N_BINS) -> float:
    """Expected calibration error, ``sum_b |B_b|/N · |acc(B_b) − conf(B_b)|`` over 15 equal-width bins; in [0, 1].

    ``probs (N, M, C)``, ``labels (N,)``; confidence is the MSP of the ensemble prediction.
    """
    return _ece_from_bins(calibration_bins(probs, labels, n_bins, adaptive=False))


def aece(probs: np.ndarray, labels: np.ndarray, n_bins: int = N_BINS) -> float:
    """Adaptive ECE: the ECE over 15 equal-mass bins (inputs sorted by confidence); in [0, 1]. ``probs (N, M, C)``."""
    return _ece_from_bins(calibration_bins(probs, labels, n_bins, adaptive=True))


# ----------------------------------------------------------------------------- uncertainty and OOD
def risk_coverage(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The risk-coverage curve of selective prediction (Geifman & El-Yaniv 2017): answer the ``k`` most confident
    inputs, ``k = 1..N``; coverage ``k / N`` and risk (error rate among those answered). Ties in confidence are
    answered together (the curve only has points where the confidence changes), so the order within a tie does
    not move it."""
    conf = np.asarray(confidence, dtype=np.float64).reshape(-1)
    wrong = 1.0 - np.asarray(correct, dtype=np.float64).reshape(-1)
    if conf.shape != wrong.shape or conf.size == 0:
        raise ValueError(f"confidence {conf.shape} and correct {wrong.shape} must be the same non-empty length")
    order = np.argsort(-conf, kind="stable")
    conf, wrong = conf[order], wrong[order]
    errors = np.cumsum(wrong)
    last = np.r_[np.nonzero(np.diff(conf))[0], conf.size - 1]  # the last index of each run of equal confidence
    k = last + 1
    return k / conf.size, errors[last] / k


def aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Area under the risk-coverage curve (lower is better): the mean over ``k = 1..N`` of the risk of answering
    the ``k`` most confident inputs, with tied confidences answered together (each tie's inputs all carry the
    risk at the tie's end). Equals the error rate for a confidence that carries no information (all tied)."""
    coverage, risk = risk_coverage(confidence, correct)
    counts = np.diff(np.r_[0.0, coverage])
    return float((counts * risk).sum())


def uncertainty(probs: np.ndarray) -> dict[str, np.ndarray]:
    """Per-input uncertainty ``(N,)`` from member probabilities ``(N, M, C)``, as the server computes it.

    ``service.core.uncertainty.summarize`` of ``log probs`` (softmax of a log-probability
    is the probability itself). Returns ``msp``, ``entropy``, ``expected_entropy``,
    ``mutual_information``, ``disagreement`` as float64 numpy arrays.
    """
    logp = torch.log(torch.as_tensor(_check_probs(probs)))  # (N, M, C); log 0 = -inf, whose softmax is 0
    s = summarize(logp)
    keys = ("msp", "entropy", "expected_entropy", "mutual_information", "disagreement")
    return {k: s[k].double().numpy() for k in keys}


def _metric_name(score: str) -> str:
    name = _ALIASES.get(score, score)
    if name not in SUMMARY_SCORES:  # the probability scores; service.core.ood computes the others
        raise ValueError(f"unknown OOD score {score!r} for probabilities; expected one of {SUMMARY_SCORES} (or 'mi')")
    return name


def ood_scores(probs: np.ndarray | dict[str, np.ndarray], score: str = "msp") -> np.ndarray:
    """OOD scores ``(N,)``, **higher = more OOD**: ``-msp``, ``entropy`` or ``mutual_information`` (alias ``mi``).

    ``probs`` is member probabilities ``(N, M, C)`` or the output of :func:`uncertainty`.
    """
    name = _metric_name(score)
    u = probs if isinstance(probs, Mapping) else uncertainty(probs)
    s = np.asarray(u[name], dtype=np.float64)
    return outlier_sign(name) * s


def _binary(id_scores: np.ndarray, ood_scores_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels (1 = OOD) and scores (higher = more OOD) of ID and OOD inputs concatenated."""
    a = np.asarray(id_scores, dtype=np.float64).reshape(-1)
    b = np.asarray(ood_scores_, dtype=np.float64).reshape(-1)
    if len(a) == 0 or len(b) == 0:
        raise ValueError(f"need ID and OOD scores, got {len(a)} ID and {len(b)} OOD")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("OOD scores contain NaN or inf")
    return np.r_[np.zeros(len(a)), np.ones(len(b))], np.r_[a, b]


def auroc(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """AUROC of detecting OOD (positive class) with scores where higher = more OOD. Inputs ``(N,)`` and ``(N',)``."""
    y, s = _binary(id_scores, ood_scores)
    return float(roc_auc_score(y, s))


def fpr_at_tpr(id_scores: np.ndarray, ood_scores: np.ndarray, tpr: float = 0.95) -> float:
    """Fraction of ID inputs flagged OOD at the first ROC point where a fraction ``tpr`` of OOD inputs is flagged.

    OOD is the positive class and higher scores mean more OOD (OpenOOD v1.5:
    ``fpr[argmax(tpr >= 0.95)]`` of ``roc_curve(is_ood, score)``). Ties are one
    operating point: a threshold flags all inputs with an equal score or none.
    """
    y, s = _binary(id_scores, ood_scores)
    fpr, tpr_curve, _ = roc_curve(y, s, drop_intermediate=False)
    return float(fpr[np.argmax(tpr_curve >= tpr)])


def fpr95(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """FPR at 95% TPR, OOD positive (see :func:`fpr_at_tpr`): the ID false-alarm rate when 95% of OOD is caught."""
    return fpr_at_tpr(id_scores, ood_scores, 0.95)


def aupr_in(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """Area under the precision-recall curve with **ID** positive, ranked by ``-score`` (average precision)."""
    y, s = _binary(id_scores, ood_scores)
    return float(average_precision_score(1 - y, -s))


def aupr_out(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """Area under the precision-recall curve with **OOD** positive, ranked by ``score`` (average precision)."""
    y, s = _binary(id_scores, ood_scores)
    return float(average_precision_score(y, s))


def ood_metrics(id_scores: np.ndarray, ood_scores: np.ndarray) -> dict[str, float]:
    """``{"auroc", "fpr95", "aupr_in", "aupr_out"}`` of ID ``(N,)`` vs OOD ``(N',)`` scores, higher = more OOD."""
    return {
        "auroc": auroc(id_scores, ood_scores),
        "fpr95": fpr95(id_scores, ood_scores),
        "aupr_in": aupr_in(id_scores, ood_scores),
        "aupr_out": aupr_out(id_scores, ood_scores),
    }


# ----------------------------------------------------------------------------- everything at once
def evaluate_predictions(
    probs: np.ndarray, labels: np.ndarray, ood_probs: dict[str, np.ndarray], ood_score: str = "msp"
) -> dict:
    """Every report number of one method from its member probabilities.

    Args:
        probs: ``(N, M, C)`` member probabilities on the ID test set (single model: ``M = 1``).
        labels: ``(N,)`` ID labels. ood_probs: per OOD set, member probabilities ``(N', M, C)``.
        ood_score: the detection score, ``msp`` (as ``-msp``), ``entropy`` or ``mutual_information`` (``mi``).

    Returns plain floats: ``acc``, ``nll``, ``brier``, ``ece``, ``aece``, ``aurc`` (the area under the
    risk-coverage curve with the MSP of the mean prediction as confidence) (fractions in [0, 1] except NLL, Brier);
    ``msp_id``, ``entropy_id``, ``mi_id``, ``disagreement_id`` (means over ID inputs); ``ood``: per set
    ``{"auroc", "fpr95", "aupr_in", "aupr_out", "mi", "disagreement"}`` (OOD positive; ``mi`` and
    ``disagreement`` are that set's means); ``mi_ood`` and ``disagreement_ood`` (means over all OOD inputs
    pooled); ``ood_avg``: the detection metrics averaged over sets; ``ood_score``: the score used.
    """
    name = _metric_name(ood_score)
    mean, y = _mean_and_labels(probs, labels)
    u_id = uncertainty(probs)
    s_id = ood_scores(u_id, name)
    out: dict = {
        "acc": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "brier": brier(probs, labels),
        "ece": ece(probs, labels),
        "aece": aece(probs, labels),
        "aurc": aurc(u_id["msp"], mean.argmax(-1) == y),
        "msp_id": float(u_id["msp"].mean()),
        "entropy_id": float(u_id["entropy"].mean()),
        "mi_id": float(u_id["mutual_information"].mean()),
        "disagreement_id": float(u_id["disagreement"].mean()),
        "ood": {},
        "ood_score": name,
    }
    m = _check_probs(probs).shape[1:]
    mi_all, dis_all = [], []
    for set_name, p_ood in ood_probs.items():
        if _check_probs(p_ood).shape[1:] != m:
            raise ValueError(f"OOD set {set_name!r}: member probabilities {np.shape(p_ood)} do not match ID (N, {m})")
        u = uncertainty(p_ood)
        out["ood"][set_name] = {
            **ood_metrics(s_id, ood_scores(u, name)),
            "mi": float(u["mutual_information"].mean()),
            "disagreement": float(u["disagreement"].mean()),
        }
        mi_all.append(u["mutual_information"])
        dis_all.append(u["disagreement"])
    out["mi_ood"] = float(np.concatenate(mi_all).mean()) if mi_all else float("nan")
    out["disagreement_ood"] = float(np.concatenate(dis_all).mean()) if dis_all else float("nan")
    keys = ("auroc", "fpr95", "aupr_in", "aupr_out")
    out["ood_avg"] = {k: float(np.mean([v[k] for v in out["ood"].values()])) for k in keys} if out["ood"] else {}
    return out
