"""The FastAPI app (CONTRACT.md §2): ``create_app(settings)``; ``service.main:app`` for uvicorn.

Start-up: the lifespan verifies every artifact of ``HYDRA_ARTIFACTS`` (manifest,
every file's size and sha256, settings against the artifact) and refuses to start,
naming the file, when one is missing or corrupt. Then the models are loaded and
warmed up through the full path, by default in the background once the server
accepts connections (``HYDRA_LOAD_IN_BACKGROUND``): ``/healthz`` answers 200
throughout, ``/readyz`` and the inference endpoints 503 ``not_ready`` until every
model is warm. If loading fails there, the error is logged, ``/readyz`` stays 503
and ``ServerState.on_fatal`` is called (``python -m service`` then stops with a
non-zero status, so that the orchestrator restarts it).

Readiness also goes false while a model is unhealthy (``HYDRA_UNREADY_AFTER_FAILURES``
failed batches in a row, until a probe batch succeeds; :class:`service.runtime.Runtime`).

Handlers reach the loaded models through ``request.app.state.hydra``. Errors are
domain exceptions mapped to the contract's body in :mod:`service.errors`.
"""

from __future__ import annotations

import os

# Idle OpenMP threads (torch) sleep instead of spinning: the event loop, tokenizers and ONNX Runtime share these
# cores, and spinning threads on a busy or shared machine slow small ops by 10x or more. Only effective when this
# module is the first to import torch (uvicorn service.main:app, python -m service); set it in the environment to
# choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Large CPU tensors (the activations every forward allocates and frees; the fused model's member-stacked ones are
# M times one model's) go on transparent huge pages: glibc maps them afresh each call, and 4 KiB pages cost one
# fault each (16k per 64 MiB tensor, 10-15% system time on the 2-core machines here) where 2 MiB pages cost 32.
# torch reads this on its first allocation: same import-order caveat as above.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .artifact import ArtifactError
from .backends import BackendConfigError
from .errors import (
    InvalidInput,
    NotReady,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    UnsupportedMediaType,
    error_response,
    format_validation_errors,
    install_error_handlers,
)
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .runtime import ClassifierRuntime, Runtime, ZeroShotRuntime, open_runtime
from .schemas import (
    ERROR_RESPONSES,
    FormOptions,
    HealthResponse,
    ModelsResponse,
    PredictRequest,
    PredictResponse,
    ReadyResponse,
    ZeroShotRequest,
    check_limits,
)
from .settings import Settings
from .zeroshot import CLIPZeroShotRuntime

__all__ = ["create_app", "app", "ServerState", "StartupError"]

log = logging.getLogger("hydra.service")

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# inputs larger than this (bytes) are decoded in a worker thread, not on the event loop
_INLINE_BYTES = 32 * 1024


class StartupError(RuntimeError):
    """The server refuses to start; the message says which artifact or setting is wrong."""


@dataclass
class ServerState:
    """What the handlers share: settings, metrics, the runtimes and the server's lifecycle."""

    settings: Settings
    metrics: Metrics
    runtimes: dict[str, Runtime] = field(default_factory=dict)
    # every model loaded and warmed up, and not shutting down
    ready: bool = False
    # why loading in the background failed (the server cannot serve and should be restarted)
    load_error: str | None = None
    # called (on the event loop) with load_error when background loading fails; python -m service stops the server
    on_fatal: Callable[[str], None] | None = None
    loader: asyncio.Task | None = None
    # HTTP requests received / answered (a response sent to the end), for the shutdown log and the SIGTERM check
    requests_received: int = 0
    requests_answered: int = 0

    def unhealthy(self) -> list[str]:
        """Names of the loaded models that failed their last batches (not ready until a probe batch runs)."""
        return [name for name, rt in self.runtimes.items() if not rt.healthy]

    @property
    def serving(self) -> bool:
        """What ``/readyz`` answers: ready and every model healthy."""
        return self.ready and not self.unhealthy()


