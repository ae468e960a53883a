"""Shared online state: a JSON value per key with a version, written by compare-and-set, so replicas agree.

An online statistic that several replicas update (the adaptive conformal level, an alarm) keeps its state here: a
replica reads ``(value, version)``, computes the new value, and writes it only if the version is still the one it
read (:func:`put_state` with ``expected_version``). If another replica wrote in between, the write is refused
(:class:`~.errors.StateConflict`) and the replica starts again from the new value (:func:`update_state` loops), so
no update is lost and every replica sees one sequence of values. Version 1 is the first value, each write adds 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update

from service.store.database import Database
from service.store.records import StateEntry
from service.store.schema import NAME_CHARS, state
from service.store.store_errors import StateConflict

__all__ = ["get_state", "put_state", "update_state"]


def _check(key: str, value: Any) -> None:
    if not isinstance(key, str) or not 0 < len(key) <= NAME_CHARS:
        raise ValueError(f"state key must be a string of 1-{NAME_CHARS} characters, got {key!r}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"state {key!r}: the value is not JSON (finite numbers, strings, lists, dicts): {e}") from e


def get_state(db: Database, key: str) -> StateEntry | None:
    """The value stored under ``key`` with its version, or None."""
    with db.guarded("reading state"), db.read() as conn:
        row = conn.execute(select(state.c.value, state.c.version, state.c.updated).where(state.c.key == key)).first()
    return None if row is None else StateEntry(key, row.value, int(row.version), float(row.updated))


def put_state(db: Database, key: str, value: Any, *, now: float, expected_version: int | None = None) -> StateEntry:
    """Store ``value`` under ``key``: unconditionally (``expected_version=None``), only if absent (``0``), or only if
    the stored version is ``expected_version``; the new entry. Raises :class:`StateConflict` when the version
    differs."""
    _check(key, value)
    with db.guarded("writing state"), db.write() as conn:
        row = conn.execute(select(state.c.version).where(state.c.key == key).with_for_update()).first()
        current = 0 if row is None else int(row.version)
        if expected_version is not None and expected_version != current:
            raise StateConflict(f"state {key!r} is at version {current}, not {expected_version}")
        if row is None:
            values = {"key": key, "value": value, "version": 1, "updated": now}
            created = conn.execute(db.insert(state).returning(state.c.version), [values]).first()
            if created is None:  # another replica created it after our read
                raise StateConflict(f"state {key!r} was created concurrently")
        else:
            written = conn.execute(
                update(state)
                .where(state.c.key == key, state.c.version == current)
                .values(value=value, version=current + 1, updated=now)
            ).rowcount
            if written != 1:
                raise StateConflict(f"state {key!r} changed concurrently")
    return StateEntry(key, value, current + 1, now)


def update_state(
    db: Database, key: str, change: Callable[[Any], Any], *, now: Callable[[], float], retries: int = 16
) -> StateEntry:
    """Read ``key``, store ``change(value)`` (``change(None)`` when absent) by compare-and-set, and start again when
    another writer came first, up to ``retries`` times; the entry written."""
    for _ in range(retries):
        entry = get_state(db, key)
        new = change(None if entry is None else entry.value)
        try:
            return put_state(db, key, new, now=now(), expected_version=0 if entry is None else entry.version)
        except StateConflict:
            continue
    raise StateConflict(f"state {key!r}: {retries} concurrent updates in a row won; try again")
