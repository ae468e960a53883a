"""The batch's summary statistics (service/batch/batch_summary.py): the shift test's p-value is SciPy's Mann-Whitney U
(asymptotic, tie-corrected, continuity-corrected, one-sided) to float precision, its rejection rate under the null
(batch and calibration drawn from one law) stays at its level by simulation, it rejects a shifted batch, and the
label-free estimate is the /monitor estimator's."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from service.batch.batch_summary import batch_shift_test, difference_of_confidences, label_free, select
from service.core.online import estimate_figure


@pytest.mark.parametrize("ties", [False, True])
def test_the_shift_test_is_scipys_mann_whitney(ties):
    rng = np.random.default_rng(1)
    for n, m in [(25, 300), (400, 2000), (3, 40)]:
        x, y = rng.normal(0.2, 1, n), rng.normal(0, 1, m)
        if ties:
            x, y = np.round(x, 1), np.round(y, 1)
        got = batch_shift_test(x, y, "energy", 0.05)  # an outlier score: as it is
        want = mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True)
        assert got["p_value"] == pytest.approx(want.pvalue, rel=1e-9, abs=1e-15)
        assert got["auc"] == pytest.approx(want.statistic / (n * m), rel=1e-12)
    msp = batch_shift_test(-x, y, "msp", 0.05)  # the MSP grows on ID inputs: negated first, the same test
    assert msp["p_value"] == pytest.approx(got["p_value"], rel=1e-12)


def test_its_rejection_rate_under_the_null_stays_at_its_level():
    """2,000 batches of 200 drawn with the calibration split's law (m = 500): rejections at level 0.05 and 0.01 within
    their binomial 99.9 % band."""
    rng = np.random.default_rng(7)
    p = np.array(
        [batch_shift_test(rng.normal(size=200), rng.normal(size=500), "energy", 0.05)["p_value"] for _ in range(2000)]
    )
    for alpha, high in [(0.05, 0.068), (0.01, 0.019)]:
        assert (p <= alpha).mean() <= high, ((p <= alpha).mean(), alpha)
    assert (p <= 0.05).mean() >= 0.033  # and not far below it: the test is not conservative to uselessness


def test_it_rejects_a_shifted_batch_and_reports_its_auc():
    rng = np.random.default_rng(3)
    cal = rng.normal(size=1000)
    shifted = np.concatenate([rng.normal(size=700), rng.normal(3, 1, 300)])  # 30 % foreign
    out = batch_shift_test(shifted, cal, "energy", 0.01)
    assert out["rejected"] and out["p_value"] < 1e-10 and 0.6 < out["auc"] < 0.75
    assert batch_shift_test([], cal, "energy", 0.01)["rejected"] is False
    assert batch_shift_test([np.nan, 1.0], cal, "energy", 0.01)["n"] == 1  # a NaN score is left out


def test_label_free_is_the_monitors_estimator_and_select_breaks_ties_by_position():
    conf = [0.9, 0.6, 0.75, 0.99]
    rows = [{"confidence": c, "ood_flag": i == 1, "accept": i != 2, "error": None} for i, c in enumerate(conf)]
    rows.append({"error": "broken.png: not an image"})
    got = label_free(rows)
    want = estimate_figure(sum(conf), sum(c * (1 - c) for c in conf), 4)
    assert got["estimated_accuracy"] == {"value": want.value, "low": want.low, "high": want.high, "level": 0.95}
    assert (got["answered"], got["ood_flagged"], got["accepted"]) == (4, 0.25, 0.75)
    ranked = [{"mutual_information": v, "error": None} for v in (0.1, 0.3, 0.3, 0.2)]
    assert [i for i, _ in select(enumerate(ranked), 3, "mutual_information")] == [1, 2, 3]
    with pytest.raises(ValueError, match="--by must be one of"):
        select(enumerate(ranked), 1, "loss")


def test_the_difference_of_confidences_moves_the_calibration_accuracy_by_the_confidence_shift():
    cal_conf = np.array([0.9, 0.8, 0.7, 0.6])  # mean 0.75
    got = difference_of_confidences(0.70, 0.0001, 0.85, 2000, cal_conf)
    half = 1.959963984540054 * np.sqrt(0.0001 + 0.85 * 0.15 / 2000)
    assert got["value"] == pytest.approx(0.80) and got["low"] == pytest.approx(0.80 - half)
    assert got["high"] == pytest.approx(0.80 + half) and got["level"] == 0.95
    assert difference_of_confidences(0.99, 0.0, 0.99, 100, np.array([0.5]))["value"] == 1.0  # clipped
    rows = [{"confidence": c, "ood_flag": False, "accept": True, "error": None} for c in (0.9, 0.7)]
    out = label_free(rows, calibration=(0.85, 2000, cal_conf))
    assert out["adjusted_accuracy"]["value"] == pytest.approx(0.85 + (0.8 - 0.75))
    assert "adjusted_accuracy" not in label_free(rows)