# ----------------------------------------------------------------------------- middleware
class GuardMiddleware:
    """Pure ASGI: request metrics, bearer auth, body size limit. Outside routing, so it sees 404s too."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.settings.api_key
        # only the key's digest is kept; tokens are compared by digest in constant time (hmac.compare_digest),
        # so neither the content nor the length of the key can be learnt from response times
        self._key_digest = hashlib.sha256(key.get_secret_value().encode()).digest() if key is not None else None
        self._max_body = state.settings.max_body_bytes
        self._paths: frozenset[str] | None = None  # the app's route paths, read on first use

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        scope["hydra.t0"] = t0
        status = 500
        state = self.state
        state.requests_received += 1
        state.metrics.in_flight.inc()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state.requests_answered += 1

        try:
            err = self._check(scope)
            if err is not None:
                await error_response(err)(scope, receive, send_wrapper)
                return
            await self.app(scope, self._limited(receive), send_wrapper)
        finally:
            state.metrics.in_flight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or self._endpoint(scope)
            state.metrics.request_duration.labels(endpoint, str(status)).observe(time.perf_counter() - t0)

    def _endpoint(self, scope: Scope) -> str:
        """The metrics label of a request answered before routing (401, 413): its path if it is a route."""
        if self._paths is None:
            app = scope.get("app")
            self._paths = frozenset(getattr(r, "path", "") for r in getattr(app, "routes", ()))
        return scope["path"] if scope["path"] in self._paths else "unmatched"

    def _check(self, scope: Scope) -> ServiceError | None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self._key_digest is not None and scope["path"] not in PUBLIC_PATHS and scope.get("method") != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                return Unauthorized("missing bearer token: send the header 'Authorization: Bearer <HYDRA_API_KEY>'")
            if not hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest):
                return Unauthorized("invalid bearer token")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return InvalidInput("Content-Length is not an integer")
            if n > self._max_body:
                return PayloadTooLarge(
                    f"request body is {n} bytes, above the limit of {self._max_body} (HYDRA_MAX_BODY_BYTES)"
                )
        return None

    def _limited(self, receive: Receive) -> Receive:
        """Count streamed body bytes (chunked uploads have no Content-Length) and stop at the limit."""
        seen = 0
        limit = self._max_body

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"request body above the limit of {limit} bytes (HYDRA_MAX_BODY_BYTES)")
            return message

        return wrapped


# ----------------------------------------------------------------------------- request parsing
def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def _parse_json(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    if not body:
        raise InvalidInput("empty request body; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err.get("type") == "json_invalid" for err in errors):
            msg = errors[0].get("msg", "invalid JSON")
            raise InvalidInput(f"malformed JSON: {msg}; send one UTF-8 encoded JSON object") from None
        raise InvalidInput(format_validation_errors(errors), status=422) from None


def _parse_labels(values: list[str]) -> list[str]:
    """Multipart ``labels``: one JSON list, or one field per label, or one comma-separated field."""
    if len(values) == 1:
        v = values[0].strip()
        if v.startswith("["):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise InvalidInput(f"labels: malformed JSON list ({e.msg})") from None
            if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
                raise InvalidInput("labels: the JSON value must be a list of strings")
            return parsed
        return [x.strip() for x in v.split(",")]
    return values


async def _parse_multipart(
    request: Request, allowed: set[str], max_items: int
) -> tuple[list[bytes], FormOptions, Any]:
    """``file`` parts and option fields of a multipart form; unknown fields are refused by name."""
    try:
        form = await request.form(max_files=max_items + 1, max_fields=64, max_part_size=1024 * 1024)
    except StarletteHTTPException as e:  # python-multipart / Starlette refused the body (limits, syntax)
        raise InvalidInput(
            f"multipart body refused: {e.detail}; send at most {max_items} 'file' parts (HYDRA_MAX_ITEMS), "
            "64 fields and 1 MiB per field"
        ) from None
    try:
        files, opts = await _read_form(form, allowed)
    except BaseException:
        await form.close()
        raise
    return files, opts, form


async def _read_form(form: Any, allowed: set[str]) -> tuple[list[bytes], FormOptions]:
    files: list[bytes] = []
    options: dict[str, Any] = {}
    labels: list[str] = []
    for key, value in form.multi_items():
        if key == "file":
            if not isinstance(value, UploadFile):
                raise InvalidInput("file: must be a file part (curl -F file=@image.png)")
            files.append(await value.read())
        elif key not in allowed:
            raise InvalidInput(f"invalid request: {key}: unknown field (not accepted here)", status=422)
        elif isinstance(value, UploadFile):
            raise InvalidInput(f"{key}: must be a plain form field, not a file")
        elif key == "labels":
            labels.append(value)
        elif key in options:
            raise InvalidInput(f"{key}: given more than once")
        else:
            options[key] = value
    if labels:
        options["labels"] = _parse_labels(labels)
    try:
        opts = FormOptions.model_validate(options)
    except ValidationError as e:
        raise InvalidInput(format_validation_errors(e.errors(include_url=False)), status=422) from None
    return files, opts


def _state(request: Request) -> ServerState:
    return request.app.state.hydra


def _pick(state: ServerState, name: str | None, modality: str, task: str) -> Runtime:
    """The runtime named ``name``, else the only one of this task and modality; 400 when none or ambiguous."""
    if not state.ready:
        if state.load_error is not None:
            raise NotReady("the server cannot serve: loading the models failed; it is stopping")
        raise NotReady("the server is not ready (loading models or shutting down); retry shortly")
    if name is not None:
        rt = state.runtimes.get(name)
        if rt is None:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise InvalidInput(f"model: unknown model {shown!r}; loaded: {sorted(state.runtimes)}")
        # a zero-shot model also answers /predict (images) with its fixed labels
        if rt.task != task and not (task == "classification" and isinstance(rt, CLIPZeroShotRuntime)):
            other = "/predict" if rt.task == "classification" else "/zero-shot"
            raise InvalidInput(f"model: {name!r} is a {rt.task} model; send it to {other}")
        if rt.modality != modality:
            raise InvalidInput(f"model: {name!r} takes {rt.modality} inputs, not {modality}")
        return rt
    fits = [rt for rt in state.runtimes.values() if rt.task == task and rt.modality == modality]
    if not fits and task == "classification":  # no classifier of this modality: a zero-shot model's fixed labels
        fits = [rt for rt in state.runtimes.values() if isinstance(rt, CLIPZeroShotRuntime) and rt.modality == modality]
    if not fits:
        if task == "zero-shot":
            raise InvalidInput(
                "no zero-shot model is loaded; start the server with a zero-shot artifact "
                "(task: zero-shot, family clip) in HYDRA_ARTIFACTS, or use /predict"
            )
        raise InvalidInput(f"no loaded model takes {modality} inputs; loaded: {sorted(state.runtimes)}")
    if len(fits) > 1:
        raise InvalidInput(
            f"several models take {modality} inputs ({sorted(r.name for r in fits)}); choose one with 'model'"
        )
    return fits[0]


async def _prepare(
    rt: ClassifierRuntime | CLIPZeroShotRuntime, raw: list[Any], field: str, *, base64_encoded: bool
) -> list[Any]:
    size = sum(len(x) for x in raw)
    if size <= _INLINE_BYTES:
        return rt.prepare(raw, field, base64_encoded=base64_encoded)
    return await anyio.to_thread.run_sync(lambda: rt.prepare(raw, field, base64_encoded=base64_encoded))


# ----------------------------------------------------------------------------- OpenAPI bodies
def _body_doc(json_model: type[BaseModel], extra_fields: dict[str, Any]) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------- the app
def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; loading happens in its lifespan (``with TestClient(app)`` or a server), not here."""
    settings = settings if settings is not None else Settings()
    state = ServerState(settings=settings, metrics=Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _startup(state)
        try:
            yield
        finally:
            await _shutdown(state)

    app = FastAPI(
        title="hydra-serve",
        version="0.1.0",
        description="Uncertainty-aware inference with Hydra ensembles: predictions with MSP, entropy, "
        "mutual information, member disagreement and a calibrated OOD flag.",
        lifespan=lifespan,
    )
    app.state.hydra = state
    state.metrics.ready.set_function(lambda: 1.0 if state.serving else 0.0)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    if settings.cors_origins:  # outermost, so that 401/413 answers carry CORS headers too
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )  # fmt: skip
    _routes(app)
    return app


