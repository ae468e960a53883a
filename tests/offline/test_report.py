"""The build report: files, every metric in the JSON, every method and OOD set in the markdown, latency."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from offline.metrics import evaluate_predictions
from offline.report import HEADLINE, PLOT_FILES, measure_latency, write_report
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
