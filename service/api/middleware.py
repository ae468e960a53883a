"""Pure ASGI middleware in front of every route: request IDs and the access log, request metrics, bearer auth and
the body size limit.

:class:`RequestContext` wraps the whole app (outside Starlette's error middleware and OpenTelemetry's, see
:class:`service.main.HydraApp`), so that every answer, a 500 included, carries the request's ``X-Request-ID``: the
client's, or a new one (:mod:`service.tracing`). It sets the request ID and the ``traceparent`` trace ID for the
logs of the request (:mod:`service.logs`) and writes its access line once answered.

:class:`GuardMiddleware` sits outside routing, so it sees every request, 404s included:
it counts the request (``hydra_requests_in_flight``, ``hydra_request_duration_seconds``
by route and status, the received / answered counters of the shutdown log), answers 401
``unauthorized`` when ``HYDRA_API_KEY`` is set and the bearer token is missing or wrong
(except on :data:`PUBLIC_PATHS`, the probes and metrics, and CORS preflights), and answers
413 ``payload_too_large`` above ``HYDRA_MAX_BODY_BYTES``, by ``Content-Length`` before the
body is read or while a chunked body streams in. The HTTP contract is docs/api.md.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import asdict
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.errors import InvalidInput, PayloadTooLarge, ServiceError, Unauthorized
from ..lifecycle import ServerState
from ..logs import InferenceNote, access_log_enabled, log_access, request_context
from ..tracing import REQUEST_ID_HEADER, request_id, trace_id
from .errors import error_response

__all__ = ["GuardMiddleware", "PUBLIC_PATHS", "RequestContext", "endpoint_label"]

# answered without the API key: the kubelet's probes and Prometheus' scrapes carry no token
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


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


class RequestContext:
    """Pure ASGI, outermost: the request ID (``X-Request-ID`` on every answer) and trace ID, the access line."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = dict(scope.get("headers", []))
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        scope["hydra.request_id"], scope["hydra.trace_id"] = rid, trace_id(headers.get(b"traceparent"))
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        with request_context(rid, scope["hydra.trace_id"]):
            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                self._log(scope, status, t0)

    def _log(self, scope: Scope, status: int, t0: float) -> None:
        json_format = self.state.settings.log_format == "json"
        if not access_log_enabled(json_format=json_format):  # text logs above debug: no line, nothing to build
            return
        fields: dict[str, Any] = {
            "request_id": scope["hydra.request_id"],
            "trace_id": scope.get("hydra.trace_id"),
            "method": scope.get("method"),
            "endpoint": endpoint_label(scope),
            "status": status,
            "latency_ms": round((time.perf_counter() - t0) * 1000, 3),
        }
        note = scope.get("hydra.inference")
        if isinstance(note, InferenceNote):
            fields.update(asdict(note))
        log_access(fields, json_format=json_format)


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
                await error_response(err, scope["path"])(scope, receive, send_wrapper)
                return
            await self.app(scope, self._limited(receive), send_wrapper)
        finally:
            state.metrics.in_flight.dec()
            state.metrics.request_duration.labels(endpoint_label(scope), str(status)).observe(time.perf_counter() - t0)

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
