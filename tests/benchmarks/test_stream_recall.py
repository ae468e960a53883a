"""benchmarks/stream.py: the delay's bound and the recall's coverage and precision, on known records."""

from __future__ import annotations

import math

from benchmarks.stream import lorden_bound, recall_figures


def test_lorden_bound_known_answers():
    # every p-value in the first bin (width 0.005): KL = log 200
    assert lorden_bound([0.001] * 50, 1e5) == round(math.log(1e5) / math.log(200), 1)
    assert lorden_bound([], 1e5) is None


def test_recall_coverage_and_precision():
    rec = lambda i, accept, correct, suspended=False: {  # noqa: E731
        "id": f"r{i}",
        "accept": accept,
        "correct": correct,
        "suspended": suspended,
    }
    records = [rec(1, True, True), rec(2, True, False)]  # the clean prefix (2 inputs)
    records += [rec(3, True, False), rec(4, False, False), rec(5, True, False), rec(6, True, True)]
    records += [rec(7, False, False, suspended=True)]  # the alarm
    run = {
        "records": records,
        "recalled": [{"changed_at": 2, "answers": [{"id": f"r{i}"} for i in (2, 3, 4, 6)]}],
    }
    got = recall_figures(run, prefix=2)
    # wrong accepts before the alarm, after the shift: r3 and r5; recalled: r3 only
    assert (got["wrong_accepts_before_alarm"], got["wrong_accepts_recalled"], got["recall_coverage"]) == (2, 1, 0.5)
    assert got["recalled"] == 4 and got["recall_precision"] == 0.75  # r2 was in the prefix
