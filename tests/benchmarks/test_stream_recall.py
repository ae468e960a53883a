"""benchmarks/stream.py: the delay's bound and the recall's coverage and precision, on known records."""

from __future__ import annotations

import math

from benchmarks.stream_figures import lorden_bound, recall_figures


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


def test_labels_to_half_of_the_hindsight_threshold():
    from benchmarks.stream_figures import labels_to_half

    # after the alarm (record 0 here): the 100 most confident answers are right, the rest wrong: at risk 0 the
    # hindsight threshold accepts exactly those, 1/4 of 400
    rec = lambda c, ok, acc: {"confidence": c, "correct": ok, "accept": acc}  # noqa: E731
    records = [rec(0.99 if i % 4 == 0 else 0.5, i % 4 == 0, False) for i in range(200)]
    records += [rec(0.99 if i % 4 == 0 else 0.5, i % 4 == 0, i % 4 == 0) for i in range(200)]  # the rule learns
    got = labels_to_half(records, risk=0.0, start=0, window=100)
    assert got["hindsight_share"] == 0.25
    # the rule accepts 1 in 4, all right, once its window of 100 lies in the second half: at answer 300 at the latest
    assert 200 < got["labels_to_half"] <= 300
    never = labels_to_half([rec(0.5, False, False)] * 50, risk=0.05, start=0)
    assert never == {"hindsight_share": 0.0, "labels_to_half": None}
