"""The body of a ``/predict`` or ``/zero-shot`` answer, built from a runtime's :class:`~service.runtime.Outcome`.

The answer is built as the response models of :mod:`service.api.schemas` (:class:`PredictResponse` and its parts),
so the body the client gets and the schema the API documents (docs/api.md) are one thing. The Open Inference
Protocol builds its tensors from the same outcome (:mod:`service.api.oip`).
"""

from __future__ import annotations

import time
from typing import Literal, cast

import numpy as np

from ..core.guarantees import Guarantees
from ..core.uncertainty import OOD_METRICS
from ..runtime import ItemResult, Outcome, Query, Runtime
from ..runtime.batching import BatchResult
from .schemas import (
    OOD,
    ConformalSet,
    MemberPrediction,
    Prediction,
    PredictResponse,
    Selective,
    Timing,
    TopK,
    Uncertainty,
)

__all__ = ["build_predictions", "predict_response"]


def predict_response(rt: Runtime, out: Outcome, query: Query, t0: float, request_id: str) -> PredictResponse:
    """The answer to one request (``/predict``, ``/zero-shot``): its results over their labels, with timings;
    ``t0`` is when the request arrived (``total_ms``)."""
    predictions = build_predictions(
        out.results,
        out.labels,
        top_k=query.top_k,
        return_members=query.return_members,
        metric=rt.ood_metric,
        threshold=rt.ood_threshold,
        return_scores=query.return_scores,
        guarantees=rt.guarantees,
    )
    # total_ms last: it covers building the answer too
    return PredictResponse(
        id=request_id,
        model=rt.name,
        model_version=rt.version,
        predictions=predictions,
        timing=timing(out.batch, t0),
    )


def timing(res: BatchResult, t0: float) -> Timing:
    """The answer's timings: the batch's queue and inference time, and the total since ``t0``."""
    return Timing(
        queue_ms=round(res.queue_s * 1000, 3),
        inference_ms=round(res.inference_s * 1000, 3),
        total_ms=round((time.perf_counter() - t0) * 1000, 3),
    )


def build_predictions(
    results: list[ItemResult],
    labels: list[str],
    *,
    top_k: int,
    return_members: bool,
    metric: str,
    threshold: float,
    return_scores: bool = False,
    guarantees: Guarantees | None = None,
) -> list[Prediction]:
    """The ``predictions`` of an answer (docs/api.md), one per input; ``top_k`` is clamped to ``len(labels)``.

    ``members`` is set only when asked for; ``conformal`` and ``selective`` when the results carry them (models with
    a calibration split, ``guarantees``); the answer is serialised without the unset (None) fields.
    """
    k = max(1, min(int(top_k), len(labels)))
    out = []
    for r in results:
        order = np.argsort(-r.probs, kind="stable")[:k]
        members = None
        if return_members:
            idx = r.member_probs.argmax(-1)  # (M,) each member's own prediction
            members = [
                MemberPrediction(label=labels[int(j)], confidence=float(r.member_probs[m, j]))
                for m, j in enumerate(idx)
            ]
        out.append(
            Prediction(
                label=labels[r.prediction],
                label_index=r.prediction,
                confidence=float(r.probs[r.prediction]),
                top_k=[TopK(label=labels[j], prob=float(r.probs[j])) for j in order],
                uncertainty=Uncertainty(
                    msp=r.msp,
                    entropy=r.entropy,
                    expected_entropy=r.expected_entropy,
                    mutual_information=r.mutual_information,
                    disagreement=r.disagreement,
                ),
                ood=_ood(r, metric, threshold, return_scores),
                conformal=_conformal(r, labels, guarantees),
                selective=_selective(r, metric, guarantees),
                members=members,
            )
        )
    return out


