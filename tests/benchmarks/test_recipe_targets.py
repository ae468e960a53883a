"""The recipe benchmark's comparison of Hydra against Single over seeds: the figures read from a build's report and
the verdict rule (a difference within its spread is a tie)."""

from __future__ import annotations

from benchmarks.recipe import targets, targets_over_seeds, verdict


def test_verdict_needs_the_difference_to_exceed_its_spread():
    assert verdict([0.83, 0.84, 0.85], [0.80, 0.81, 0.82], lower_is_better=False) == "win"  # +0.03, sd 0
    assert verdict([0.83, 0.84, 0.85], [0.80, 0.81, 0.82], lower_is_better=True) == "loss"
    assert verdict([0.81, 0.80, 0.84], [0.80, 0.82, 0.82], lower_is_better=False) == "tie"  # +0.003 vs sd 0.02
    assert verdict([0.9], [0.8], lower_is_better=False) == "tie (1 seed)"


def _doc(acc: float, nll: float, accept: float) -> dict:
    row = lambda method, a: {  # noqa: E731
        "method": method,
        "acc": a,
        "ece": 0.05,
        "aurc": 0.03,
        "calibrated": {"nll": nll, "ece": 0.02},
        "ood_scores": {"msp": {"avg": {"auroc": a - 0.1}}},
    }
    guarantees = {
        m: {
            "coverage": {"0.05": {"mean_size": 1.2}, "0.1": {"mean_size": 1.05}},
            "selective": [{"risk": 0.01, "test_accept_rate": 0.3}, {"risk": 0.05, "test_accept_rate": accept}],
        }
        for m in ("hydra", "single")
    }
    shift = {m: {"summary": {"mean": {"ece": 0.1, "aurc": 0.08}}} for m in ("hydra", "single")}
    return {
        "rows": [row("hydra", acc), row("single", 0.8)],
        "extra": {"guarantees_report": {"methods": guarantees}, "shift": {"methods": shift}},
    }


def test_targets_read_each_figure_of_hydra_and_single():
    t = targets(_doc(0.82, 0.4, 0.7))
    assert t["nll_ts_hydra"] == 0.4 and t["accept_05_hydra"] == 0.7 and t["accept_05_single"] == 0.7
    assert t["set_size_05_single"] == 1.2 and t["set_size_10_hydra"] == 1.05
    assert t["shift_ece_hydra"] == 0.1 and t["shift_aurc_single"] == 0.08 and t["aurc_hydra"] == 0.03
    assert t["auroc_msp_hydra"] == 0.82 - 0.1 and t["auroc_msp_single"] == 0.8 - 0.1
    assert t["auroc_msp_deep_ensemble"] is None  # no Deep Ensemble built
    with_de = _doc(0.82, 0.4, 0.7)
    with_de["rows"].append({"method": "deep_ensemble", "ood_scores": {"msp": {"avg": {"auroc": 0.75}}}})
    assert targets(with_de)["auroc_msp_deep_ensemble"] == 0.75
    assert targets({"rows": _doc(0.8, 0.4, 0.7)["rows"], "extra": {}})["accept_05_hydra"] is None


def test_table_over_seeds_gives_each_figure_and_verdict():
    rows = []
    for seed, (acc, nll) in enumerate([(0.84, 0.40), (0.85, 0.41), (0.86, 0.39)]):
        doc = _doc(acc, nll, 0.7)
        rows.append(
            {
                "recipe": "kd",
                "seed": seed,
                "acc": acc,
                "acc_single": 0.8 + seed * 0.01,
                "ece_hydra": 0.05,
                "ece_single": 0.05,
                "ece_hydra_ts": 0.02,
                "ece_single_ts": 0.02,
                "auroc_hydra": None,
                "auroc_single": None,
                **targets(doc),
            }
        )
    md = targets_over_seeds(rows)
    assert "**kd** (seeds 0, 1, 2)" in md
    assert "| accuracy % | 85.0 ± 1.0 | 81.0 ± 1.0 | win |" in md
    assert "| set size, alpha 0.05 | 1.2000 ± 0.0000 | 1.2000 ± 0.0000 | tie |" in md
    assert "OOD AUROC %, served score" not in md  # no served-score AUROC in these rows: the line is left out
    assert "| OOD AUROC %, MSP | 75.0 ± 1.0 | 70.0 ± 0.0 | win |" in md
