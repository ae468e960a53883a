"""The JSON log line, one format for every process of the project: the server (``HYDRA_LOG_FORMAT=json``) and the
builder (``--log-format json``) write the same fields, so one log pipeline reads both.
"""

from __future__ import annotations

import logging

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

__all__ = ["json_formatter"]


def json_formatter() -> logging.Formatter:
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message`` and every ``extra``
    field of the record (the server's :class:`service.logs.RequestContextFilter` adds ``request_id`` and
    ``trace_id``)."""
    return JsonFormatter(
        "%(levelname)s %(name)s %(message)s",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],  # uvicorn's message with terminal colours: left out
    )
