"""The one inference path every inference endpoint shares (``/predict``, ``/zero-shot``, the Open Inference
Protocol's ``infer``): a parsed request (:class:`~service.api.requests.ParsedRequest`) -> check the configured limits
-> pick the model (:func:`service.lifecycle.pick`) -> prepare the inputs (decode, preprocess) -> run them through
the model's batcher (:meth:`service.runtime.Runtime.outcome`) -> record the answer in the prediction store under
the request's ID (:meth:`service.runtime.monitor.LiveMonitor.record`, when the store is on). Each endpoint parses
its own body and shapes its own answer from the :class:`~service.runtime.Outcome`; what happens in between is here,
once.

The request's access line gets the model, its version, the number of inputs, of OOD-flagged inputs and the largest
mutual information (:class:`~service.logs.InferenceNote`); with ``HYDRA_LOG_PREDICTIONS`` every prediction is logged.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request

from service.api.requests import ParsedRequest
from service.lifecycle import ServerState, pick
from service.logs import InferenceNote, log_predictions
from service.runtime import Outcome, Runtime
from service.tracing import request_id as new_request_id

__all__ = ["INLINE_BYTES", "prepare_inputs", "request_id", "run_inference", "server_state"]

# inputs larger than this (bytes) are decoded in a worker thread, not on the event loop
INLINE_BYTES = 32 * 1024


def server_state(request: Request) -> ServerState:
    """The state the app's handlers share (set by :func:`service.entrypoints.app.create_app`)."""
    return request.app.state.hydra


def request_id(request: Request) -> str:
    """The request's ID (:class:`service.api.middleware.RequestContext`; a new one if the request bypassed it)."""
    rid = request.scope.get("hydra.request_id")
    if rid is None:
        rid = request.scope["hydra.request_id"] = new_request_id(None)
    return rid


async def prepare_inputs(rt: Runtime, parsed: ParsedRequest) -> list[Any]:
    """Decode and preprocess the request's inputs for ``rt``: large ones in a worker thread, so that the event
    loop keeps answering while an image is decoded. Already preprocessed inputs pass through."""
    if parsed.preprocessed:
        return list(parsed.items)
    if sum(len(x) for x in parsed.items) <= INLINE_BYTES:
        return rt.prepare(parsed.items, parsed.field, base64_encoded=parsed.base64_encoded)
    return await anyio.to_thread.run_sync(
        lambda: rt.prepare(parsed.items, parsed.field, base64_encoded=parsed.base64_encoded)
    )


async def run_inference(request: Request, parsed: ParsedRequest) -> tuple[Runtime, Outcome]:
    """Check limits -> pick the model -> prepare the inputs -> the model's results, in input order.

    The multipart form (if any) is closed once the inputs are prepared, whatever happens.
    """
    state = server_state(request)
    try:
        parsed.check_limits(state.settings)
        rt = pick(state, parsed.model, parsed.modality, parsed.task)
        note = request.scope["hydra.inference"] = InferenceNote(rt.name, rt.version, inputs=len(parsed.items))
        prepared = await prepare_inputs(rt, parsed)
    finally:
        await parsed.close()
    out = await rt.outcome(prepared, parsed.query)
    if parsed.query.monitor:  # kept for a recall, should the drift alarm go on (service.core.recall)
        rt.note_answers(request_id(request), out.results)
    if rt.monitor is not None and parsed.query.monitor:  # into the prediction store's queue: never blocks
        own = parsed.query.labels is None
        rt.monitor.record(request_id(request), out.results, None if own else out.labels, parsed.query.adaptive)
    note.ood_flagged = sum(r.ood_flag for r in out.results)
    note.max_mutual_information = max(r.mutual_information for r in out.results)
    if state.settings.log_predictions:
        log_predictions(note, _rows(out), json_format=state.settings.log_format == "json")
    return rt, out


def _rows(out: Outcome) -> list[dict[str, Any]]:
    """What the prediction log keeps of each input: label, confidence, uncertainty, OOD flag and score."""
    return [
        {
            "label": out.labels[r.prediction],
            "confidence": float(r.probs[r.prediction]),
            "msp": r.msp,
            "entropy": r.entropy,
            "expected_entropy": r.expected_entropy,
            "mutual_information": r.mutual_information,
            "disagreement": r.disagreement,
            "ood_score": r.ood_score,
            "ood_flag": r.ood_flag,
        }
        for r in out.results
    ]
