"""The drift alarm's mixture is the one benchmarks/alarm_grid.py chose on synthetic shifts, by its stated rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import alarm_grid
from service.core.drift import COMPONENTS, TailBets

RESULT = Path(alarm_grid.__file__).parent / "results" / "alarm_grid.json"


def _normal(components) -> list[tuple]:
    bets = TailBets.fit(list(range(3000)), 0.01, components)
    return [
        (tuple(bets.levels[i] for i in m), s, round(w, 12))
        for m, s, w in zip(bets.members, bets.stakes, bets.weights, strict=True)
    ]


def test_the_served_mixture_is_the_committed_choice():
    doc = json.loads(RESULT.read_text())
    assert doc["chosen"] == alarm_grid.choose(doc["candidates"])  # the rule, applied to the committed figures
    assert _normal(alarm_grid.CANDIDATES[doc["chosen"]]) == _normal(COMPONENTS)


def _row(median: float, alarms: int, j: int, clear: float = 100.0) -> dict:
    return {"median_ratio": median, "null_alarms": alarms, "null_bound": 11.0, "components": j, "clear_median": clear}


def test_the_rule_prefers_the_lower_median_within_the_null_bound_and_the_clearing_limit():
    assert alarm_grid.choose({"a": _row(2.0, 0, 1), "b": _row(1.5, 20, 3), "c": _row(1.7, 1, 9)}) == "c"
    assert alarm_grid.choose({"a": _row(1.7, 0, 12), "b": _row(1.7, 0, 3)}) == "b"
    # d is fastest but clears in 2x the first (the previous bet's) inputs: out
    assert alarm_grid.choose({"a": _row(2.0, 0, 1), "d": _row(1.2, 0, 3, 200.0), "e": _row(1.8, 0, 3, 150.0)}) == "e"


def test_binned_kl_known_answers():
    assert alarm_grid.binned_kl(0.0, 0.3) == pytest.approx(0.0, abs=1e-15)  # no shift
    # everything in the first bin's mass scaled: pi = 1, a = 1 is uniform again
    assert alarm_grid.binned_kl(1.0, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert alarm_grid.binned_kl(1.0, 0.05) > alarm_grid.binned_kl(0.5, 0.05) > 0


def test_it_runs_to_its_end(tmp_path: Path):
    out = tmp_path / "grid.json"
    assert alarm_grid.main(["--runs", "5", "--null-runs", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["chosen"] in alarm_grid.CANDIDATES and set(doc["candidates"]) == set(alarm_grid.CANDIDATES)
    assert out.with_suffix(".md").read_text().count("\n| ") >= len(alarm_grid.CANDIDATES)
