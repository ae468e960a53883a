"""One drift alarm for every worker of a server: the state of :class:`~service.core.drift.DriftMonitor` in a file
that all of them map, advanced under a lock that the kernel releases when its holder dies.

**Why.** With ``HYDRA_WORKERS`` above 1, each worker used to run its own alarm over its share of the traffic, so
under a shift N workers answered about N times as many inputs before the first suspension. Here every worker's
inputs advance one statistic: the alarm sees the whole traffic, in the order the workers' chunks arrive, and every
answer, ``/v1/models/{name}/drift`` and ``/metrics`` read the same state whichever worker serves them.

**The guarantee is unchanged.** The merged stream is an interleaving of the workers' substreams, chosen by arrival
(request timing and the feed's chunking), never by the scores' values. An interleaving of i.i.d. traffic that does not
look at the values is i.i.d. traffic, so the bound of :mod:`service.core.drift` holds as it is: with probability at
least ``1 - delta`` over the calibration split, given it, the chance of an alarm within ``m`` inputs of a start,
reset or clear is at most ``m / A``, for the server as a whole.

**The file.** ``<folder>/drift-<model>-<version>.state`` (the folder the supervisor makes for its workers), 64 KiB,
mapped by every worker. Two slots, each ``magic, sequence, crc32, length`` and a JSON body (the statistic, the
input count, the episodes); a writer fills the slot not in use with the next sequence number, so a worker killed
mid-write leaves the other slot whole: a reader takes the valid slot with the larger sequence. ``fcntl.flock`` on the
file serialises the updates; the kernel drops the lock of a process that dies, so a killed worker neither blocks the
others nor loses evidence that it had written (only the scores of its requests in flight, which were never
answered).

**Faults.** A file that was removed or replaced, or whose two slots are both unreadable, raises
:class:`DriftStateError`: the caller's answers then abstain and say why, and the server is not ready
(``service.runtime.guarded``). Nothing certifies on a state it could not read.

**Cost.** One ``flock``, a read of the slot (a few hundred bytes while no episode is kept), the parent's update and a
write, per chunk of inputs (with the default policy, per request): about 14 µs more than the in-memory monitor per
lone answer and 0.5 µs per answer of a batch of 32 (``benchmarks/drift_cost.py``).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import zlib
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.core.drift import DriftEpisode, DriftMonitor

__all__ = ["DriftStateError", "SharedDriftMonitor", "SIZE"]

SIZE = 1 << 16  # the file: two slots of 32 KiB (20 episodes of history take under 2 KiB)
_SLOT = SIZE // 2
_MAGIC = b"HYDRADRF"
_HEAD = struct.Struct("<8sQII")  # magic, sequence, crc32 of the body, body length


class DriftStateError(RuntimeError):
    """The shared drift state cannot be read or written: the message says what is wrong."""


class SharedDriftMonitor(DriftMonitor):
    """A :class:`DriftMonitor` whose state lives in ``path``, shared by every process that opens it (module
    docstring). Each :meth:`update`, :meth:`reset`, :meth:`sync` and :meth:`state` reads the latest state first and
    writes its change back, under an exclusive ``flock``. ``episodes_started_here`` counts the episodes that this
    process's updates started (each worker adds those to the summed episode counter)."""

    def __init__(self, path: str | Path, calibration_scores: Any, delta: float = 0.01, **kw: Any) -> None:
        super().__init__(calibration_scores, delta, **kw)
        self.path = Path(path)
        self._here = 0
        self._seq = 0
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self._ino = os.fstat(self._fd).st_ino
            with self._locked(initial=True):
                new = os.fstat(self._fd).st_size == 0
                if new:
                    os.ftruncate(self._fd, SIZE)
                self._map = mmap.mmap(self._fd, SIZE)
                if new:  # the first worker writes the fresh state; a file that exists must read
                    self._write()
                else:
                    self._load()
        except (OSError, ValueError) as e:  # ValueError: a file shorter than its two slots cannot be mapped
            raise DriftStateError(f"the shared drift state {self.path} cannot be opened: {e}") from e

    # --- the file ----------------------------------------------------------------------------------------------
    @contextmanager
    def _locked(self, initial: bool = False) -> Any:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if not initial:
                self._check_file()
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _check_file(self) -> None:
        try:
            same = os.stat(self.path).st_ino == self._ino
        except OSError:
            same = False
        if not same:
            raise DriftStateError(f"the shared drift state {self.path} is gone (removed or replaced)")

    def _read(self) -> tuple[int, dict[str, Any]] | None:
        """The valid slot with the larger sequence: ``(sequence, body)``; None when neither is valid."""
        best: tuple[int, dict[str, Any]] | None = None
        for slot in (0, 1):
            off = slot * _SLOT
            magic, seq, crc, n = _HEAD.unpack_from(self._map, off)
            if magic != _MAGIC or n > _SLOT - _HEAD.size:
                continue
            body = self._map[off + _HEAD.size : off + _HEAD.size + n]
            if zlib.crc32(body) != crc:
                continue
            if best is None or seq > best[0]:
                best = (seq, json.loads(body))
        return best

    def _load(self) -> None:
        got = self._read()
        if got is None:
            raise DriftStateError(f"the shared drift state {self.path} is corrupt (no slot passes its checksum)")
        self._seq, doc = got
        w, start = [float(v) for v in doc["w"]], [int(v) for v in doc["from"]]
        if len(w) != self._j or len(start) != self._j:
            raise DriftStateError(f"the shared drift state {self.path} has {len(w)} components, this alarm {self._j}")
        self._w, self._from, self._count, self._total = w, start, int(doc["count"]), int(doc["total"])
        self._episodes.clear()
        self._episodes.extend(DriftEpisode(**e) for e in doc["episodes"])
        self._open = self._episodes[-1] if doc["open"] and self._episodes else None

    def _write(self) -> None:
        doc = {
            "w": self._w,
            "from": self._from,
            "count": self._count,
            "total": self._total,
            "open": self._open is not None,
            "episodes": [
                {
                    "started_at": e.started_at,
                    "peak_log10": e.peak_log10,
                    "cleared_at": e.cleared_at,
                    "cleared_by": e.cleared_by,
                    "changed_at": e.changed_at,
                }
                for e in self._episodes
            ],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        if len(body) > _SLOT - _HEAD.size:
            raise DriftStateError(f"the drift state ({len(body)} bytes) does not fit its slot")
        self._seq += 1
        off = (self._seq % 2) * _SLOT
        self._map[off + _HEAD.size : off + _HEAD.size + len(body)] = body
        _HEAD.pack_into(self._map, off, _MAGIC, self._seq, zlib.crc32(body), len(body))

    # --- the monitor -------------------------------------------------------------------------------------------
    def update(self, scores: np.ndarray | torch.Tensor | Sequence[float]) -> None:
        with self._locked():
            self._load()
            before = self._total
            super().update(scores)
            self._here += self._total - before
            self._write()

    def reset(self) -> None:
        with self._locked():
            self._load()
            super().reset()
            self._write()

    @property
    def episodes_started_here(self) -> int:
        return self._here

    def sync(self) -> None:
        with self._locked():
            self._load()

    def state(self) -> dict[str, Any]:
        self.sync()
        return super().state()