def _ood(r: ItemResult, metric: str, threshold: float, return_scores: bool) -> OOD:
    """The answer's OOD block: ``threshold`` is the rule the flag applied (with a p-value, the score threshold of
    ``p_value <= alpha`` at the request's level; else the build's), and a flagged input says why."""
    past = "below" if OOD_METRICS[metric] else "above"
    if r.p_value is None:
        cut: float | None = threshold
        reason = f"the {metric} score {r.ood_score:.4g} is {past} the threshold {threshold:.4g}" if r.ood_flag else None
    else:
        cut = r.flag_threshold
        reason = (
            f"p-value {r.p_value:.4g} <= alpha {r.ood_alpha:g}: the {metric} score {r.ood_score:.4g} is {past} "
            f"{cut:.4g}, the threshold at this level"
            if r.ood_flag and cut is not None
            else None
        )
    return OOD(
        flag=r.ood_flag,
        score=r.ood_score,
        metric=metric,
        threshold=cut,
        p_value=r.p_value,
        alpha=r.ood_alpha,
        reason=reason,
        suspended=r.suspended,
        scores=_all_scores(r) if return_scores else None,
    )


def _selective(r: ItemResult, metric: str, g: Guarantees | None) -> Selective | None:
    """The risk rule's decision, both its thresholds, what the drift alarm says, and why an input is not accepted."""
    if r.accept is None or g is None or r.risk is None:
        return None
    lam, online = r.rule_threshold, r.rule == "online"
    reason = r.abstain
    if reason is None and g.rules[r.risk] is None and not online:
        reason = f"no rule met the risk target {r.risk:g} on the calibration split: nothing is accepted at it"
    elif reason is None and lam is None and not r.accept:
        reason = f"the online rule of the risk target {r.risk:g} stands above every confidence: nothing is accepted"
    elif reason is None and not r.accept:
        why = []
        past = not (r.ood_score >= g.ood_threshold if OOD_METRICS[metric] else r.ood_score <= g.ood_threshold)
        if past:
            side = "below" if OOD_METRICS[metric] else "above"
            why.append(f"the {metric} score {r.ood_score:.4g} is {side} the rule's OOD cut {g.ood_threshold:.4g}")
        conf = float(r.probs[r.prediction])
        if lam is not None and conf < lam:
            which = "online rule's threshold" if online else "rule's threshold"
            why.append(f"confidence {conf:.4g} is below the {which} {lam:.4g}")
        reason = "; ".join(why)
    if r.suspended and r.abstain is None and not online:  # HYDRA_DRIFT_POLICY=mark: the decision as without the alarm
        mark = (
            f"the drift alarm is on since input {r.alarm_at}: the certificate does not hold now (the decision is "
            "shown as without the alarm)"
        )
        reason = f"{mark}; {reason}" if reason else mark
    return Selective(
        accept=r.accept,
        risk=r.risk,
        certified=g.rules[r.risk] is not None and not r.suspended,
        rule="online" if online else "certified",
        suspended=bool(r.suspended),
        alarm_at=r.alarm_at,
        threshold=lam,
        ood_threshold=g.ood_threshold,
        reason=reason,
    )


def _conformal(r: ItemResult, labels: list[str], g: Guarantees | None) -> ConformalSet | None:
    """The answer's prediction set, its labels most probable first."""
    if r.prediction_set is None or g is None or r.set_alpha is None:
        return None
    idx = [int(j) for j in np.argsort(-r.probs, kind="stable") if r.prediction_set[j]]
    method = cast(Literal["lac", "aps", "raps"], g.sets.method)  # SetCalibrator accepts these alone
    return ConformalSet(
        alpha=r.set_alpha,
        delta=None if r.alpha_t is not None else g.sets.delta,  # the adaptive method's guarantee is long-run
        set=[labels[j] for j in idx],
        size=len(idx),
        method=method,
        mondrian=g.mondrian,
        below_min_alpha=r.below_min_alpha,
        filled=r.set_filled,
        adaptive=True if r.alpha_t is not None else None,
        alpha_t=r.alpha_t,
        suspended=bool(r.suspended),
    )


def _all_scores(r: ItemResult) -> dict[str, float]:
    """Every OOD score of one input: the probability scores always, the others when the artifact has statistics."""
    base = {"msp": r.msp, "entropy": r.entropy, "mutual_information": r.mutual_information}
    return {**base, **(r.scores or {})}
