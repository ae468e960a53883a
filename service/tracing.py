"""Request IDs, W3C trace context and the optional OpenTelemetry tracing (``HYDRA_OTEL``; docs/api.md, "Tracing").

* :func:`request_id`: the client's ``X-Request-ID`` when it is a sane token (1-128 characters of letters, digits
  and ``._:/@+=-``), else a new one (uuid4, hex). Answered in the ``X-Request-ID`` header and the body's ``id``.
* :func:`trace_id`: the trace ID of a W3C ``traceparent`` header (32 lower-case hex digits), None without a valid
  one. It goes into the logs.
* :func:`instrument`: with ``HYDRA_OTEL=true``, OpenTelemetry's FastAPI instrumentation traces every request but
  the probes and metrics, continuing the caller's trace (``traceparent``); spans go to the OTLP/HTTP endpoint of
  the standard ``OTEL_EXPORTER_OTLP_*`` variables (none set: spans are made, not sent). The trace ID of the
  request's span reaches the logs, also when the caller sent none. OpenTelemetry is imported only then.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from fastapi import FastAPI

from service.logs import TRACE_ID

__all__ = ["REQUEST_ID_HEADER", "instrument", "request_id", "trace_id"]

log = logging.getLogger("hydra.service")

REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")
# version-traceid-parentid-flags; version ff is invalid, and so are all-zero trace and parent IDs
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
# not traced: the kubelet's probes and Prometheus' scrapes (regexes, comma-separated, matched against the URL)
UNTRACED = "/healthz,/readyz,/metrics,/v2/health/live,/v2/health/ready"


def request_id(header: bytes | None) -> str:
    """The client's ``X-Request-ID`` if it is a sane token, else a new uuid4 (32 hex digits)."""
    if header is not None:
        text = header.decode("latin-1").strip()
        if _REQUEST_ID.fullmatch(text):
            return text
    b = bytearray(os.urandom(16))  # uuid4's own bytes, without building a UUID object (microseconds a request)
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    return b.hex()


def trace_id(traceparent: bytes | None) -> str | None:
    """The trace ID of a valid W3C ``traceparent`` header value, else None."""
    if traceparent is None:
        return None
    m = _TRACEPARENT.fullmatch(traceparent.decode("latin-1").strip())
    if m is None or m[1] == "ff" or m[2] == "0" * 32 or m[3] == "0" * 16:
        return None
    return m[2]


def _note_span(span: Any, scope: dict[str, Any]) -> None:
    """OpenTelemetry's server-request hook: the request's span is started; its trace ID goes into the logs."""
    ctx = span.get_span_context()
    if ctx.is_valid:
        scope["hydra.trace_id"] = format(ctx.trace_id, "032x")
        TRACE_ID.set(scope["hydra.trace_id"])


def _tracer_provider(exporter: Any | None) -> Any:
    """A tracer provider for this app: spans to ``exporter``, else to OTLP/HTTP when an endpoint is configured."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "hydra-serve")}
    provider = TracerProvider(resource=Resource.create(attrs))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        log.warning("HYDRA_OTEL=true but no OTEL_EXPORTER_OTLP_ENDPOINT: spans are made, not sent")
    return provider


def instrument(app: FastAPI, exporter: Any | None = None) -> Any:
    """Trace ``app``'s requests with OpenTelemetry (before it serves its first request); ``exporter`` (tests) takes
    the spans instead of OTLP. Returns the tracer provider (flushed and stopped at exit by OpenTelemetry)."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    provider = _tracer_provider(exporter)
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=provider, excluded_urls=UNTRACED, server_request_hook=_note_span
    )
    return provider
