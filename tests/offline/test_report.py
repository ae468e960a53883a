"""The build report: files, every metric in the JSON, every method and OOD set in the markdown, latency."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from offline.method.ensemble_metrics import evaluate_predictions
from offline.report import HEADLINE, PLOT_FILES, SERVED_PLOT, measure_latency, per_class, write_report
from tests.offline.metric_keys import EVAL_OOD_SET_KEYS, EVAL_SCALAR_KEYS

METRIC_KEYS = {*EVAL_SCALAR_KEYS, "ood"}
PNG = b"\x89PNG\r\n\x1a\n"


def test_measure_latency_times_calls_in_inference_mode():
    calls = []

    def fn():
        calls.append(torch.is_inference_mode_enabled())
        time.sleep(0.004)

    r = measure_latency(fn, warmup=2, reps=3)
    assert calls == [True] * 5
    assert set(r) == {"min_ms", "median_ms", "reps"} and r["reps"] == 3
    assert 4.0 <= r["min_ms"] <= r["median_ms"] < 1000
    with pytest.raises(ValueError, match="reps"):
        measure_latency(fn, reps=0)


def _member_probs(rng, labels, m, c, sharp, noise):
    """(N, M, C) member probabilities that mostly favour ``labels``."""
    logits = rng.normal(0, noise, (len(labels), m, c))
    logits[np.arange(len(labels)), :, labels] += sharp
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture
def report_inputs():
    rng = np.random.default_rng(0)
    n, c, m = 120, 4, 3
    labels = rng.integers(0, c, n)
    ood_kinds = {"held-out-classes": "near", "digits": "far"}
    ood_labels = {name: rng.integers(0, c, 80) for name in ood_kinds}
    members_id = _member_probs(rng, labels, m, c, 3.0, 1.5)
    members_ood = {k: _member_probs(rng, y, m, c, 0.5, 1.5) for k, y in ood_labels.items()}
    per_method = {
        "single": (
            _member_probs(rng, labels, 1, c, 3.5, 1.0),
            {k: _member_probs(rng, y, 1, c, 1.5, 1.0) for k, y in ood_labels.items()},
        ),
        **{
            f"member_{i}": (members_id[:, i : i + 1], {k: v[:, i : i + 1] for k, v in members_ood.items()})
            for i in range(m)
        },
        "hydra": (members_id, members_ood),
        "ensemble_unfused": (members_id, members_ood),
    }
    rows, plots = [], {"labels": labels, "ood_kinds": ood_kinds}
    lat = {"min_ms": 1.0, "median_ms": 1.2, "reps": 5}
    for i, (name, (p, po)) in enumerate(per_method.items()):
        rows.append(
            {
                "method": name,
                **evaluate_predictions(p, labels, po, ood_score="msp"),
                "params": 1000 * (i + 1),
                "latency_ms": {"batch1": lat, "batch8": lat},
            }
        )
        plots[name] = {"member_probs_id": p, "member_probs_ood": po}
    extra = {
        "temperature": 1.3,
        "ood_threshold": 0.61,
        "ood_score": "msp",
        "timings_s": {"data": 1.0, "calibration": 0.5},
        "ood_val_flagged": 0.42,
    }
    return rows, ood_kinds, plots, extra


def test_write_report_files_json_markdown(tmp_path, report_inputs):
    rows, ood_kinds, plots, extra = report_inputs
    summary = write_report(tmp_path, rows, ood_kinds, plots, "test build: Hydra", extra)

    for f in PLOT_FILES:
        data = (tmp_path / "plots" / f).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, f

    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["title"] == "test build: Hydra"
    assert doc["extra"]["temperature"] == 1.3 and doc["extra"]["timings_s"]["data"] == 1.0
    assert [r["method"] for r in doc["rows"]] == [r["method"] for r in rows]
    for r in doc["rows"]:
        assert METRIC_KEYS <= set(r), r["method"]
        assert set(r["ood"]) == set(ood_kinds)
        for o in r["ood"].values():
            assert EVAL_OOD_SET_KEYS <= set(o)
        assert r["params"] > 0 and r["latency_ms"]["batch8"]["median_ms"] == 1.2
    hydra = next(r for r in doc["rows"] if r["method"] == "hydra")
    assert hydra["acc"] == pytest.approx(rows[-2]["acc"])

    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# test build: Hydra")
    for r in rows:
        assert f"| {r['method']} |" in md
    for name, kind in ood_kinds.items():
        assert f"### {name} ({kind})" in md
    for header in ("Acc %", "NLL", "Brier", "ECE %", "aECE %", "AUROC %", "FPR95 %", "AUPR-In %", "AUPR-Out %"):
        assert header in md
    assert f"{100 * hydra['acc']:.2f}" in md  # numbers, as percentages
    assert "temperature" in md and "ood_threshold" in md and "calibration" in md
    for f in PLOT_FILES:
        assert f"plots/{f}" in md

    assert set(summary) == {r["method"] for r in rows}
    for s in summary.values():
        assert set(HEADLINE) | {"auroc", "fpr95", "aupr_in", "aupr_out", "params", "latency_ms"} <= set(s)
    json.dumps(summary, allow_nan=False)  # manifest-ready: plain JSON


def test_write_report_strict_json_with_nan(tmp_path, report_inputs):
    rows, ood_kinds, plots, extra = report_inputs
    rows = [{**r, "mi_ood": float("nan")} if r["method"] == "single" else r for r in rows]
    summary = write_report(tmp_path, rows, ood_kinds, plots, "nan", extra)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["rows"][0]["mi_ood"] is None and summary["single"]["mi_ood"] is None
    assert "| single |" in (tmp_path / "report.md").read_text()


SCORES = ("msp", "energy", "mahalanobis")


def _with_new_inputs(rows, ood_kinds, plots, extra):
    """The fixture's inputs plus everything the builder now passes: main rows at T = 1, each method at its own
    fitted temperature, OOD detection per score, the score selection, the served flag and its score's values."""
    rng = np.random.default_rng(1)
    rows = [dict(r) for r in rows]
    for i, r in enumerate(rows):
        r["temperature"] = 1.0
        r["calibrated"] = {
            "temperature": 1.25 + i / 100,
            "acc": r["acc"],
            "nll": 0.5 + i / 100,
            "brier": 0.2,
            "ece": 0.01 + i / 1000,
            "aece": 0.02,
            "aurc": 0.03 + i / 1000,
        }
        scores = SCORES if r["method"] != "ensemble_unfused" else SCORES[:2]  # no features: no Mahalanobis
        r["ood_scores"] = {
            s: {
                "ood": {n: {"auroc": 0.70 + j / 10 + i / 100, "fpr95": 0.5} for n in ood_kinds},
                "avg": {"auroc": 0.75 + j / 10 + i / 100, "fpr95": 0.5 - j / 10},
            }
            for j, s in enumerate(scores)
        }
    candidates = {
        s: {
            "threshold": 0.5 + j,
            "id_val_flag_rate": 0.05,
            "val_recall": {"val-near": 0.4, "val-far": 0.6 + j / 10},
            "val_mean_recall": 0.5 + j / 20,
        }
        for j, s in enumerate(SCORES)
    }
    candidates["mahalanobis"]["val_mean_recall"] = 0.87654
    served_flag = {
        "score": "mahalanobis",
        "threshold": 41.5,
        "id_test_flag_rate": 0.0523,
        "recall": {"held-out-classes": 0.6123, "digits": 0.9345},
    }
    extra = {
        **extra,
        "ood_candidates": candidates,
        "ood_selected": "mahalanobis",
        "ood_forced": False,
        "served_flag": served_flag,
    }
    served = {
        "score": "mahalanobis",
        "threshold": 41.5,
        "id": rng.chisquare(30, 200),
        "ood": {n: rng.chisquare(30, 100) * (2 + i) for i, n in enumerate(ood_kinds)},
    }
    return rows, ood_kinds, {**plots, "served": served}, extra


