"""The one mapping of the domain exceptions (:mod:`service.core.errors`) to the contract's error body (docs/api.md,
"Errors").

Every error answer is ``{"error": {"code": ..., "message": ...}}``, except under ``/v2``
(the Open Inference Protocol), where the protocol's ``{"error": "<message>"}`` is used
with the same HTTP status. Code raises a :class:`~service.core.errors.ServiceError` subclass;
:func:`install_error_handlers` maps those, FastAPI's own validation errors (422),
Starlette's 404/405 and any unexpected exception (500, logged server-side, never
echoed) to that body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.core.errors import (
    InternalError,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServiceError,
)

__all__ = [
    "error_body",
    "error_response",
    "is_oip_path",
    "format_validation_errors",
    "install_error_handlers",
]

log = logging.getLogger("hydra.service")


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def is_oip_path(path: str) -> bool:
    """Whether ``path`` belongs to the Open Inference Protocol (``/v2``), whose errors are ``{"error": "..."}``."""
    return path == "/v2" or path.startswith("/v2/")


def error_response(exc: ServiceError, path: str = "") -> JSONResponse:
    """The error answer to a request for ``path``: the contract's body, or the protocol's under ``/v2``."""
    body = {"error": exc.message} if is_oip_path(path) else error_body(exc.code, exc.message)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers or None)


def _loc(loc: Sequence[Any]) -> str:
    """``("body", "texts", 3)`` -> ``texts[3]``; the request part (body/query/...) is dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "form"):
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "body"


def format_validation_errors(errors: Iterable[Mapping[str, Any]], limit: int = 5) -> str:
    """A one-line message naming every bad field (at most ``limit``) from pydantic's ``errors()``."""
    msgs = []
    errors = list(errors)
    for e in errors[:limit]:
        where = _loc(e.get("loc", ()))
        if e.get("type") == "extra_forbidden":
            msgs.append(f"{where}: unknown field (not accepted here)")
        else:
            msgs.append(f"{where}: {e.get('msg', 'invalid')}")
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    return "invalid request: " + "; ".join(msgs) + more


def validate_json_body(body: bytes, model: type[BaseModel], send: str) -> Any:
    """``body`` validated by the pydantic ``model``: :class:`InvalidInput` (400) for an empty or malformed body,
    saying what to ``send``; 422 naming the fields that do not fit (:func:`format_validation_errors`)."""
    if not body:
        raise InvalidInput(f"empty request body; send {send}")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err.get("type") == "json_invalid" for err in errors):
            raise InvalidInput(f"malformed JSON: {errors[0].get('msg', 'invalid JSON')}; send {send}") from None
        raise InvalidInput(format_validation_errors(errors), status=422) from None


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception reaching FastAPI to the contract's error body, in one place."""

    async def on_service_error(request: Request, exc: ServiceError) -> JSONResponse:
        if exc.status >= 500 and not isinstance(exc, (Overloaded, NotReady)):
            log.error("%s %s -> %s: %s", request.method, request.url.path, exc.code, exc.message)
        return error_response(exc, request.url.path)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidInput(format_validation_errors(exc.errors()), status=422), request.url.path)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: ServiceError = NotFound(f"no endpoint {request.url.path}; see /docs for the API")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}; see /docs")
        elif exc.status_code == 413:
            err = PayloadTooLarge("request body too large")
        elif exc.status_code < 500:
            err = InvalidInput(str(exc.detail), status=exc.status_code)
        else:
            err = InternalError("internal error; the server log has the details")
        err.headers.update(exc.headers or {})
        return error_response(err, request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(InternalError("internal error; the server log has the details"), request.url.path)

    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
