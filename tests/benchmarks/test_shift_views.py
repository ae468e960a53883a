"""benchmarks/shift_views: the every-view alarm is the served alarm when there is one view, and it keeps the bound."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.shift_views import (
    DRIFT_DELTA,
    first_alarm_mixture,
    first_alarm_served,
    lorden_estimate,
    markdown,
)
from service.core.drift import HORIZON


def test_one_view_is_the_served_alarm():
    rng = np.random.default_rng(0)
    cal = rng.normal(size=(1000, 1))
    for shift in (0.5, 1.0, 2.0, 4.0):
        stream = rng.normal(size=(400, 1)) + shift
        assert first_alarm_mixture(cal, stream) == first_alarm_served(cal, stream)


def test_every_view_sees_a_shift_in_one_view_that_the_served_score_misses():
    rng = np.random.default_rng(1)
    cal = rng.normal(size=(1000, 3))
    stream = rng.normal(size=(300, 3))
    stream[:, 2] += 3.0  # only the third view moves
    assert first_alarm_served(cal, stream) is None
    at = first_alarm_mixture(cal, stream)
    assert at is not None and at < 40


def test_every_view_alarm_keeps_the_false_alarm_bound():
    """100 in-distribution streams of 1,000 inputs, three correlated views: at most m / A of them alarm (plus the
    split's delta), far fewer in fact."""
    rng = np.random.default_rng(2)
    cal = rng.normal(size=(1000, 1)) + 0.5 * rng.normal(size=(1000, 3))
    fired = 0
    for _ in range(100):
        s = rng.normal(size=(1000, 1)) + 0.5 * rng.normal(size=(1000, 3))
        fired += first_alarm_mixture(cal, s) is not None
    bound = 1000 / (HORIZON / DRIFT_DELTA) + DRIFT_DELTA
    assert fired / 100 <= bound and math.isclose(bound, 0.02)


def test_the_served_mixture_fires_sooner_than_the_previous_bet_on_a_strong_shift_and_not_on_id_traffic():
    """Far-out inputs: the previous bet needed 11 inputs (e_max 2.9 per input to A = 10^5), the mixture 7 (its bets
    pay up to 10^0.8 each)."""
    rng = np.random.default_rng(3)
    cal = rng.normal(size=(1000, 1))
    strong = rng.normal(size=(200, 1)) + 5.0
    assert first_alarm_served(cal, strong) < first_alarm_mixture(cal, strong, previous=True) == 11
    assert all(first_alarm_served(cal, rng.normal(size=(2000, 1))) is None for _ in range(20))


def test_lorden_estimate_known_answers():
    cal = np.arange(1000.0)
    # every score above the split: every p-value is 1/1001, in the first bin (width 0.005): KL = log 200
    assert lorden_estimate(cal, np.full(500, 2000.0)) == round(math.log(1e5) / math.log(200), 1)
    # the split's own scores: p-values uniform, no divergence beyond the bins' rounding
    est = lorden_estimate(cal, cal)
    assert est is None or est > 1000


def test_markdown_names_every_view_and_stream():
    doc = {
        "artifact": "m",
        "command": "python -m benchmarks.shift_views --artifact a",
        "machine": {"cpu": "CPU", "cpus": 2},
        "inputs": 10,
        "views": ["served (msp)", "MSP"],
        "rows": [
            {
                "stream": "noise @1",
                "accuracy": 0.5,
                "flagged": [0.1, 0.2],
                "alarm_served": 12,
                "alarm_every_view": None,
                "alarm_previous_bet": 9,
                "lorden_delay": 4.5,
            }
        ],
    }
    md = markdown(doc)
    assert "| noise @1 | 50.0 | 10.0 | 20.0 | 12 | – | 9 | 4.5 |" in md and "served (msp): flagged %" in md