def test_write_report_new_sections(tmp_path, report_inputs):
    rows, ood_kinds, plots, extra = _with_new_inputs(*report_inputs)
    summary = write_report(tmp_path, rows, ood_kinds, plots, "new", extra)
    md = (tmp_path / "report.md").read_text()

    # like with like: the main ID table says its temperature, then each method at its own fitted one
    assert "## In-distribution (test set, at T = 1)" in md
    assert "## In-distribution (test set), each method at its own fitted temperature" in md
    hydra = next(r for r in rows if r["method"] == "hydra")
    assert f"| hydra | {hydra['calibrated']['temperature']:.4g} | {100 * hydra['acc']:.2f} | 0.5400 |" in md
    assert f"| {100 * hydra['calibrated']['aurc']:.2f} |" in md  # the calibrated table's AURC column
    # OOD by score: single + score (the features) next to hydra + the same score (the ensemble); served per set
    assert "## OOD AUROC by score" in md and "| Method | msp | energy | mahalanobis (served) |" in md
    assert "| hydra | 79.00 | 89.00 | **99.00** |" in md  # each method's best bold
    assert "| ensemble_unfused | 80.00 | **90.00** | – |" in md  # a missing score shows as –
    assert "### Served score `mahalanobis` per OOD test set" in md
    assert "held-out-classes (near) AUROC %" in md and "digits (far) FPR95 %" in md
    # the selection on validation sets: every candidate, the served one marked, how it was chosen
    assert "## OOD score selection (validation sets)" in md
    assert "| **mahalanobis** | yes | 2.5 | 5.00 | 40.00 | 80.00 | 87.65 |" in md
    assert "| msp |  | 0.5 | 5.00 | 40.00 | 60.00 | 50.00 |" in md
    assert "`mahalanobis` is served: the best mean recall" in md
    # the served flag on test data: ID false alarms, recall per OOD set with its kind
    assert "## The served flag on test data" in md and "threshold 41.5" in md
    assert "| ID test | id | 5.23 |" in md and "| held-out-classes | near | 61.23 |" in md
    assert "| digits | far | 93.45 |" in md and "| mean over OOD sets |  | 77.34 |" in md
    assert "ood_candidates" not in md.split("## Build")[1]  # rendered once, not again as a build fact
    # the old sections are still there
    assert "## OOD detection (score: `msp`)" in md and "### Average over OOD sets" in md

    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["extra"]["ood_selected"] == "mahalanobis" and doc["extra"]["ood_forced"] is False
    assert doc["extra"]["ood_candidates"]["mahalanobis"]["val_mean_recall"] == 0.87654
    assert doc["extra"]["served_flag"]["recall"]["digits"] == 0.9345
    assert doc["rows"][0]["calibrated"]["temperature"] == 1.25 and "mahalanobis" in doc["rows"][0]["ood_scores"]
    assert f"plots/{SERVED_PLOT}" in doc["plots"] and f"plots/{SERVED_PLOT}" in md
    data = (tmp_path / "plots" / SERVED_PLOT).read_bytes()
    assert data.startswith(PNG) and len(data) > 5000

    old_keys = set(HEADLINE) | {"auroc", "fpr95", "aupr_in", "aupr_out", "params", "latency_ms"}
    assert set(summary["hydra"]) == old_keys | {"ece_ts", "nll_ts", "temperature_ts"}
    assert summary["hydra"]["nll_ts"] == hydra["calibrated"]["nll"]
    assert summary["hydra"]["temperature_ts"] == hydra["calibrated"]["temperature"]


