"""The HTTP routes (docs/api.md): health, readiness, metrics, the model list, ``/predict`` and ``/zero-shot``; the
feedback and monitor routes are :mod:`service.api.feedback_routes`'s.

Handlers are thin. The two inference endpoints share one path, :func:`answer_body`: parse the
body (:mod:`service.api.requests`), then the inference path every endpoint shares
(:func:`service.api.dataplane.run_inference`: limits -> model -> inputs -> batcher). The answer is plain data shaped
as :class:`~service.api.schemas.PredictResponse` dumps without its unset fields
(:func:`service.api.answers.predict_answer`), written with orjson. JSON requests to these routes are answered by
:class:`service.api.middleware.Front` through the same :func:`answer_body` without FastAPI's routing
(:data:`FAST_ROUTES`); the routes here answer the rest (multipart bodies) and document both.
Errors are domain exceptions mapped to the contract's body in :mod:`service.api.error_bodies`. The Open
Inference Protocol's routes (``/v2``) are :mod:`service.api.oip`.

The route declarations carry the OpenAPI documentation: response models, the error
answers of each route (the contract's body, also where FastAPI would declare its own:
:func:`contract_openapi`), and both request bodies (JSON and multipart) of the inference routes.
``/docs`` is Swagger UI with its files served by the app (:func:`install_docs`): it works offline.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from service.api.answers import dumps, predict_answer
from service.api.dataplane import request_id, run_inference, server_state
from service.api.feedback_routes import feedback, monitor, store_metrics
from service.api.requests import ParsedRequest, parse_json_body, parse_request
from service.api.schemas import (
    ERROR_RESPONSES,
    TEMPLATE_PATTERN,
    FeedbackRequest,
    FeedbackResponse,
    HealthResponse,
    ModelsResponse,
    PredictRequest,
    PredictResponse,
    ReadyResponse,
    ZeroShotRequest,
)
from service.core.errors import Forbidden, NotFound, NotReady
from service.core.recall import combine
from service.lifecycle import not_ready_reason
from service.metrics import CONTENT_TYPE_LATEST

__all__ = ["DOCS_ASSETS", "FAST_ROUTES", "answer_body", "contract_openapi", "infer", "install_docs", "install_routes"]

# Swagger UI 5's files (it reads the OpenAPI 3.1 document the app writes), served by the app itself from the
# pinned fastapi-offline package (no CDN: /docs works offline): URL path under DOCS_ASSETS -> (the package's file,
# media type). A fixed list, each its own route: no request names a file.
SWAGGER_ASSETS = {
    "swagger-ui-bundle.js": ("swagger-ui-bundle.js", "text/javascript"),
    "swagger-ui.css": ("swagger-ui.css", "text/css"),
    "favicon-32x32.png": ("favicon.png", "image/png"),
}
DOCS_ASSETS = "/docs/assets"
ERROR_REF = "#/components/schemas/ErrorResponse"
# the documented /zero-shot request's image: an 8x8 grey PNG, base64
EXAMPLE_IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAAAAADhZOFXAAAAEElEQVR42mNsYIAAJgaKGAAmCACQtTEKkQAAAABJRU5ErkJggg=="


async def answer_body(request: Request, task: str, parsed: ParsedRequest | None = None) -> bytes:
    """Parse the body of ``/predict`` or ``/zero-shot`` (unless ``parsed`` already) -> the shared inference path ->
    the answer's JSON bytes."""
    t0 = request.scope.get("hydra.t0", time.perf_counter())
    if parsed is None:
        parsed = await parse_request(request, task, server_state(request).settings.max_items)
    rt, out = await run_inference(request, parsed)
    return dumps(predict_answer(rt, out, parsed.query, t0, request_id(request)))


async def infer(request: Request, task: str) -> Response:
    """The route's answer (:func:`answer_body`)."""
    return Response(await answer_body(request, task), media_type="application/json")


async def read_body(receive: Receive) -> bytes:
    """A request's whole body from the ASGI channel (what ``Request.body`` does, without its wrappers)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _fast(task: str) -> Any:
    async def route(scope: Scope, receive: Receive) -> bytes:
        parsed = parse_json_body(await read_body(receive), task)
        return await answer_body(Request(scope, receive), task, parsed)

    return route


# the JSON requests answered by service.api.middleware.Front without FastAPI's routing: path -> (scope, receive) -> body
FAST_ROUTES = {"/predict": _fast("classification"), "/zero-shot": _fast("zero-shot")}


def body_doc(json_model: type[BaseModel], extra_fields: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` of an inference route: the JSON model (with a request that works: Swagger UI's
    "Try it out" and schemathesis' examples send it), or a multipart form of ``file`` parts."""
    json_schema = json_model.model_json_schema()
    # the guarantees' levels, as in JSON: a number in (0, 1) (a risk the model was not built with is 422)
    levels = {
        k: {
            "type": "number",
            "exclusiveMinimum": 0,
            "exclusiveMaximum": 1,
            "description": json_schema["properties"][k].get("description", ""),
        }
        for k in ("alpha", "ood_alpha", "risk")
    }
    form_schema = {
        "type": "object",
        "properties": {
            "file": {"type": "array", "items": {"type": "string", "format": "binary"}, "description": "image files"},
            "model": {"type": "string", "minLength": 1},
            "top_k": {"type": "integer", "minimum": 1, "default": 5},
            "return_members": {"type": "boolean", "default": False},
            "return_scores": {"type": "boolean", "default": False},
            **levels,
            **extra_fields,
        },
        "required": ["file"],
        "additionalProperties": False,
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": json_schema, "example": example},
                "multipart/form-data": {"schema": form_schema},
            },
        }
    }


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def readyz(request: Request) -> dict[str, Any]:
    state = server_state(request)
    reason = not_ready_reason(state)
    if reason is not None:
        raise NotReady(reason)
    return {"status": "ready", "models": list(state.runtimes), **building(state)}


