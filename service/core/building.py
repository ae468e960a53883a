"""An artifact still being built: the note its builder leaves beside the folder, which the server reads.

``make serve`` starts serving as soon as its first default artifact is built and builds the others while the server
runs (``python -m offline.default --serve``). For each artifact it has yet to build, the builder writes
``<parent>/.<folder>.building.json`` before the server starts, and removes it once the artifact is complete. The
server takes a folder of ``HYDRA_ARTIFACTS`` that has no manifest yet but has this note as a model being built: it
serves the others, lists it in ``/readyz`` and ``/v1/models`` as building, answers a request for it 503
``not_ready`` naming it, and loads it when the note is gone (:mod:`service.pending`).

The note (JSON): ``name`` (the model's name once built), ``task``, ``modality``, ``config`` (what it is built from),
``pid`` (the builder's process), ``started`` (Unix time) and ``eta_s`` (the builder's estimate of the build's
length, seconds). A note whose builder process is gone means the build stopped without an artifact.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["BuildNote", "note_path", "read_note", "write_note", "clear_note", "builder_alive"]


@dataclass(frozen=True)
class BuildNote:
    name: str
    task: str
    modality: str
    config: str
    pid: int
    started: float
    eta_s: float

    def describe(self, now: float | None = None) -> dict[str, object]:
        """What ``/readyz`` and ``/v1/models`` show of it."""
        elapsed = (now or time.time()) - self.started
        return {
            "name": self.name,
            "task": self.task,
            "modality": self.modality,
            "status": "building",
            "config": self.config,
            "elapsed_s": round(max(0.0, elapsed), 1),
            "eta_s": round(max(0.0, self.eta_s - elapsed), 1),
        }


def note_path(artifact: str | Path) -> Path:
    """Beside the folder, not inside it: the artifact's file list stays exactly what its manifest lists."""
    p = Path(artifact)
    return p.parent / f".{p.name}.building.json"


def write_note(artifact: str | Path, note: BuildNote) -> None:
    path = note_path(artifact)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(note)))
    tmp.replace(path)  # a reader never sees half a note


def clear_note(artifact: str | Path) -> None:
    note_path(artifact).unlink(missing_ok=True)


def read_note(artifact: str | Path) -> BuildNote | None:
    """The note beside ``artifact``, or None when there is none (or it cannot be read as one)."""
    try:
        doc = json.loads(note_path(artifact).read_text())
        return BuildNote(**{k: doc[k] for k in BuildNote.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def builder_alive(note: BuildNote) -> bool:
    """Whether the process that wrote ``note`` still runs (on this machine)."""
    try:
        os.kill(note.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
