"""The HTTP routes (docs/api.md): health, readiness, metrics, the model list, ``/predict`` and ``/zero-shot``.

Handlers are thin. The two inference endpoints share one path, :func:`infer`: parse the
body (:mod:`service.requests`), then the inference path every endpoint shares
(:func:`service.pipeline.run_inference`: limits -> model -> inputs -> batcher). The answer is a
:class:`~service.schemas.PredictResponse` (:meth:`service.runtimes.Runtime.respond`), sent
without its unset fields, serialised by pydantic-core and not validated again (:func:`json_answer`).
Errors are domain exceptions mapped to the contract's body in :mod:`service.errors`. The Open
Inference Protocol's routes (``/v2``) are :mod:`service.routes_oip`.

The route declarations carry the OpenAPI documentation: response models, the error
answers of each route, and both request bodies (JSON and multipart) of the inference routes.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from .errors import Forbidden, NotFound, NotReady
from .lifecycle import not_ready_reason
from .metrics import CONTENT_TYPE_LATEST
from .pipeline import request_id, run_inference, server_state
from .requests import parse_request
from .schemas import (
    ERROR_RESPONSES,
    HealthResponse,
    ModelsResponse,
    PredictRequest,
    PredictResponse,
    ReadyResponse,
    ZeroShotRequest,
)

__all__ = ["infer", "install_routes", "json_answer"]


async def infer(request: Request, task: str) -> Response:
    """Parse the body of ``/predict`` or ``/zero-shot`` -> the shared inference path -> the answer."""
    t0 = request.scope.get("hydra.t0", time.perf_counter())
    parsed = await parse_request(request, task, server_state(request).settings.max_items)
    rt, out = await run_inference(request, parsed)
    answer = rt.respond(out, parsed.query, t0, request_id(request))
    return json_answer(answer)


def json_answer(answer: BaseModel) -> Response:
    """``answer`` as a JSON response, without its None fields (``members`` unless asked for, ...).

    Validated when built, so serialised as is, in one call into pydantic-core (Rust) rather than through a dict of
    Python objects and ``json.dumps``. With every None field left out, ``null`` can only be a non-finite float (which
    pydantic writes as null): such an answer goes through ``json.dumps``, which refuses it (500 ``internal``) as
    before. The bytes differ from ``json.dumps``' only in how some floats are spelt (``0.00001`` for ``1e-05``: the
    same number).
    """
    body = answer.model_dump_json(exclude_none=True).encode()
    if b"null" in body:  # rare (also a label or ID spelling "null"): the strict path decides
        return JSONResponse(answer.model_dump(exclude_none=True))
    return Response(body, media_type="application/json")


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
    reason = not_ready_reason(state)
    if reason is not None:
        raise NotReady(reason)
    return {"status": "ready", "models": list(state.runtimes)}


async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    return {"models": [rt.describe() for rt in server_state(request).runtimes.values()]}


def _runtime(request: Request, name: str) -> Any:
    """The loaded model named ``name`` (404 naming the served ones)."""
    state = server_state(request)
    rt = state.runtimes.get(name)
    if rt is None:
        raise NotFound(f"unknown model {name[:64]!r}; served: {sorted(state.runtimes)}")
    return rt


async def drift(request: Request, model_name: str) -> dict[str, Any]:
    """The model's drift test now (docs/api.md "Guarantees")."""
    name = model_name
    rt = _runtime(request, name)
    state = rt.drift_state()
    if state is None:
        raise NotFound(f"model {name!r} has no drift test (it was built without a calibration split)")
    return {"model": rt.name, **state}


async def drift_reset(request: Request, model_name: str) -> dict[str, Any]:
    """Start a fresh drift test after an investigation; only for an authenticated caller (``HYDRA_API_KEY``)."""
    name = model_name
    if not server_state(request).settings.api_key:
        raise Forbidden("resetting a drift alarm needs an authenticated caller: start the server with HYDRA_API_KEY "
                        "set and send Authorization: Bearer <key>")  # fmt: skip
    rt = _runtime(request, name)
    if rt.drift_state() is None:
        raise NotFound(f"model {name!r} has no drift test (it was built without a calibration split)")
    return rt.reset_drift()


async def predict(request: Request) -> Response:
    return await infer(request, "classification")


async def zero_shot(request: Request) -> Response:
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
    app.get(
        "/v1/models/{model_name}/drift", tags=["models"],
        summary="The model's drift test: alarm, statistic, inputs seen",
        responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]},
    )(drift)  # fmt: skip
    app.post(
        "/v1/models/{model_name}/drift/reset", tags=["models"],
        summary="Start a fresh drift test (authenticated callers)",
        responses={k: ERROR_RESPONSES[k] for k in (401, 403, 404)},
    )(drift_reset)  # fmt: skip
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
