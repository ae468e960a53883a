"""Progress of the build's long stages: tqdm bars on a terminal, plain log lines everywhere else.

A bar (left on screen when its stage ends, with rate and ETA) is drawn only when stderr is a
terminal and the build was not started with ``--no-progress``. Otherwise bars are off, and
each stage logs one line with its timing when it ends (``offline.stages.Timer``), so that CI
output and Kubernetes Job logs hold no carriage-return progress.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

__all__ = ["bar", "enabled", "set_enabled"]

_enabled: bool | None = None  # None: decided by stderr (a terminal or not)


def set_enabled(flag: bool | None) -> None:
    """Force bars on or off (``--no-progress``: False); None returns to the default (on a terminal only)."""
    global _enabled
    _enabled = flag


def enabled() -> bool:
    """Whether bars are drawn: as set, else when stderr is a terminal."""
    if _enabled is not None:
        return _enabled
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(iterable: Iterable[Any] | None = None, *, desc: str, total: int | None = None, initial: int = 0,
        wanted: bool = True) -> tqdm:  # fmt: skip
    """A tqdm bar for one stage (``wanted``: the caller's own switch, e.g. a quiet benchmark run)."""
    return tqdm(iterable, desc=desc, total=total, initial=initial, leave=True, dynamic_ncols=True,
                disable=not (wanted and enabled()))  # fmt: skip
