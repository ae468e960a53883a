"""The HTTP routes (docs/api.md): health, readiness, metrics, the model list, ``/predict`` and ``/zero-shot``.

Handlers are thin. The two inference endpoints share one path, :func:`infer`: parse the
body (:mod:`service.requests`) -> check the configured limits -> pick the model
(:func:`service.lifecycle.pick`) -> prepare the inputs (decode, preprocess) -> run them
through the model's batcher (:meth:`service.runtimes.Runtime.answer`). The answer is a
:class:`~service.schemas.PredictResponse`, sent without its unset fields. Errors are
domain exceptions mapped to the contract's body in :mod:`service.errors`.

The route declarations carry the OpenAPI documentation: response models, the error
answers of each route, and both request bodies (JSON and multipart) of the inference routes.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from .errors import NotReady
from .lifecycle import ServerState, pick
from .metrics import CONTENT_TYPE_LATEST
from .requests import ParsedRequest, parse_request
from .runtimes import Runtime
from .schemas import (
    ERROR_RESPONSES,
    HealthResponse,
    ModelsResponse,
    PredictRequest,
    PredictResponse,
    ReadyResponse,
    ZeroShotRequest,
)

__all__ = ["infer", "install_routes"]

# inputs larger than this (bytes) are decoded in a worker thread, not on the event loop
INLINE_BYTES = 32 * 1024


def server_state(request: Request) -> ServerState:
    """The state the app's handlers share (set by :func:`service.main.create_app`)."""
    return request.app.state.hydra


async def prepare_inputs(rt: Runtime, parsed: ParsedRequest) -> list[Any]:
    """Decode and preprocess the request's inputs for ``rt``: large ones in a worker thread, so that the event
    loop keeps answering while an image is decoded."""
    if sum(len(x) for x in parsed.items) <= INLINE_BYTES:
        return rt.prepare(parsed.items, parsed.field, base64_encoded=parsed.base64_encoded)
    return await anyio.to_thread.run_sync(
        lambda: rt.prepare(parsed.items, parsed.field, base64_encoded=parsed.base64_encoded)
    )


async def infer(request: Request, task: str) -> JSONResponse:
    """The one inference path: parse -> check limits -> pick the model -> prepare the inputs -> answer.

    The multipart form (if any) is closed once the inputs are prepared, whatever happens.
    """
    state = server_state(request)
    t0 = request.scope.get("hydra.t0", time.perf_counter())
    parsed = await parse_request(request, task, state.settings.max_items)
    try:
        parsed.check_limits(state.settings)
        rt = pick(state, parsed.model, parsed.modality, task)
        prepared = await prepare_inputs(rt, parsed)
    finally:
        await parsed.close()
    answer = await rt.answer(prepared, parsed.query, t0=t0)
    # validated when built: serialised as is; `members` (None unless asked for) is left out
    return JSONResponse(answer.model_dump(exclude_none=True))


def body_doc(json_model: type[BaseModel], extra_fields: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` of an inference route: the JSON model, or a multipart form of ``file`` parts."""
    json_schema = json_model.model_json_schema()
    form_schema = {
        "type": "object",
        "properties": {
            "file": {"type": "array", "items": {"type": "string", "format": "binary"}, "description": "image files"},
            "model": {"type": "string", "minLength": 1},
            "top_k": {"type": "integer", "minimum": 1, "default": 5},
            "return_members": {"type": "boolean", "default": False},
            **extra_fields,
        },
        "required": ["file"],
        "additionalProperties": False,
    }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": json_schema}, "multipart/form-data": {"schema": form_schema}},
        }
    }


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def readyz(request: Request) -> dict[str, Any]:
    state = server_state(request)
    if state.load_error is not None:
        raise NotReady("not ready: loading the models failed (the server log has the details); restart it")
    if not state.ready:
        raise NotReady("not ready: models are loading or warming up, or the server is shutting down")
    bad = state.unhealthy()
    if bad:
        s = state.settings
        raise NotReady(
            f"not ready: model(s) {', '.join(bad)} failed {s.unready_after_failures} or more batches in a row; "
            f"a probe batch runs every {s.probe_interval_s:g} s until one succeeds"
        )
    return {"status": "ready", "models": list(state.runtimes)}


async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    return {"models": [rt.describe() for rt in server_state(request).runtimes.values()]}


async def predict(request: Request) -> JSONResponse:
    return await infer(request, "classification")


async def zero_shot(request: Request) -> JSONResponse:
    return await infer(request, "zero-shot")


def install_routes(app: FastAPI) -> None:
    """Declare every route on ``app`` itself (not through an included router), so that ``app.routes`` lists each
    path: the middleware labels the requests answered before routing by them, and deployment checks read them."""
    app.get("/healthz", response_model=HealthResponse, tags=["health"], summary="Alive")(healthz)
    app.get(
        "/readyz", response_model=ReadyResponse, tags=["health"], summary="Every model loaded and warmed up",
        responses={503: ERROR_RESPONSES[503]},
    )(readyz)  # fmt: skip
    app.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response)(metrics)
    app.get(
        "/v1/models", response_model=ModelsResponse, tags=["models"], summary="Loaded models",
        responses={401: ERROR_RESPONSES[401]},
    )(models)  # fmt: skip
    errors = {k: ERROR_RESPONSES[k] for k in (400, 401, 413, 415, 422, 500, 503)}
    app.post(
        "/predict", response_model=PredictResponse, tags=["inference"], responses=errors,
        summary="Classify texts or images, with uncertainty and an OOD flag",
        openapi_extra=body_doc(PredictRequest, {}),
    )(predict)  # fmt: skip
    app.post(
        "/zero-shot", response_model=PredictResponse, tags=["inference"], responses=errors,
        summary="Classify images against labels given in the request (zero-shot model)",
        openapi_extra=body_doc(ZeroShotRequest, {
            "labels": {"type": "string", "description": 'JSON list (["cat","dog"]), or one field per label'},
            "template": {"type": "string", "default": "A photo of a {label}."},
        }),
    )(zero_shot)  # fmt: skip
