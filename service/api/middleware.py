"""The one pure-ASGI layer in front of every route: request IDs and the access log, request metrics, bearer auth,
the body size limit, and the fast routes.

:class:`Front` wraps the whole app (outside Starlette's error middleware and OpenTelemetry's, see
:class:`service.entrypoints.app.HydraApp`), so that every answer, a 500 included, carries the request's
``X-Request-ID``: the client's, or a new one (:mod:`service.tracing`). It sets the request ID and the ``traceparent``
trace ID for the logs of the request (:mod:`service.logs`) and writes its access line once answered. It sees every
request, 404s included:
it counts it (``hydra_requests_in_flight``, ``hydra_request_duration_seconds`` by route and status, the received /
answered counters of the shutdown log), answers 401 ``unauthorized`` when ``HYDRA_API_KEY`` is set and the bearer
token is missing or wrong (except on :data:`PUBLIC_PATHS`, the probes and metrics, and CORS preflights), and answers
413 ``payload_too_large`` above ``HYDRA_MAX_BODY_BYTES``, by ``Content-Length`` before the body is read or while a
chunked body streams in. The HTTP contract is docs/api.md.

**Fast routes.** The inference routes' JSON requests (``POST /predict``, ``POST /zero-shot`` with
``application/json``) are answered here, by the same handler the FastAPI route calls
(:func:`service.api.v1.answer_body`), without Starlette's routing, its error middleware and FastAPI's per-route
machinery: those cost more per request than the model does on a GPU. Everything else, multipart bodies included,
goes through FastAPI, which also holds the OpenAPI document of these routes. Errors on a fast route get the same
answers as through FastAPI (:func:`service.api.error_bodies.error_response`). With OpenTelemetry on (``HYDRA_OTEL``)
every
request goes through FastAPI, where its instrumentation traces it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.error_bodies import error_response
from service.core.errors import InternalError, InvalidInput, PayloadTooLarge, ServiceError, Unauthorized
from service.lifecycle import ServerState
from service.logs import InferenceNote, access_log_enabled, log_access, request_context
from service.tracing import REQUEST_ID_HEADER, request_id, trace_id

__all__ = ["FastRoute", "Front", "PUBLIC_PATHS", "endpoint_label"]

log = logging.getLogger("hydra.service")

# answered without the API key: the kubelet's probes and Prometheus' scrapes carry no token
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})
JSON_TYPES = (b"application/json",)
# a fast route: (scope, receive) -> the answer's JSON bytes; raises ServiceError for the contract's error answers
FastRoute = Callable[[Scope, Receive], Awaitable[bytes]]


def endpoint_label(scope: Scope) -> str:
    """The route path of a request (``/v2/models/{model_name}/infer``), also when it was answered before routing
    (401, 413); ``unmatched`` when no route takes its path."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    for r in getattr(scope.get("app"), "routes", ()):
        matched, _ = r.matches(scope)
        if matched is not Match.NONE and getattr(r, "path", None):
            return r.path
    return "unmatched"


def _is_json(headers: dict[bytes, bytes]) -> bool:
    media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return media in JSON_TYPES or media.endswith(b"+json")


class Front:
    """Pure ASGI, outermost (module docstring): request IDs, access log, metrics, auth, body limit, fast routes.

    ``app``: the rest of the application (FastAPI with its own middleware); ``fast``: ``{path: handler}`` of the JSON
    ``POST`` requests answered here; ``asgi_app``: set as ``scope["app"]`` for them, as FastAPI does.
    """

    def __init__(self, app: ASGIApp, state: ServerState, fast: dict[str, FastRoute], asgi_app: Any) -> None:
        self.app = app
        self.state = state
        self.fast = fast
        self.asgi_app = asgi_app
        key = state.settings.api_key
        # only the key's digest is kept; tokens are compared by digest in constant time (hmac.compare_digest),
        # so neither the content nor the length of the key can be learnt from response times
        self._key_digest = hashlib.sha256(key.get_secret_value().encode()).digest() if key is not None else None
        self._max_body = state.settings.max_body_bytes
        self._json_logs = state.settings.log_format == "json"
        self._durations: dict[tuple[str, str], Any] = {}  # labelled histogram children, looked up once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        scope["hydra.request_id"], scope["hydra.t0"] = rid, t0
        scope["hydra.trace_id"] = trace_id(headers.get(b"traceparent"))
        state = self.state
        state.requests_received += 1
        state.metrics.in_flight.inc()
        state.metrics.requests_in_flight += 1
        status = 500
        rid_header = (REQUEST_ID_HEADER, rid.encode())

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), rid_header]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state.requests_answered += 1

        label = "unmatched"
        with request_context(rid, scope["hydra.trace_id"]):
            try:
                err = self._check(scope, headers)
                fast = self._fast_route(scope, headers)
                if err is not None:
                    label = endpoint_label({**scope, "app": self.asgi_app})
                    await error_response(err, scope["path"])(scope, receive, send_wrapper)
                elif fast is not None:
                    label = scope["path"]
                    scope["app"] = self.asgi_app
                    await self._fast(fast, scope, self._limited(receive), send_wrapper)
                else:
                    await self.app(scope, self._limited(receive), send_wrapper)
                    label = endpoint_label(scope)
            finally:
                state.metrics.in_flight.dec()
                state.metrics.requests_in_flight -= 1
                self._duration(label, status).observe(time.perf_counter() - t0)
                self._log(scope, status, t0, label)

    def _fast_route(self, scope: Scope, headers: dict[bytes, bytes]) -> FastRoute | None:
        """The fast route of a JSON ``POST`` to its path; None when there is none, or when OpenTelemetry traces the
        app (its instrumentation sees only what goes through FastAPI)."""
        if scope.get("method") != "POST" or not _is_json(headers):
            return None
        if getattr(self.asgi_app, "_is_instrumented_by_opentelemetry", False):
            return None
        return self.fast.get(scope["path"])

    async def _fast(self, route: FastRoute, scope: Scope, receive: Receive, send: Send) -> None:
        """A fast route's answer, or the error answer FastAPI's handlers would give (service.api.error_bodies)."""
        try:
            body = await route(scope, receive)
        except ClientDisconnect:  # the client left before its body was read: nobody to answer
            return
        except ServiceError as exc:
            if exc.status >= 500 and exc.code not in ("overloaded", "not_ready"):
                log.error("%s %s -> %s: %s", scope.get("method"), scope["path"], exc.code, exc.message)
            await error_response(exc, scope["path"])(scope, receive, send)
            return
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope["path"])
            internal = InternalError("internal error; the server log has the details")
            await error_response(internal, scope["path"])(scope, receive, send)
            return
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body})

    def _duration(self, label: str, status: int) -> Any:
        key = (label, str(status))
        child = self._durations.get(key)
        if child is None:
            child = self._durations[key] = self.state.metrics.request_duration.labels(*key)
        return child

    def _log(self, scope: Scope, status: int, t0: float, label: str) -> None:
        if not access_log_enabled(json_format=self._json_logs):  # text logs above debug: no line, nothing to build
            return
        fields: dict[str, Any] = {
            "request_id": scope["hydra.request_id"],
            "trace_id": scope.get("hydra.trace_id"),
            "method": scope.get("method"),
            "endpoint": label,
            "status": status,
            "latency_ms": round((time.perf_counter() - t0) * 1000, 3),
        }
        note = scope.get("hydra.inference")
        if isinstance(note, InferenceNote):
            fields.update(asdict(note))
        log_access(fields, json_format=self._json_logs)

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> ServiceError | None:
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
