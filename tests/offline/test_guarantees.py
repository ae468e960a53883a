"""The builder's calibration record (:func:`offline.method.guarantee_fits.fit_guarantees`): its ``errors`` are the
served model's wrong top labels on the calibration split, by hand on known outputs and on a tiny build served for
real."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from offline.build import build
from offline.config import GuaranteesConfig
from offline.data import load
from offline.method.guarantee_fits import CalibrationOutputs, calibration_errors, fit_guarantees
from service.core.artifact import load_manifest
from service.core.online import HarmfulShiftAlarm, clopper_pearson_upper
from service.entrypoints.app import create_app
from tests.service.helpers import settings_for

from .conftest import ticket_config


def _outputs(probs: list[list[float]], labels: list[int]) -> CalibrationOutputs:
    p = np.asarray(probs, dtype=np.float64)
    return CalibrationOutputs(p, np.asarray(labels, dtype=np.int64), -p.max(axis=1))


def test_errors_count_wrong_top_labels_with_ties_to_the_first():
    # tops: 0, 1, 2, 0 (a tie between 0 and 1 goes to 0, as argmax serves it); labels 0, 2, 2, 1: rows 1 and 3 wrong
    cal = _outputs([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5], [0.4, 0.4, 0.2]], [0, 2, 2, 1])
    assert calibration_errors(cal) == 2


def test_fit_writes_errors_beside_the_split_record_and_leaves_it_alone():
    rng = np.random.default_rng(0)
    n, classes = 400, 3
    probs = rng.dirichlet(np.ones(classes), n)  # (N, C)
    labels = np.where(rng.random(n) < 0.7, probs.argmax(1), rng.integers(0, classes, n))
    record = {"source": "held out", "size": n, "index_sha256": "ab", "class_counts": {"a": 1}}
    cal = CalibrationOutputs(probs, labels, probs.max(1))
    val = CalibrationOutputs(*(lambda p: (p, p.argmax(1), p.max(1)))(rng.dirichlet(np.ones(classes), 300)))
    spec = fit_guarantees(GuaranteesConfig(), cal, val, "msp", 0.4, record).spec
    want = int(sum(int(np.argmax(p)) != y for p, y in zip(probs, labels, strict=True)))  # one row at a time
    assert spec["calibration"] == {**record, "errors": want}
    assert "errors" not in record  # the same dict is data.id.calibration: not written through
    assert 0 < want < n and spec["ood"]["n"] == n
    # what the server builds from it: the Clopper-Pearson bound at delta / 2 on errors out of n
    alarm = HarmfulShiftAlarm.from_errors(spec["calibration"]["errors"], spec["ood"]["n"], delta=0.05)
    assert alarm.source_upper == clopper_pearson_upper(want, n, 0.025) > want / n


@pytest.mark.slow  # a build (about 20 s on 2 cores)
def test_tiny_build_records_the_served_models_calibration_errors(user_files, tmp_path):
    """The errors in a built manifest are the calibration texts the server, serving that artifact, answers wrong."""
    ckpt, data = user_files
    cfg = ticket_config(ckpt, data)
    out = build(cfg, tmp_path / "artifact")
    record = load_manifest(out).guarantees.calibration
    split = load(cfg.data)
    names = split.class_names
    assert split.calibration is not None and record["size"] == len(split.calibration) > 0
    with TestClient(create_app(settings_for(out, backend="onnx"))) as c:
        r = c.post("/predict", json={"texts": list(split.calibration.inputs)})
    assert r.status_code == 200, r.text
    served = [p["label"] for p in r.json()["predictions"]]
    by_hand = sum(s != names[y] for s, y in zip(served, split.calibration.labels, strict=True))
    assert record["errors"] == by_hand
    assert 0 < by_hand < record["size"]  # a random tiny model: right on some, wrong on others (14 of 22)