async def metrics(request: Request) -> Response:
    """The Prometheus text, with each drift alarm's buffered inputs taken in first: the state at scrape time."""
    state = server_state(request)
    for rt in state.runtimes.values():
        rt.refresh_drift()
    store_metrics(state)
    state.metrics.ready.set(1.0 if not_ready_reason(state) is None else 0.0)  # what /readyz answers now
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {"models": [rt.describe() for rt in state.runtimes.values()], **building(state)}


def building(state: Any) -> dict[str, Any]:
    """The models not served yet (``make serve`` builds them while it serves the first): ``building``, each with its
    time so far and the time left as its builder estimates it, and ``failed``, each with why."""
    return {
        "building": [note.describe() for note in state.building.values()],
        "failed": [{"name": k, "status": "failed", "reason": v} for k, v in state.build_failed.items()],
    }


def _runtime(request: Request, name: str) -> Any:
    """The loaded model named ``name`` (404 naming the served ones)."""
    state = server_state(request)
    rt = state.runtimes.get(name)
    if rt is None:
        raise NotFound(f"unknown model {name[:64]!r}; served: {sorted(state.runtimes)}")
    return rt


async def drift(request: Request, model_name: str) -> dict[str, Any]:
    """The model's drift alarm now, with its last episodes (docs/api.md "Guarantees")."""
    name = model_name
    rt = _runtime(request, name)
    state = rt.drift_state()
    if state is None:
        raise NotFound(f"model {name!r} has no drift test (it was built without a calibration split)")
    if rt.monitor is not None:  # the store's recalls: every replica's, across restarts (service.core.recall)
        try:
            stored = await asyncio.to_thread(rt.monitor.stored_recalls)
            state["recalled"] = combine(stored, state["recalled"])
        except Exception as e:  # the store is down: this server's own recalls, said so
            state["recalled_note"] = f"the prediction store could not be read ({e}): this server's recalls only"
    return {"model": rt.name, **state}


async def drift_reset(request: Request, model_name: str) -> dict[str, Any]:
    """Restart the drift alarm's statistic after an investigation (an open episode closes); only for an
    authenticated caller (``HYDRA_API_KEY``)."""
    name = model_name
    if not server_state(request).settings.api_key:
        raise Forbidden(
            "resetting a drift alarm needs an authenticated caller: start the server with HYDRA_API_KEY "
            "set and send Authorization: Bearer <key>"
        )
    rt = _runtime(request, name)
    if rt.drift_state() is None:
        raise NotFound(f"model {name!r} has no drift test (it was built without a calibration split)")
    return rt.reset_drift()


async def predict(request: Request) -> Response:
    return await infer(request, "classification")


async def zero_shot(request: Request) -> Response:
    return await infer(request, "zero-shot")


@functools.cache
def _swagger_asset(name: str) -> bytes:
    """One of :data:`SWAGGER_ASSETS`' files, read once (the bundle is about 1.5 MB)."""
    import fastapi_offline

    return (Path(fastapi_offline.__file__).parent / "static" / name).read_bytes()


def _asset_handler(name: str, media_type: str) -> Any:
    async def asset() -> Response:
        return Response(_swagger_asset(name), media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})

    return asset


async def swagger_ui(request: Request) -> HTMLResponse:
    """FastAPI's Swagger UI page, its script, style sheet and icon from :data:`DOCS_ASSETS` (behind a proxy's
    ``root_path`` too); no validator badge, which Swagger UI would fetch from outside."""
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(
        openapi_url=root + (request.app.openapi_url or "/openapi.json"),
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None},
    )


