"""The report's shift section: every method on corrupted copies of ID test inputs, at its own temperature, with its
own risk rule; its summaries and its markdown."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from offline.build import build
from offline.config import ConfigError, load_config
from offline.method.corruptions import REPORT_SEVERITIES, corrupt
from offline.method.ensemble_metrics import aurc, ece
from offline.report.shift_tables import shift_section
from offline.stages.datasets import load_data
from offline.stages.shift_eval import shift_report, shift_summary
from service.core.artifact import load_manifest
from service.core.preprocess import make_preprocessor
from service.core.registry import load_model

from .conftest import ticket_build, ticket_config


def test_summary_averages_by_severity_and_over_everything():
    per_set = {
        "noise@1": {"acc": 0.9, "accepted_error": 0.02},
        "noise@2": {"acc": 0.7, "accepted_error": None},  # nothing accepted: no error among accepted
        "blur@1": {"acc": 0.8, "accepted_error": 0.04},
        "blur@2": {"acc": 0.5, "accepted_error": 0.10},
    }
    s = shift_summary(per_set)
    assert set(s) == {"1", "2", "mean"}
    assert s["1"]["acc"] == pytest.approx(0.85) and s["2"]["acc"] == pytest.approx(0.6)
    assert s["mean"]["acc"] == pytest.approx(0.725)
    assert s["2"]["accepted_error"] == pytest.approx(0.10)  # the copy with nothing accepted is left out
    assert s["mean"]["accepted_error"] == pytest.approx(0.16 / 3)


def test_report_joins_each_methods_risk_rule_and_renders():
    metrics = {
        "single": {"noise@1": {"acc": 0.9, "ece": 0.05, "nll": 0.3, "aurc": 0.02}},
        "hydra": {"noise@1": {"acc": 0.92, "ece": 0.03, "nll": 0.25, "aurc": 0.015}},
    }
    rule = lambda rate, err: {"shift": {"noise@1": {"risk": 0.05, "test_accept_rate": rate, "test_risk": err}}}  # noqa: E731
    report = shift_report(metrics, {"methods": {"single": rule(0.6, 0.04), "hydra": rule(0.7, 0.03)}})
    assert report["risk"] == 0.05
    assert report["methods"]["hydra"]["sets"]["noise@1"] == {
        "acc": 0.92,
        "ece": 0.03,
        "nll": 0.25,
        "aurc": 0.015,
        "accept_rate": 0.7,
        "accepted_error": 0.03,
    }
    md = "\n".join(shift_section({"shift": report}))
    assert "## Shifted inputs" in md and "noise" in md and "5.00 % target" in md
    assert "| hydra | 92.00 | 3.00 | 0.2500 | 0.0150 | 70.00 | 3.00 |" in md
    assert shift_report({}, None) == {} and shift_section({}) == []
    without = shift_report(metrics, None)  # no calibration split: no risk rules, no accept columns
    assert without["risk"] is None and "Accepted" not in "\n".join(shift_section({"shift": without}))


def test_shift_inputs_must_be_a_count():
    with pytest.raises(ConfigError, match="data.shift_inputs"):
        load_config(None, {"data.shift_inputs": -1})


def test_build_reports_every_method_on_shifted_copies(user_files, tmp_path):
    """A tiny text build with ``data.shift_inputs``: every method runs on every corruption and severity; Hydra's
    figures on a copy are the artifact's own model on those corrupted texts, at the served temperature."""
    ckpt, data = user_files
    cfg = ticket_config(ckpt, data, **{"data.shift_inputs": 12, "export.onnx": False})
    out = build(cfg, tmp_path / "artifact")
    doc = json.loads((out / "report.json").read_text())
    shift = doc["extra"]["shift"]
    methods = shift["methods"]
    assert {"single", "member_0", "member_1", "member_2", "hydra", "ensemble_unfused"} <= set(methods)
    copies = {f"{k}@{s}" for k in ("typos", "drop") for s in REPORT_SEVERITIES}
    assert set(methods["hydra"]["sets"]) == copies
    assert set(methods["hydra"]["summary"]) == {"1", "2", "3", "4", "5", "mean"}  # the five severities
    assert "## Shifted inputs" in (out / "report.md").read_text()
    # Hydra on drop@3, recomputed from the artifact: the first 12 test texts, corrupted, through the served model
    m = load_manifest(out)
    d = load_data(load_config(None, ticket_build(ckpt, data)))
    texts = corrupt(d.test.inputs[:12], "drop", 3, seed=0)
    pre = make_preprocessor(m.preprocessing, out, 1 << 20)
    model = load_model(out / "model.safetensors", m.model.config)
    with torch.inference_mode():
        logits = model(**pre.collate(pre.encode(texts)))
    member_probs = torch.softmax(logits.double() / m.uncertainty.temperature, -1).numpy()  # (N, M, C)
    probs = member_probs.mean(1)
    y = d.test.labels[:12]
    got = methods["hydra"]["sets"]["drop@3"]
    assert got["acc"] == pytest.approx(float((probs.argmax(1) == y).mean()), abs=1e-9)
    assert got["ece"] == pytest.approx(ece(member_probs, y), abs=1e-4)
    assert got["aurc"] == pytest.approx(aurc(probs.max(1), probs.argmax(1) == y), abs=1e-4)
    brier = float(((probs - np.eye(probs.shape[1])[y]) ** 2).sum(1).mean())  # the multi-class Brier score
    assert got["brier"] == pytest.approx(brier, abs=1e-6)
    if doc["extra"].get("guarantees_report"):  # a calibration split: each method's risk rule on each copy
        assert shift["risk"] == cfg.guarantees.risk
        assert all(0 <= v["accept_rate"] <= 1 for v in methods["hydra"]["sets"].values())
    assert np.isfinite(methods["single"]["summary"]["mean"]["nll"])


@pytest.mark.parametrize("bad", [[], [0, 1], [3, 1], [1, 1], [6]])
def test_shift_severities_are_distinct_increasing_levels_of_1_to_5(bad):
    with pytest.raises(ConfigError, match=r"data\.shift_severities must be distinct increasing severities of 1 to 5"):
        load_config(None, {"data.shift_severities": bad})
