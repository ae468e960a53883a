"""Recalls (service/core/recall.py): the answer log's window, the bounds, the shared book across processes, the
store's merge."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from service.core import recall
from service.core.recall import Answered, AnswerLog, Recall, RecallBook, combine, merge_stored


def _a(t: int, rid: str = "r", index: int = 0, accepted: bool | None = True) -> Answered:
    return Answered(t, f"{rid}{t}", index, accepted)


def test_the_window_is_the_answers_from_the_change_point_to_the_alarm():
    log = AnswerLog(capacity=100)
    log.add([_a(t) for t in range(1, 60)])
    got, incomplete = log.window(changed_at=41, started_at=50)
    assert [a.input for a in got] == list(range(41, 50)) and not incomplete


def test_an_answer_that_left_the_log_makes_the_window_incomplete():
    log = AnswerLog(capacity=10)
    log.add([_a(t) for t in range(1, 31)])  # 1..20 fell out
    got, incomplete = log.window(changed_at=15, started_at=25)
    assert [a.input for a in got] == list(range(21, 25)) and incomplete
    _, incomplete = log.window(changed_at=21, started_at=25)
    assert not incomplete
    with pytest.raises(ValueError, match="capacity"):
        AnswerLog(0)


def test_a_recall_lists_each_answer_once_and_keeps_at_most_its_limit(monkeypatch):
    monkeypatch.setattr(recall, "RECALL_LIMIT", 5)
    rec = Recall(started_at=100, changed_at=90)
    assert len(rec.merge([_a(t) for t in range(90, 94)])) == 4
    assert rec.merge([_a(91), _a(92)]) == []  # reported again by a late worker: not twice
    rec.merge([_a(t, accepted=False) for t in range(94, 97)])
    d = rec.as_dict()
    assert d["listed"] == 5 and d["dropped"] == 2 and [a["input"] for a in d["answers"]] == [92, 93, 94, 95, 96]
    assert d["accepted"] == 2 and Recall.from_dict(d).as_dict() == d


def test_the_book_keeps_the_last_episodes(monkeypatch):
    monkeypatch.setattr(recall, "EPISODES", 2)
    book = RecallBook(run="x")
    for start in (10, 20, 30):
        book.add(start, start - 5, [_a(start - 1)])
    assert [r.started_at for r in book.recalls()] == [20, 30] and book.last().run == "x"


def _worker(path: str, start: int, ids: list[int]) -> None:
    RecallBook(path).add(start, 40, [_a(t, rid=f"w{start}-") for t in ids])


def test_workers_sharing_a_file_build_one_recall(tmp_path: Path):
    """Three processes add their own answers of the same episode: the file lists all of them, once each."""
    path = tmp_path / "drift.recall"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(str(path), 50, list(range(40 + k, 50, 3)))) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    (rec,) = RecallBook(path).recalls()
    assert sorted(a.input for a in rec.answers) == list(range(40, 50)) and rec.changed_at == 40


def test_a_damaged_book_file_starts_again(tmp_path: Path):
    path = tmp_path / "drift.recall"
    path.write_bytes(b"{not json")
    book = RecallBook(path)
    assert book.recalls() == []
    book.add(5, 1, [_a(2)])
    assert [a.input for a in book.last().answers] == [2]


def test_the_store_merge_keeps_runs_apart_and_adds_late_answers():
    stored = merge_stored(None, "run1", 50, 40, [_a(41)], False)
    stored = merge_stored(stored, "run2", 50, 45, [_a(46)], False)  # the same input numbers in a later run
    stored = merge_stored(stored, "run1", 50, 40, [_a(42), _a(41)], True)
    assert [(r["run"], r["listed"]) for r in stored] == [("run1", 2), ("run2", 1)] and stored[0]["incomplete"]
    local = [Recall(50, 45, [_a(47)], run="run2").as_dict(), Recall(90, 80, [_a(85)], run="run2").as_dict()]
    both = combine(stored, local)
    assert [(r["run"], r["started_at"], r["listed"]) for r in both] == [
        ("run1", 50, 2),
        ("run2", 50, 2),
        ("run2", 90, 1),
    ]
