"""The feedback routes (docs/api.md "Feedback and live quality"): true labels for answers already given, and the
live figures they make. Extension routes of this server: neither the Open Inference Protocol nor KServe's V1
protocol has a feedback endpoint.

* ``POST /v1/models/{name}/feedback``: a batch of ``{id, index, label}`` (at most :data:`MAX_FEEDBACK`), one status
  per item (:meth:`service.store.PredictionStore.add_feedback`); then the model's monitor applies the new labels
  (:meth:`service.runtime.monitor.LiveMonitor.apply`) and the live gauges follow.
* ``GET /v1/models/{name}/monitor``: the live figures (:meth:`~service.runtime.monitor.LiveMonitor.report`), the
  drift alarm and the store's state.

Both need the API key when one is set (the middleware's auth, as every route but the probes and metrics). The
store's calls block on the database, so they run in a worker thread, never on the event loop. With the store off
(``HYDRA_STORE=off``) both answer 409 :class:`StoreOff`; with a store that could not be opened, or a database that
is down, 503 ``not_ready`` with ``Retry-After`` (:class:`~service.store.StoreUnavailable`: nothing was committed,
and a retry is safe because feedback is idempotent).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import anyio
from fastapi import Request

from service.api.dataplane import server_state
from service.api.error_bodies import validate_json_body
from service.api.schemas import MAX_FEEDBACK, FeedbackRequest, FeedbackResponse, FeedbackResult
from service.core.errors import InvalidInput, NotFound, ServiceError
from service.lifecycle import ServerState
from service.runtime import Runtime
from service.runtime.monitor import LiveMonitor
from service.store import FEEDBACK_STATUSES, FeedbackItem, PredictionStore, StoreUnavailable

__all__ = ["MAX_FEEDBACK", "StoreOff", "feedback", "monitor", "store_metrics"]

log = logging.getLogger("hydra.feedback")
SEND = f'{{"feedback": [{{"id": "<X-Request-ID>", "index": 0, "label": "<label>"}}, ...]}} (1 to {MAX_FEEDBACK} items)'


class StoreOff(ServiceError, code="conflict", status=409):
    """The prediction store is off (``HYDRA_STORE=off``): there is nothing to label and nothing to monitor."""


def _monitored(state: ServerState, name: str) -> tuple[Runtime, PredictionStore, LiveMonitor]:
    """The model named ``name`` (404), the store (409 off, 503 not opened) and the model's monitor."""
    rt = state.runtimes.get(name)
    if rt is None:
        raise NotFound(f"unknown model {name[:64]!r}; served: {sorted(state.runtimes)}")
    if not state.settings.store:
        raise StoreOff(
            "the prediction store is off (HYDRA_STORE=off): answers are not recorded, so there is no feedback or "
            "live monitor; start the server with HYDRA_STORE=on"
        )
    if state.store is None or rt.monitor is None:
        raise StoreUnavailable(
            f"the prediction store is not open ({state.store_error or 'the server is starting'}); retry later", 5
        )
    return rt, state.store, rt.monitor


async def feedback(request: Request, model_name: str) -> FeedbackResponse:
    """Store true labels for the answers of ``model_name``: one status per item, in order."""
    state = server_state(request)
    rt, store, mon = _monitored(state, model_name)
    try:
        body = validate_json_body(await request.body(), FeedbackRequest, SEND)
    except InvalidInput as e:  # malformed JSON too: 422, as every body that does not fit
        raise InvalidInput(e.message, status=422) from None
    items = [FeedbackItem(e.id, e.index, e.label) for e in body.feedback]
    statuses = await anyio.to_thread.run_sync(store.add_feedback, rt.name, rt.labels, items)
    counts = {s: 0 for s in FEEDBACK_STATUSES}
    for s in statuses:
        counts[s] += 1
    for s, n in counts.items():
        state.metrics.feedback.labels(rt.name, s).inc(n)  # 0 too: every status's series exists once feedback came
    if counts["accepted"]:
        try:  # committed already: a store that fails now delays the figures, not the answer
            await anyio.to_thread.run_sync(mon.apply)
        except Exception as e:
            log.warning("%s: feedback stored, monitor not updated yet (%s)", rt.name, e)
    return FeedbackResponse(results=[FeedbackResult(status=s) for s in statuses])


async def monitor(request: Request, model_name: str) -> dict[str, Any]:
    """The model's live figures, alarms and store state now."""
    state = server_state(request)
    rt, store, mon = _monitored(state, model_name)
    drift = rt.drift_state()
    alarm_at = drift["alarm_at"] if drift is not None else None
    report = await anyio.to_thread.run_sync(mon.report, alarm_at)
    return {
        **report,
        "drift": drift,
        "store": {"backend": store.backend, "stats": asdict(store.stats())},
    }


def store_metrics(state: ServerState) -> None:
    """The store's gauges at scrape time: its writer's counters and whether the database is up."""
    m, store = state.metrics, state.store
    if store is None:
        m.store_up.set(0)
        return
    st = store.stats()
    m.store_up.set(1 if st.up else 0)
    outcomes = {"written": st.written, "queued": st.queued}
    outcomes.update({f"dropped_{k}": v for k, v in st.dropped.items()})
    for outcome, n in outcomes.items():
        m.store_records.labels(outcome).set(n)
