"""Answers recalled when the drift alarm goes on: those given between the estimated start of the shift and the alarm.

**What a recall is.** The drift alarm (:mod:`service.core.drift`) goes on some inputs after a shift began. Every
answer given in between read the alarm off: it was not suspended, and an ``accept`` among them was certified on a
premise that was already broken. When the alarm goes on, its episode carries ``changed_at``, the change point of
the detector's statistic (the first input of the leading component's best product: where the evidence of the
shift begins). The recall lists the answers given to inputs ``changed_at <= t < started_at`` that were not
suspended: the request ID, the input's position in its request, the input's number in the alarm's stream and
whether it was accepted. A client that acted on one of them can look again.

**What it does not promise.** ``changed_at`` is an estimate: a shift that began gradually, or with inputs that look
like the calibration data, starts earlier than the evidence does, so answers before ``changed_at`` may be affected
too; and an answer in the window may well be right (most are, for a mild shift). A recall says "given after the
evidence of a shift began, before the alarm", not "wrong".

**Bounded.** Each process keeps the last :data:`LOG_ANSWERS` answers it gave while the alarm was off
(:class:`AnswerLog`): an answer that fell out of it before its episode's alarm cannot be listed, and is counted
(``dropped``). A recall keeps at most :data:`RECALL_LIMIT` answers (the earliest past the limit are dropped and
counted) and the book the last :data:`EPISODES` episodes.

**Across workers, replicas and restarts.** Each worker lists the answers it gave itself, when it first sees the new
episode (at its next answer or read of the alarm), and adds them to the book: in memory for one process, in a file
beside the shared drift state for the workers of one server (:class:`RecallBook` with a ``path``, merged under
``flock``), and in the prediction store when there is one (``service.runtime``): so a recall is whole once every
worker has served or read the alarm after it went on.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EPISODES",
    "LOG_ANSWERS",
    "RECALL_LIMIT",
    "AnswerLog",
    "Answered",
    "Recall",
    "RecallBook",
    "combine",
    "merge_stored",
]

LOG_ANSWERS = 20_000  # answers kept per process while the alarm is off (about 2 MB)
RECALL_LIMIT = 1_000  # answers listed per episode
EPISODES = 5  # episodes kept in the book


@dataclass(frozen=True)
class Answered:
    """One answer given while the alarm was off: its input's number in the alarm's stream, its request and place."""

    input: int
    id: str
    index: int
    accepted: bool | None  # None: the request had no risk decision

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "index": self.index, "input": self.input, "accepted": self.accepted}


class AnswerLog:
    """The last ``capacity`` answers given while the alarm was off (suspended ones are never recalled)."""

    def __init__(self, capacity: int = LOG_ANSWERS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self._items: deque[Answered] = deque(maxlen=capacity)
        self.dropped_before = 0  # the input number of the latest answer that fell out (0: none)

    def add(self, answers: Iterable[Answered]) -> None:
        for a in answers:
            if len(self._items) == self._items.maxlen:
                self.dropped_before = max(self.dropped_before, self._items[0].input)
            self._items.append(a)

    def window(self, changed_at: int, started_at: int) -> tuple[list[Answered], bool]:
        """The answers to inputs ``changed_at <= t < started_at``, in input order, and whether some of them may have
        fallen out of the log already."""
        got = sorted((a for a in self._items if changed_at <= a.input < started_at), key=lambda a: (a.input, a.id))
        return got, self.dropped_before >= changed_at


@dataclass
class Recall:
    """The recalled answers of one alarm episode."""

    started_at: int
    changed_at: int
    answers: list[Answered] = field(default_factory=list)
    dropped: int = 0  # answers of the window that could not be listed (the log or the limit)
    incomplete: bool = False  # some answers of the window fell out of a worker's log before they could be listed
    run: str = ""  # the server run it belongs to (input numbers restart with the server)

    def merge(self, answers: list[Answered], incomplete: bool = False) -> list[Answered]:
        """Add answers not already listed (a worker may report late ones again); those added."""
        seen = {(a.id, a.index) for a in self.answers}
        new = [a for a in answers if (a.id, a.index) not in seen]
        self.answers.extend(new)
        self.answers.sort(key=lambda a: (a.input, a.id))
        if len(self.answers) > RECALL_LIMIT:
            over = len(self.answers) - RECALL_LIMIT
            self.answers, self.dropped = self.answers[over:], self.dropped + over
        self.incomplete = self.incomplete or incomplete
        return new

    def as_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "changed_at": self.changed_at,
            "answers": [a.as_dict() for a in self.answers],
            "listed": len(self.answers),
            "accepted": sum(1 for a in self.answers if a.accepted),
            "dropped": self.dropped,
            "incomplete": self.incomplete,
            "run": self.run,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recall:
        answers = [Answered(int(a["input"]), str(a["id"]), int(a["index"]), a["accepted"]) for a in d["answers"]]
        return cls(
            int(d["started_at"]),
            int(d["changed_at"]),
            answers,
            int(d["dropped"]),
            bool(d["incomplete"]),
            str(d.get("run", "")),
        )


class RecallBook:
    """The recalls of the last :data:`EPISODES` episodes, by ``started_at``; with ``path``, kept in that file for
    every process that opens it (read and merged under ``flock``)."""

    def __init__(self, path: str | Path | None = None, run: str = "") -> None:
        self.path = None if path is None else Path(path)
        self.run = run
        self._mem: dict[int, Recall] = {}

    def add(
        self, started_at: int, changed_at: int, answers: list[Answered], incomplete: bool = False
    ) -> list[Answered]:
        """Add ``answers`` to the episode's recall (created if new); the answers that were not listed yet."""
        if self.path is None:
            return self._add(self._mem, started_at, changed_at, answers, incomplete, self.run)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            book = self._parse(os.read(fd, 1 << 24))
            new = self._add(book, started_at, changed_at, answers, incomplete, self.run)
            body = json.dumps([r.as_dict() for r in book.values()], separators=(",", ":")).encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, body)
            return new
        finally:
            os.close(fd)  # releases the lock

    @staticmethod
    def _add(
        book: dict[int, Recall], started_at: int, changed_at: int, answers: list[Answered], incomplete: bool, run: str
    ) -> list[Answered]:
        rec = book.get(started_at)
        if rec is None:
            rec = book[started_at] = Recall(started_at, changed_at, run=run)
            for old in sorted(book)[:-EPISODES]:
                del book[old]
        return rec.merge(answers, incomplete)

    @staticmethod
    def _parse(raw: bytes) -> dict[int, Recall]:
        if not raw:
            return {}
        try:
            return {r.started_at: r for r in (Recall.from_dict(d) for d in json.loads(raw))}
        except (ValueError, KeyError, TypeError):  # a damaged file: start again (a recall is advice, not state)
            return {}

    def recalls(self) -> list[Recall]:
        """The episodes' recalls, oldest first."""
        if self.path is None:
            book = self._mem
        else:
            try:
                with open(self.path, "rb") as f:
                    fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                    book = self._parse(f.read())
            except FileNotFoundError:
                book = {}
        return [book[k] for k in sorted(book)]

    def last(self) -> Recall | None:
        got = self.recalls()
        return got[-1] if got else None


def merge_stored(
    stored: Any, run: str, started_at: int, changed_at: int, answers: list[Answered], incomplete: bool
) -> list:
    """The prediction store's recall list (JSON, oldest first, the last :data:`EPISODES` of every run) with
    ``answers`` added to the episode ``(run, started_at)``: what ``update_state`` writes."""
    mine = Recall(started_at, changed_at, answers, incomplete=incomplete, run=run)
    return combine(stored if isinstance(stored, list) else [], [mine.as_dict()])[-EPISODES:]


def combine(stored: list[dict[str, Any]], local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The store's recalls with this server's merged in (a write still on its way is not missed), oldest first."""
    book = [Recall.from_dict(d) for d in stored]
    for d in local:
        mine = Recall.from_dict(d)
        rec = next((r for r in book if r.run == mine.run and r.started_at == mine.started_at), None)
        if rec is None:
            rec = Recall(mine.started_at, mine.changed_at, dropped=mine.dropped, run=mine.run)
            book.append(rec)
        rec.merge(mine.answers, mine.incomplete)
    return [r.as_dict() for r in book]
