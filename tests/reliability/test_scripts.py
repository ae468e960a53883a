"""The load and SIGTERM scripts, end to end in short runs (each starts ``python -m service`` on loopback)."""

from __future__ import annotations

import json

import pytest

from benchmarks import load_test, sigterm_test


@pytest.mark.slow
def test_load_script_short_run(tmp_path):
    out = tmp_path / "load.json"
    assert load_test.main(["--tiny", "vit", "--concurrency", "8", "64", "--duration", "3", "4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["passed"] and r["totals"]["lost"] == 0 and r["totals"]["sent"] == r["totals"]["answered"] > 0
    assert set(r["totals"]["errors_by_code"]) <= {"overloaded"} and r["server_exit_status"] == 0
    assert r["phases"][1]["concurrency"] == 64 and r["rss_mb"]["growth"] <= r["rss_mb"]["bound"]


@pytest.mark.slow
def test_sigterm_script_short_run(tmp_path):
    out = tmp_path / "sigterm.json"
    assert (
        sigterm_test.main(
            ["--tiny", "vit", "--concurrency", "32", "--load-seconds", "3", "--after-seconds", "1", "--out", str(out)]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["passed"] and r["totals"]["lost"] == 0 and r["totals"]["resets"] == 0
    (rep,) = r["repetitions"]
    assert rep["exit_status"] == 0 and rep["client"]["in_flight_at_sigterm"].get("ok", 0) > 0
    assert rep["server"]["requests_received"] == rep["server"]["requests_answered"]