async def _startup(state: ServerState) -> None:
    """Verify every artifact (refusing to start, naming the file), then load and warm up: in the background
    (``HYDRA_LOAD_IN_BACKGROUND``, the default) or before returning."""
    s = state.settings
    logging.getLogger("hydra").setLevel(s.log_level.upper())
    if s.threads:
        import torch

        torch.set_num_threads(s.threads)
    if not s.artifacts:
        raise StartupError("HYDRA_ARTIFACTS is empty: set it to a comma-separated list of artifact directories")
    # a lifespan may run again on the same app (test clients): start from nothing loaded
    state.runtimes.clear()
    state.ready, state.load_error, state.loader = False, None, None
    try:
        for path in s.artifacts:
            rt = await anyio.to_thread.run_sync(open_runtime, path, s, state.metrics)
            if rt.name in state.runtimes:
                raise StartupError(f"{path}: model name {rt.name!r} is already used by another artifact")
            state.runtimes[rt.name] = rt
        log.info("verified: %s", ", ".join(f"{n} ({rt.root})" for n, rt in state.runtimes.items()))
        if s.load_in_background:
            state.loader = asyncio.get_running_loop().create_task(_load_in_background(state), name="hydra-load")
            log.info("loading and warming up in the background; /readyz answers 503 until done")
            return
        await _load_and_warm(state)
    except (ArtifactError, BackendConfigError, StartupError) as e:
        log.error("refusing to start: %s", e)
        await _shutdown(state)
        raise StartupError(f"refusing to start: {e}") from e
    except BaseException:
        log.exception("refusing to start")
        await _shutdown(state)
        raise


