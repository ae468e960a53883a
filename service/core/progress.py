"""Progress of long work (the build's stages, a ``hydra-predict`` run): tqdm bars on a terminal, progress lines
everywhere else.

On a terminal (stderr a TTY, no ``--no-progress``) each stage draws a tqdm bar with its rate and ETA. Without one
(Kubernetes Job logs, CI, ``nohup``) a bar would be carriage-return noise, and a stage that only logged when it
ended left ``kubectl logs`` silent for the whole stage (1,130 s for a user's ViT-Tiny base model). So there each
stage logs a line when it starts, every ``every`` seconds while it runs (default 30: ``--progress-every``), and
when it ends, on the ``hydra.progress`` logger::

    progress stage="member 0" event=update step=20/60 pct=33.3 loss=0.4123 lr=2.00e-04 rate=1.52/s elapsed=13s eta=26s

Stable ``key=value`` text; with ``--log-format json`` the same fields are the JSON object's keys (``stage``,
``event`` = start | update | end, ``step``, ``total``, ``pct``, ``rate`` in steps per second, ``elapsed_s``,
``eta_s``, and what the stage reports: ``loss``, ``lr``). A stage without a known total logs its step count.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm.auto import tqdm

__all__ = ["DEFAULT_EVERY", "ProgressLog", "bar", "enabled", "every", "set_enabled", "set_every", "stage"]

log = logging.getLogger("hydra.progress")

DEFAULT_EVERY = 30.0  # seconds between progress lines without a terminal
_enabled: bool | None = None  # None: decided by stderr (a terminal or not)
_every = DEFAULT_EVERY


def set_enabled(flag: bool | None) -> None:
    """Force bars on or off (``--no-progress``: False); None returns to the default (on a terminal only)."""
    global _enabled
    _enabled = flag


def set_every(seconds: float) -> None:
    """Seconds between progress lines when no bar is drawn (``--progress-every``)."""
    global _every
    if not seconds > 0:
        raise ValueError(f"progress interval must be > 0 seconds, got {seconds}")
    _every = float(seconds)


def every() -> float:
    return _every


def enabled() -> bool:
    """Whether bars are drawn: as set, else when stderr is a terminal."""
    if _enabled is not None:
        return _enabled
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressLog:
    """A stage's progress as log lines (start, every ``every`` seconds, end): the part of tqdm's interface the
    build uses (iteration, ``update``, ``set_postfix``, ``close``, a context manager)."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        desc: str,
        total: int | None = None,
        initial: int = 0,
        every: float | None = None,
        clock: Any = time.monotonic,
        heartbeat: bool = False,
    ) -> None:
        self.iterable = iterable
        self.desc = desc
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable) + initial  # type: ignore[arg-type]
        self.total = total
        self.n = initial
        self.initial = initial
        self.every = _every if every is None else every
        self.postfix: dict[str, Any] = {}
        self._clock = clock
        self._t0 = clock()
        self._last = self._t0
        self._closed = False
        self._lock = threading.Lock()
        self._emit("start")
        self._stop = threading.Event()
        if heartbeat:  # a stage without steps of its own: a line every ``every`` seconds from a daemon thread
            threading.Thread(target=self._beat, name=f"progress:{desc}", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                if self._closed:
                    return
                self._last = self._clock()
                self._emit("update")

    # -- tqdm's interface
    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None
        for x in self.iterable:
            yield x
            self.update(1)
        self.close()  # as tqdm does at the end of its iterable

    def __enter__(self) -> ProgressLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            now = self._clock()
            if now - self._last >= self.every:
                self._last = now
                self._emit("update")

    def set_postfix(self, **kw: Any) -> None:
        self.postfix.update(kw)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._emit("end")

    # -- the line
    def fields(self, event: str) -> dict[str, Any]:
        """The line's fields: stage, event, step, total, pct, rate, elapsed_s, eta_s and the stage's postfix."""
        elapsed = self._clock() - self._t0
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else None
        out: dict[str, Any] = {"stage": self.desc, "event": event, "step": self.n, "total": self.total}
        if self.total:
            out["pct"] = round(100.0 * self.n / self.total, 1)
        out.update({k: v for k, v in self.postfix.items()})
        out["rate"] = None if rate is None else round(rate, 3)
        out["elapsed_s"] = round(elapsed, 1)
        left = None if not rate or self.total is None else (self.total - self.n) / rate
        out["eta_s"] = None if left is None else round(left, 1)
        return out

    def _emit(self, event: str) -> None:
        f = self.fields(event)
        text = [
            f'stage="{f["stage"]}"',
            f"event={event}",
            f"step={f['step']}/{f['total']}" if f["total"] is not None else f"step={f['step']}",
        ]
        if "pct" in f:
            text.append(f"pct={f['pct']}")
        text += [f"{k}={v}" for k, v in self.postfix.items()]
        if f["rate"] is not None:
            text.append(f"rate={f['rate']:.3g}/s")
        text.append(f"elapsed={_duration(f['elapsed_s'])}")
        if f["eta_s"] is not None and event != "end":
            text.append(f"eta={_duration(f['eta_s'])}")
        log.info("progress %s", " ".join(text), extra=f)


def bar(
    iterable: Iterable[Any] | None = None, *, desc: str, total: int | None = None, initial: int = 0, wanted: bool = True
) -> Any:
    """A stage's progress: a tqdm bar on a terminal, else a :class:`ProgressLog` (``wanted``: the caller's own
    switch, e.g. a quiet benchmark run, which silences both)."""
    if wanted and enabled():
        return tqdm(iterable, desc=desc, total=total, initial=initial, leave=True, dynamic_ncols=True)
    if not wanted:
        return tqdm(iterable, desc=desc, total=total, initial=initial, disable=True)
    return ProgressLog(iterable, desc=desc, total=total, initial=initial)


def stage(desc: str, total: int | None = None) -> Any:
    """A stage without steps of its own (calibration, export): its start and end lines and, while it runs, a line
    every :func:`every` seconds (a bar on a terminal)."""
    if enabled():
        return tqdm(desc=desc, total=total, leave=True, dynamic_ncols=True)
    return ProgressLog(desc=desc, total=total, heartbeat=True)
