"""The server's logs: text or JSON lines (``HYDRA_LOG_FORMAT``), the request's IDs on every line, the access line
and the prediction lines (docs/api.md, "Logs").

* :func:`configure_logging` (``python -m service``) installs one handler on the root logger: human-readable text
  (the default) or one JSON object per line, formatted by python-json-logger's ``JsonFormatter``. Its
  :class:`RequestContextFilter` adds the request ID and trace ID of the request being answered (context variables
  set by :class:`service.api.middleware.RequestContext`) to every record, so a JSON line logged while answering a
  request carries them.
* :func:`log_access`: one line per request on ``hydra.access``, at INFO with JSON logs (at DEBUG with text logs,
  where uvicorn's own access log serves at that level).
* :func:`log_predictions`: with ``HYDRA_LOG_PREDICTIONS``, one line per prediction on ``hydra.predictions``: the
  label, confidence, uncertainty and OOD flag; never the input itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from service.core.jsonlog import json_formatter
from service.settings import Settings

__all__ = [
    "REQUEST_ID",
    "TRACE_ID",
    "TEXT_FORMAT",
    "InferenceNote",
    "RequestContextFilter",
    "access_log_enabled",
    "configure_logging",
    "log_access",
    "log_predictions",
    "request_context",
]

# the request being answered (None outside requests): set by service.api.middleware.RequestContext
REQUEST_ID: ContextVar[str | None] = ContextVar("hydra_request_id", default=None)
TRACE_ID: ContextVar[str | None] = ContextVar("hydra_trace_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

access_log = logging.getLogger("hydra.access")
prediction_log = logging.getLogger("hydra.predictions")


@dataclass
class InferenceNote:
    """What an inference request did, for its access line (kept in the ASGI scope as ``hydra.inference``)."""

    model: str
    model_version: str
    inputs: int = 0
    ood_flagged: int | None = None  # None until the model answered
    max_mutual_information: float | None = None


class RequestContextFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` (of the request being answered, else None) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        if not hasattr(record, "trace_id"):
            record.trace_id = TRACE_ID.get()
        return True


class _HydraHandler(logging.StreamHandler):
    """The stderr handler :func:`configure_logging` installs (and replaces when called again)."""


def configure_logging(settings: Settings) -> logging.Handler:
    """A handler on the root logger (stderr) in ``HYDRA_LOG_FORMAT``, at ``HYDRA_LOG_LEVEL``; returns it. It replaces
    the one an earlier call installed; handlers others installed stay."""
    handler = _HydraHandler()
    handler.setFormatter(json_formatter() if settings.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _HydraHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    return handler


@contextmanager
def request_context(request_id: str, trace_id: str | None) -> Iterator[None]:
    """Within: the log records of this task carry ``request_id`` and ``trace_id``."""
    tokens = REQUEST_ID.set(request_id), TRACE_ID.set(trace_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(tokens[0])
        TRACE_ID.reset(tokens[1])


def access_log_enabled(*, json_format: bool) -> bool:
    """Whether :func:`log_access` writes anything (so that a caller builds the fields only then)."""
    return access_log.isEnabledFor(logging.INFO if json_format else logging.DEBUG)


def log_access(fields: dict[str, Any], *, json_format: bool) -> None:
    """The access line of one request. ``fields``: request_id, trace_id, method, endpoint, status, latency_ms, and
    for an inference request model, model_version, inputs, ood_flagged, max_mutual_information."""
    level = logging.INFO if json_format else logging.DEBUG
    if not access_log.isEnabledFor(level):
        return
    if json_format:
        access_log.log(level, "request", extra=fields)
        return
    model = f" model={fields['model']}@{fields['model_version']} inputs={fields['inputs']}" if "model" in fields else ""
    access_log.log(
        level,
        "%s %s -> %s in %.1f ms (request %s)%s",
        fields["method"],
        fields["endpoint"],
        fields["status"],
        fields["latency_ms"],
        fields["request_id"],
        model,
        extra=fields,
    )


def log_predictions(note: InferenceNote, rows: list[dict[str, Any]], *, json_format: bool) -> None:
    """One INFO line per prediction of a request: ``rows`` hold label, confidence, the uncertainty fields and the
    OOD flag and score of each input, in order (never the input)."""
    for i, row in enumerate(rows):
        fields = {"model": note.model, "model_version": note.model_version, "index": i, **row}
        if json_format:
            prediction_log.info("prediction", extra=fields)
        else:
            args = (note.model, i, row["label"], row["confidence"], row["mutual_information"], row["ood_flag"])
            prediction_log.info("prediction %s[%d]: %s (%.4f), MI %.4f, OOD %s", *args, extra=fields)