async def _load_and_warm(state: ServerState) -> None:
    """Load every verified runtime (worker threads: the event loop keeps answering), warm each up, set ready."""
    for rt in state.runtimes.values():
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(rt.load)
        log.info("%s loaded in %.2f s", rt.name, time.perf_counter() - t0)
    for rt in state.runtimes.values():
        rt.start()
    for rt in state.runtimes.values():
        t0 = time.perf_counter()
        await rt.warmup()
        d = rt.describe()
        info = (rt.name, rt.family, rt.task, d["backend"], d["device"], d["precision"])
        state.metrics.model_info.labels(*info).set(1)
        log.info("%s warmed up in %.2f s", rt.name, time.perf_counter() - t0)
    state.ready = True
    log.info("ready: %s", ", ".join(state.runtimes))


async def _load_in_background(state: ServerState) -> None:
    """:func:`_load_and_warm` after the port is bound; a failure leaves the server not ready and calls on_fatal."""
    try:
        await _load_and_warm(state)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if isinstance(e, (ArtifactError, BackendConfigError)):
            log.error("cannot serve: loading failed: %s", e)
        else:
            log.exception("cannot serve: loading failed")
        state.load_error = f"{type(e).__name__}: {e}"
        if state.on_fatal is not None:
            state.on_fatal(state.load_error)
        else:
            log.error("not ready for good: /readyz answers 503; restart the server")


async def _shutdown(state: ServerState) -> None:
    """Not ready any more; stop loading, finish what is queued, then stop the workers."""
    state.ready = False
    loader, state.loader = state.loader, None
    if loader is not None and not loader.done():
        loader.cancel()  # a model being read in a worker thread finishes first
        with contextlib.suppress(asyncio.CancelledError):
            await loader
    for rt in list(state.runtimes.values()):
        await rt.close()
    if state.runtimes:
        log.info("stopped: every queued request answered, model workers stopped (%d requests received, %d answered)",
                 state.requests_received, state.requests_answered)  # fmt: skip