def install_docs(app: FastAPI) -> None:
    """``GET /docs`` (Swagger UI, its assets served here) and the OpenAPI document with the contract's error body
    (:func:`contract_openapi`). The app is made with ``docs_url=None`` (FastAPI's page loads its assets from a CDN)
    and ``redoc_url=None`` (ReDoc has no pinned package to serve it from). Auth is the middleware's: with
    ``HYDRA_API_KEY`` set, ``/docs`` and its assets need the key alike."""
    app.get("/docs", include_in_schema=False)(swagger_ui)
    for url, (name, media_type) in SWAGGER_ASSETS.items():
        app.get(f"{DOCS_ASSETS}/{url}", include_in_schema=False)(_asset_handler(name, media_type))
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = contract_openapi(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def contract_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's OpenAPI document with the contract's error body where FastAPI declares its own.

    FastAPI gives every route with a parameter a 422 ``HTTPValidationError``; this server never sends that body
    (:mod:`service.api.error_bodies` answers validation errors with ``{"error": {"code", "message"}}``). Where a query
    parameter or a body could fail validation the 422 becomes ``ErrorResponse``; where the only parameters are
    strings in the path (``model_name``), which cannot fail, it goes. Then so do the unused schemas.
    """
    for path_item in schema.get("paths", {}).values():
        for op in path_item.values():
            responses = op.get("responses", {})
            if "HTTPValidationError" not in json.dumps(responses.get("422", {})):
                continue
            params = [
                p
                for p in op.get("parameters", [])
                if p.get("in") != "path" or p.get("schema", {}).get("type") != "string"
            ]
            if params or "requestBody" in op:
                description = ERROR_RESPONSES[422]["description"]
                responses["422"] = {
                    "description": description,
                    "content": {"application/json": {"schema": {"$ref": ERROR_REF}}},
                }
            else:
                del responses["422"]
    components = schema.get("components", {}).get("schemas", {})
    if "HTTPValidationError" not in json.dumps(schema.get("paths", {})):
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)  # only HTTPValidationError refers to it
    return schema


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: the contract's error body (``ErrorResponse``) for each status it may answer."""
    return {k: ERROR_RESPONSES[k] for k in codes}


def install_routes(app: FastAPI) -> None:
    """Declare every route on ``app`` itself (not through an included router), so that ``app.routes`` lists each
    path: the middleware labels the requests answered before routing by them, and deployment checks read them.
    Each route declares the errors it may answer (401: the middleware's, on every route but the probes and metrics;
    500: any unexpected failure), all with the contract's body; ``/docs`` and the document: :func:`install_docs`."""
    _install_health(app)
    _install_models(app)
    _install_inference(app)
    install_docs(app)


def _install_health(app: FastAPI) -> None:
    """The probes and the metrics: no authentication."""
    app.get("/healthz", response_model=HealthResponse, tags=["health"], summary="Alive")(healthz)
    app.get(
        "/readyz",
        response_model=ReadyResponse,
        tags=["health"],
        summary="Every model loaded and warmed up",
        responses=_errors(503),
    )(readyz)
    app.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response)(metrics)


def _install_models(app: FastAPI) -> None:
    """The loaded models and their drift tests."""
    app.get(
        "/v1/models",
        response_model=ModelsResponse,
        tags=["models"],
        summary="Loaded models",
        responses=_errors(401, 500),
    )(models)
    app.get(
        "/v1/models/{model_name}/drift",
        tags=["models"],
        summary="The model's drift alarm: on or off, statistic, inputs seen, its last episodes",
        responses=_errors(401, 404, 500),
    )(drift)
    app.post(
        "/v1/models/{model_name}/drift/reset",
        tags=["models"],
        summary="Restart the drift alarm's statistic (authenticated callers)",
        responses=_errors(401, 403, 404, 500),
    )(drift_reset)
    app.post(
        "/v1/models/{model_name}/feedback",
        response_model=FeedbackResponse,
        tags=["feedback"],
        summary="True labels for answers given (extension route): one status per item",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": FeedbackRequest.model_json_schema()}},
            }
        },
        responses=_errors(401, 404, 409, 413, 422, 500, 503),
    )(feedback)
    app.get(
        "/v1/models/{model_name}/monitor",
        tags=["feedback"],
        summary="Live quality: realised and estimated accuracy, coverage, adaptive sets, harmful-shift alarm",
        responses=_errors(401, 404, 409, 500, 503),
    )(monitor)


def _install_inference(app: FastAPI) -> None:
    """``/predict`` and ``/zero-shot``, with their form bodies and examples documented."""
    # both answer a PredictResponse, with the same errors
    post = functools.partial(
        app.post,
        response_model=PredictResponse,
        tags=["inference"],
        responses=_errors(400, 401, 413, 415, 422, 500, 503),
    )
    post(
        "/predict",
        summary="Classify texts or images, with uncertainty and an OOD flag",
        openapi_extra=body_doc(PredictRequest, {}, {"text": "I love this phone, best purchase ever", "top_k": 2}),
    )(predict)
    post(
        "/zero-shot",
        summary="Classify images against labels given in the request (zero-shot model)",
        openapi_extra=body_doc(
            ZeroShotRequest,
            {
                "labels": {
                    "type": "string",
                    "description": 'JSON list (["cat","dog"]), one field per label, or one '
                    "comma-separated field; two or more, distinct once case-folded and stripped",
                },
                "template": {"type": "string", "default": "A photo of a {label}.", "pattern": TEMPLATE_PATTERN},
            },
            {"image": EXAMPLE_IMAGE, "labels": ["shirt", "dress", "coat"], "top_k": 2},
        ),
    )(zero_shot)
