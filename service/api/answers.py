"""The body of a ``/predict`` or ``/zero-shot`` answer, built from a runtime's :class:`~service.runtime.Outcome`.

The answer is plain data (dicts, lists, Python numbers), written with ``orjson`` (:func:`dumps`): building it as
pydantic models and serialising those cost more per request than the rest of the answer path. It is exactly what
the response models of :mod:`service.api.schemas` dump without their unset fields
(``PredictResponse.model_validate(answer).model_dump(exclude_none=True) == answer``, held by the tests), so the body
the client gets and the schema the API documents (docs/api.md) stay one thing. Fields are absent, not null, when
unset. The Open Inference Protocol builds its tensors from the same outcome (:mod:`service.api.oip`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import orjson

from service.core.guarantees import Guarantees
from service.core.scores import flag_side, outlier_sign
from service.runtime import ItemResult, Outcome, Query, Runtime
from service.runtime.batching import BatchResult

__all__ = ["build_predictions", "dumps", "predict_answer"]


def predict_answer(rt: Runtime, out: Outcome, query: Query, t0: float, request_id: str) -> dict[str, Any]:
    """The answer to one request (``/predict``, ``/zero-shot``): its results over their labels, with timings;
    ``t0`` is when the request arrived (``total_ms``, taken last: it covers building the answer too)."""
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
    answer: dict[str, Any] = {"id": request_id, "model": rt.name, "model_version": rt.version}
    answer["predictions"] = predictions
    answer["timing"] = timing(out.batch, t0)
    return answer


def dumps(answer: dict[str, Any]) -> bytes:
    """``answer`` as JSON bytes. A non-finite float, which JSON cannot hold (``orjson`` writes it as null), makes
    :func:`json.dumps` raise instead (a 500 ``internal``, never a null in an answer): an answer has no null field,
    so "null" in the bytes is either such a float or a string that spells it, which the strict path passes."""
    body = orjson.dumps(answer)
    if b"null" in body:
        body = json.dumps(answer, allow_nan=False, separators=(",", ":")).encode()
    return body


def timing(res: BatchResult, t0: float) -> dict[str, float]:
    """The answer's timings: the batch's queue and inference time, and the total since ``t0``."""
    return {
        "queue_ms": round(res.queue_s * 1000, 3),
        "inference_ms": round(res.inference_s * 1000, 3),
        "total_ms": round((time.perf_counter() - t0) * 1000, 3),
    }


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
) -> list[dict[str, Any]]:
    """The ``predictions`` of an answer (docs/api.md), one per input; ``top_k`` is clamped to ``len(labels)``.

    ``members`` only when asked for; ``conformal`` and ``selective`` when the results carry them (models with a
    calibration split, ``guarantees``)."""
    k = max(1, min(int(top_k), len(labels)))
    out = []
    for r in results:
        probs = r.probs.tolist()  # Python floats, once
        order = np.argsort(-r.probs, kind="stable").tolist()
        p: dict[str, Any] = {
            "label": labels[r.prediction],
            "label_index": r.prediction,
            "confidence": probs[r.prediction],
            "top_k": [{"label": labels[j], "prob": probs[j]} for j in order[:k]],
            "uncertainty": {
                "msp": r.msp,
                "entropy": r.entropy,
                "expected_entropy": r.expected_entropy,
                "mutual_information": r.mutual_information,
                "disagreement": r.disagreement,
            },
            "ood": _ood(r, metric, threshold, return_scores),
        }
        if guarantees is not None and r.prediction_set is not None and r.set_alpha is not None:
            p["conformal"] = _conformal(r, labels, order, guarantees)
        if guarantees is not None and r.accept is not None and r.risk is not None:
            p["selective"] = _selective(r, metric, guarantees)
        if return_members:
            idx = r.member_probs.argmax(-1).tolist()  # (M,) each member's own prediction
            mp = r.member_probs.tolist()
            p["members"] = [{"label": labels[j], "confidence": mp[m][j]} for m, j in enumerate(idx)]
        out.append(p)
    return out


def _ood(r: ItemResult, metric: str, threshold: float, return_scores: bool) -> dict[str, Any]:
    """The answer's OOD block: ``threshold`` is the rule the flag applied (with a p-value, the score threshold of
    ``p_value <= alpha`` at the request's level; else the build's), and a flagged input says why."""
    past = flag_side(metric)
    out: dict[str, Any] = {"flag": r.ood_flag, "score": r.ood_score, "metric": metric}
    if r.p_value is None:
        out["threshold"] = threshold
        if r.ood_flag:
            out["reason"] = f"the {metric} score {r.ood_score:.4g} is {past} the threshold {threshold:.4g}"
    else:
        cut = r.flag_threshold
        if cut is not None:
            out["threshold"] = cut
        out["p_value"], out["alpha"] = r.p_value, r.ood_alpha
        if r.ood_flag and cut is not None:
            out["reason"] = (
                f"p-value {r.p_value:.4g} <= alpha {r.ood_alpha:g}: the {metric} score {r.ood_score:.4g} is {past} "
                f"{cut:.4g}, the threshold at this level"
            )
    if r.suspended is not None:
        out["suspended"] = r.suspended
    if return_scores:
        out["scores"] = {"msp": r.msp, "entropy": r.entropy, "mutual_information": r.mutual_information}
        out["scores"].update(r.scores or {})
    return out


def _selective(r: ItemResult, metric: str, g: Guarantees) -> dict[str, Any]:
    """The risk rule's decision, both its thresholds, what the drift alarm says, and why an input is not accepted."""
    assert r.risk is not None and r.accept is not None
    lam, online = r.rule_threshold, r.rule == "online"
    reason = r.abstain
    if reason is None and g.rules[r.risk] is None and not online:
        reason = f"no rule met the risk target {r.risk:g} on the calibration split: nothing is accepted at it"
    elif reason is None and lam is None and not r.accept:
        reason = f"the online rule of the risk target {r.risk:g} stands above every confidence: nothing is accepted"
    elif reason is None and not r.accept:
        why = []
        sign = outlier_sign(metric)
        if sign * r.ood_score > sign * g.ood_threshold:
            why.append(
                f"the {metric} score {r.ood_score:.4g} is {flag_side(metric)} the rule's OOD cut {g.ood_threshold:.4g}"
            )
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
    out: dict[str, Any] = {
        "accept": r.accept,
        "risk": r.risk,
        "certified": g.rules[r.risk] is not None and not r.suspended,
        "rule": "online" if online else "certified",
        "suspended": bool(r.suspended),
    }
    if r.alarm_at is not None:
        out["alarm_at"] = r.alarm_at
    if lam is not None:
        out["threshold"] = lam
    out["ood_threshold"] = g.ood_threshold
    if reason is not None:
        out["reason"] = reason
    return out


def _conformal(r: ItemResult, labels: list[str], order: list[int], g: Guarantees) -> dict[str, Any]:
    """The answer's prediction set, its labels most probable first (``order``: the labels by probability)."""
    assert r.prediction_set is not None
    member = r.prediction_set.tolist()
    names = [labels[j] for j in order if member[j]]
    out: dict[str, Any] = {"alpha": r.set_alpha}
    if r.alpha_t is None and g.sets.delta is not None:  # the adaptive method's guarantee is long-run
        out["delta"] = g.sets.delta
    out.update(
        {
            "set": names,
            "size": len(names),
            "method": g.sets.method,
            "mondrian": g.mondrian,
            "below_min_alpha": r.below_min_alpha,
            "filled": r.set_filled,
        }
    )
    if r.alpha_t is not None:
        out["adaptive"], out["alpha_t"] = True, r.alpha_t
    out["suspended"] = bool(r.suspended)
    return out