def _routes(app: FastAPI) -> None:
    @app.get("/healthz", response_model=HealthResponse, tags=["health"], summary="Alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz", response_model=ReadyResponse, tags=["health"], summary="Every model loaded and warmed up",
        responses={503: ERROR_RESPONSES[503]},
    )  # fmt: skip
    async def readyz(request: Request) -> dict[str, Any]:
        state = _state(request)
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

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get(
        "/v1/models", response_model=ModelsResponse, tags=["models"], summary="Loaded models",
        responses={401: ERROR_RESPONSES[401]},
    )  # fmt: skip
    async def models(request: Request) -> dict[str, Any]:
        return {"models": [rt.describe() for rt in _state(request).runtimes.values()]}

    predict_errors = {k: ERROR_RESPONSES[k] for k in (400, 401, 413, 415, 422, 500, 503)}

    @app.post(
        "/predict", response_model=PredictResponse, tags=["inference"], responses=predict_errors,
        summary="Classify texts or images, with uncertainty and an OOD flag",
        openapi_extra=_body_doc(PredictRequest, {}),
    )  # fmt: skip
    async def predict(request: Request) -> JSONResponse:
        state = _state(request)
        s = state.settings
        t0 = request.scope.get("hydra.t0", time.perf_counter())
        media = _media_type(request)
        if media == "application/json" or media.endswith("+json"):
            req: PredictRequest = await _parse_json(request, PredictRequest)
            modality = req.modality
            field_name = next(k for k in ("text", "texts", "image", "images") if getattr(req, k) is not None)
            raw: list[Any] = req.items
            name, top_k, members, b64 = req.model, req.top_k, req.return_members, True
            form = None
        elif media == "multipart/form-data":
            raw, opts, form = await _parse_multipart(request, {"model", "top_k", "return_members"}, s.max_items)
            if not raw:
                await form.close()
                raise InvalidInput("file: no file parts; send one or more images as 'file' (curl -F file=@img.png)")
            modality, field_name = "image", "file"
            name, top_k, members, b64 = opts.model, opts.top_k, opts.return_members, False
        else:
            raise UnsupportedMediaType(
                f"Content-Type {media or '(none)'!r} is not accepted; send application/json or multipart/form-data"
            )
        try:
            check_limits(raw, field_name, max_items=s.max_items,
                         max_chars=s.max_text_chars if modality == "text" else None)  # fmt: skip
            rt = _pick(state, name, modality, "classification")
            assert isinstance(rt, (ClassifierRuntime, CLIPZeroShotRuntime))
            prepared = await _prepare(rt, raw, field_name, base64_encoded=b64)
        finally:
            if form is not None:
                await form.close()
        body = await rt.predict(prepared, top_k=top_k, return_members=members, t0=t0)
        return JSONResponse(body)

    @app.post(
        "/zero-shot", response_model=PredictResponse, tags=["inference"], responses=predict_errors,
        summary="Classify images against labels given in the request (zero-shot model)",
        openapi_extra=_body_doc(ZeroShotRequest, {
            "labels": {"type": "string", "description": 'JSON list (["cat","dog"]), or one field per label'},
            "template": {"type": "string", "default": "A photo of a {label}."},
        }),
    )  # fmt: skip
    async def zero_shot(request: Request) -> JSONResponse:
        state = _state(request)
        s = state.settings
        t0 = request.scope.get("hydra.t0", time.perf_counter())
        media = _media_type(request)
        form = None
        if media == "application/json" or media.endswith("+json"):
            req: ZeroShotRequest = await _parse_json(request, ZeroShotRequest)
            raw: list[Any] = req.items
            field_name = "image" if req.image is not None else "images"
            labels, template, name, top_k, members, b64 = (req.labels, req.template, req.model, req.top_k,
                                                           req.return_members, True)  # fmt: skip
        elif media == "multipart/form-data":
            raw, opts, form = await _parse_multipart(
                request, {"model", "top_k", "return_members", "labels", "template"}, s.max_items
            )
            field_name = "file"
            if not raw:
                await form.close()
                raise InvalidInput("file: no file parts; send one or more images as 'file'")
            if opts.labels is None:
                await form.close()
                raise InvalidInput("labels: required; send two or more labels", status=422)
            labels, template, name, top_k, members, b64 = (opts.labels, opts.template, opts.model, opts.top_k,
                                                           opts.return_members, False)  # fmt: skip
        else:
            raise UnsupportedMediaType(
                f"Content-Type {media or '(none)'!r} is not accepted; send application/json or multipart/form-data"
            )
        try:
            check_limits(raw, field_name, max_items=s.max_items, labels=labels, max_labels=s.max_labels,
                         max_label_chars=s.max_text_chars)  # fmt: skip
            rt = _pick(state, name, "image", "zero-shot")
            assert isinstance(rt, ZeroShotRuntime)
            body = await rt.zero_shot(raw, labels, template, base64_encoded=b64, top_k=top_k,
                                      return_members=members, t0=t0)  # fmt: skip
        finally:
            if form is not None:
                await form.close()
        return JSONResponse(body)


app = create_app()
