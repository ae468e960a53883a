"""The workers of one ``python -m service`` (``HYDRA_WORKERS``; :mod:`service.entrypoints.workers`): each marks itself
ready in a folder the supervisor made, and ``/readyz`` of any of them answers 200 only when every worker is
(:func:`all_ready`). A lone server has no such folder: nothing here applies to it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["READY_DIR_ENV", "WORKERS_ENV", "all_ready", "mark_ready", "server_run", "shared_file"]

READY_DIR_ENV = "HYDRA_SERVE_READY_DIR"  # set by the supervisor: where each worker marks itself ready
WORKERS_ENV = "HYDRA_SERVE_WORKER_COUNT"  # set by the supervisor: how many workers should be ready


_RUN = os.urandom(6).hex()  # a lone server's run: this process


def server_run() -> str:
    """What names this run of the server (its workers share it: the supervisor's folder); counts that restart with
    the server (the drift alarm's input numbers) are read against it."""
    folder = os.environ.get(READY_DIR_ENV)
    return Path(folder).name if folder else _RUN


def shared_file(name: str) -> Path | None:
    """In a worker of a supervisor: the path of a file named ``name`` that every worker of this server shares (in the
    supervisor's folder, removed when it stops); None for a lone server."""
    folder = os.environ.get(READY_DIR_ENV)
    return Path(folder) / name if folder else None


def mark_ready(ready: bool) -> None:
    """In a worker of a supervisor: mark this process ready (or not); nothing for a lone server."""
    folder = os.environ.get(READY_DIR_ENV)
    if not folder:
        return
    path = Path(folder) / f"ready-{os.getpid()}"
    if ready:
        path.touch()
    else:
        path.unlink(missing_ok=True)


def all_ready() -> tuple[int, int] | None:
    """``(workers ready, workers expected)`` under a supervisor; None for a lone server. A mark counts only while its
    process lives (a worker killed with SIGKILL leaves its mark behind)."""
    folder, expected = os.environ.get(READY_DIR_ENV), os.environ.get(WORKERS_ENV)
    if not folder or not expected:
        return None
    live = 0
    for mark in Path(folder).glob("ready-*"):
        try:
            os.kill(int(mark.name.split("-", 1)[1]), 0)
        except (ValueError, ProcessLookupError):
            continue
        except PermissionError:  # alive, not ours to signal
            pass
        live += 1
    return live, int(expected)
