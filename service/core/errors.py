"""The domain exceptions: what went wrong, as a contract error code, an HTTP status and a message for the caller.

Library code (preprocessing, the runtimes) raises these without knowing about HTTP; the server maps them to the
contract's error body in one place (:mod:`service.api.error_bodies`). They live in the core because the builder's
preprocessing raises them too (a training image that does not decode is the same ``InvalidInput`` a client gets).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ServiceError",
    "InvalidInput",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "UnsupportedMediaType",
    "NotReady",
    "Overloaded",
    "InternalError",
]


class ServiceError(Exception):
    """An error with a contract code, an HTTP status and a message for the client.

    A subclass names its code and status in its header: ``class NotFound(ServiceError, code="not_found",
    status=404)``; one left out is inherited.
    """

    code = "internal"
    status = 500

    def __init_subclass__(cls, code: str | None = None, status: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status

    def __init__(self, message: str, *, status: int | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.headers = dict(headers or {})


class InvalidInput(ServiceError, code="invalid_input", status=400):
    """Malformed or out-of-range input: 400 (or 422 for schema violations)."""


class Unauthorized(ServiceError, code="unauthorized", status=401):
    """A missing or wrong bearer token: 401 with ``WWW-Authenticate: Bearer``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError, code="forbidden", status=403):
    """The caller may not do this here (e.g. reset a drift alarm on a server without ``HYDRA_API_KEY``)."""


class NotFound(ServiceError, code="not_found", status=404):
    """No such endpoint: 404."""


class MethodNotAllowed(ServiceError, code="method_not_allowed", status=405):
    """The endpoint does not take this HTTP method: 405."""


class PayloadTooLarge(ServiceError, code="payload_too_large", status=413):
    """A request body or an image above its limit: 413."""


class UnsupportedMediaType(ServiceError, code="unsupported_media_type", status=415):
    """A content type or image format the endpoint does not take: 415."""


class NotReady(ServiceError, code="not_ready", status=503):
    """Not serving: models loading or warming up, a failed load, or shutting down: 503."""


class Overloaded(ServiceError, code="overloaded", status=503):
    """The queue is full: 503 with ``Retry-After`` (seconds)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, int(retry_after)))})


class InternalError(ServiceError, code="internal", status=500):
    """An unexpected failure: 500, its details in the server log only."""
