"""The store's exceptions, in the server's one hierarchy (:class:`~service.core.errors.ServiceError`): an HTTP route
that lets one through gets the contract's error body with the status named here.

* :class:`StoreUnavailable` (503 ``not_ready``, ``Retry-After``): the database cannot be reached or is busy past its
  timeout. Nothing of the call was committed, so a retry is safe (feedback is idempotent).
* :class:`StateConflict` (409 ``conflict``): a compare-and-set of shared state lost against another writer; read
  the state again and retry (:meth:`~service.store.PredictionStore.update_state` does).
* :class:`StoreError` (500 ``internal``): anything else the database refused (a schema it does not know, a bad value).
"""

from __future__ import annotations

from service.core.errors import ServiceError

__all__ = ["StateConflict", "StoreError", "StoreUnavailable"]


class StoreError(ServiceError, code="internal", status=500):
    """The prediction store failed; the message says how."""


class StoreUnavailable(StoreError, code="not_ready", status=503):
    """The database is down or busy: nothing was committed; retry after ``Retry-After`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, int(retry_after)))})


class StateConflict(StoreError, code="conflict", status=409):
    """A compare-and-set of shared state found another version than the one expected."""
