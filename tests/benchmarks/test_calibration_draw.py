"""benchmarks/calibration_draw.py: the backbone it scores with is loaded as its record says, normalisation included,
so its accuracy on real test images matches the record's (a wrong normalisation or head would not)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import calibration_draw as cd
from offline import data as data_mod
from tests.fixtures.fashion import needs_fashion


@needs_fashion
def test_backbone_scores_real_test_images_as_its_record_says():
    model = cd.backbone()
    fdir = data_mod.fashion_dir()
    x = data_mod.read_idx_images(fdir / data_mod.FASHION_FILES["test_images"])
    y = data_mod.read_idx_labels(fdir / data_mod.FASHION_FILES["test_labels"])
    idx = np.flatnonzero(np.isin(y, data_mod.FASHION_ID_CLASSES))[:1200]
    got = cd.accuracy(model, x[idx], y[idx])
    record = json.loads(cd.RECORD.read_text())["test_accuracy"]["fp32_weights"]
    garments = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt"}
    assert got["n"] == 1200 and set(got["per_class"]) == garments
    assert got["accuracy"] == pytest.approx(record, abs=3 * np.sqrt(record * (1 - record) / 1200))