def test_write_report_without_new_inputs_has_no_new_sections(tmp_path, report_inputs):
    rows, ood_kinds, plots, extra = report_inputs
    summary = write_report(tmp_path, rows, ood_kinds, plots, "old", extra)
    md = (tmp_path / "report.md").read_text()
    assert "## In-distribution (test set)\n" in md
    for heading in ("fitted temperature", "OOD AUROC by score", "OOD score selection", "served flag", "no OOD data"):
        assert heading not in md
    assert not (tmp_path / "plots" / SERVED_PLOT).exists()
    assert not any(k.endswith("_ts") for s in summary.values() for k in s)


def test_write_report_mixed_temperatures_forced_score_no_ood_data(tmp_path, report_inputs):
    rows, ood_kinds, plots, extra = _with_new_inputs(*report_inputs)
    rows = [{**r, "temperature": 1.5} if r["method"] == "hydra" else r for r in rows]
    extra = {**extra, "ood_forced": True, "no_ood_data": True}
    write_report(tmp_path, rows, ood_kinds, plots, "forced", extra)
    md = (tmp_path / "report.md").read_text()
    assert "## In-distribution (test set, each method at the temperature T)" in md
    assert "| Method | T | Params |" in md and "| hydra | 1.5 |" in md
    assert "This build had no OOD data" in md and "## OOD detection (score:" not in md
    assert "`mahalanobis` is served because the build config forces it" in md


def test_per_class_accuracy_and_confusion_by_name(tmp_path, report_inputs):
    """Known answers (a hand-made case), the confusion matrix against scikit-learn's, and the report's section and
    plot by the class names given."""
    from sklearn.metrics import confusion_matrix

    probs = np.array([[[0.9, 0.1]], [[0.2, 0.8]], [[0.6, 0.4]], [[0.3, 0.7]], [[0.4, 0.6]]])  # (5, 1, 2)
    got = per_class(np.array([0, 0, 1, 1, 1]), probs, ["Shirt", "Sandal"])
    assert got == {
        "accuracy": {"Shirt": 0.5, "Sandal": 2 / 3},
        "support": {"Shirt": 2, "Sandal": 3},
        "confusion": [[1, 1], [1, 2]],
    }

    rows, ood_kinds, plots, extra = report_inputs
    names = ["T-shirt/top", "Trouser", "Pullover", "Shirt"]
    write_report(tmp_path, rows, ood_kinds, {**plots, "class_names": names}, "t", extra)
    doc = json.loads((tmp_path / "report.json").read_text())
    hydra = doc["extra"]["per_class"]["hydra"]
    pred = plots["hydra"]["member_probs_id"].mean(1).argmax(-1)
    assert hydra["confusion"] == confusion_matrix(plots["labels"], pred, labels=range(4)).tolist()
    assert list(hydra["accuracy"]) == names
    md = (tmp_path / "report.md").read_text()
    assert "## Per class (ID test, by the data's class names)" in md and "| Shirt |" in md
    assert "plots/confusion.png" in doc["plots"] and (tmp_path / "plots" / "confusion.png").is_file()
