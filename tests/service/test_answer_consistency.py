"""Every field of an answer agrees with the others: each OOD flag follows the threshold the answer states, each
``selective.accept`` follows the rule the answer states, each flag and each non-accept says why, and no set is
empty. Over many inputs and request levels, on models with and without a calibration split, with the MSP and with
an outlier score (higher = more OOD)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS, make_tiny_artifact
from tests.service.helpers import b64, noise_images, png, settings_for

RISKS = {"risks": [0.05, 0.3, 0.5], "risk": 0.5}
LEVELS = [
    {},
    {"ood_alpha": 0.01},
    {"ood_alpha": 0.2},
    {"ood_alpha": 0.6, "alpha": 0.5},
    {"alpha": 0.9},
    {"risk": 0.05},
    {"risk": 0.3, "ood_alpha": 0.001},
    {"alpha": 0.02, "ood_alpha": 0.5},
]


@pytest.fixture(scope="module", params=[("msp", 0.3), ("energy", None)], ids=["msp", "energy"])
def consistent_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    score, cut = request.param
    art = make_tiny_artifact(
        tmp_path_factory.mktemp("c") / "vit",
        "vit",
        name="tiny-c",
        guarantees=RISKS,
        ood_score=score,
        ood_threshold=cut,
        ood=score != "msp",
    )
    with TestClient(create_app(settings_for(art))) as c:
        yield c


def _images() -> list[str]:
    """Noise of several kinds and contrasts: some inputs pass every rule, some fail each."""
    out = [png(a) for a in noise_images(24, seed=11)]
    out += [png(v) for v in (0, 64, 128, 255)]
    return [b64(x) for x in out]


def _past(score: float, threshold: float, metric: str) -> bool:
    return score < threshold if metric == "msp" else score > threshold


def test_every_field_follows_its_stated_rule(consistent_client):
    images = _images()
    seen = {"flag": 0, "no_flag": 0, "accept": 0, "reject": 0}
    for level in LEVELS:
        r = consistent_client.post("/predict", json={"images": images, **level})
        assert r.status_code == 200, r.text
        for p in r.json()["predictions"]:
            ood, sel, conf = p["ood"], p["selective"], p["conformal"]
            # the flag: p <= alpha, which is exactly the score past the stated threshold
            assert ood["flag"] == (ood["p_value"] <= ood["alpha"])
            thr = ood.get("threshold")  # absent: nothing is flagged at this level
            assert ood["flag"] == (thr is not None and _past(ood["score"], thr, ood["metric"]))
            assert (ood.get("reason") is not None) == ood["flag"]
            seen["flag" if ood["flag"] else "no_flag"] += 1
            # the risk rule: certified, confident enough and inside its OOD cut
            ok = (
                sel["certified"]
                and p["confidence"] >= sel["threshold"]
                and not _past(ood["score"], sel["ood_threshold"], ood["metric"])
            )
            assert sel["accept"] == ok
            assert (sel.get("reason") is not None) == (not sel["accept"])
            seen["accept" if sel["accept"] else "reject"] += 1
            # the set: never empty, holds the prediction when it was filled
            assert conf["size"] == len(conf["set"]) >= 1 and set(conf["set"]) <= set(TINY_LABELS)
            if conf["filled"]:
                assert conf["set"] == [p["label"]]
    assert all(v > 0 for v in seen.values()), seen  # every branch was exercised


def test_flag_threshold_is_the_p_value_rule_exactly():
    """Against the p-value itself, with ties in the calibration scores and levels on and between the p-value grid."""
    from service.core.guarantees import Guarantees

    rng = np.random.default_rng(3)
    for n, metric in itertools.product((1, 7, 50), ("msp", "energy")):
        cal = np.sort(np.round(rng.normal(size=n), 1))  # ties
        g = Guarantees.__new__(Guarantees)
        object.__setattr__(g, "_cal", cal.tolist())
        object.__setattr__(g, "_sign", -1.0 if metric == "msp" else 1.0)
        scores = np.concatenate([rng.normal(size=200), cal, -cal]).round(1)
        oriented = -scores if metric == "msp" else scores
        p = (1 + (cal[None, :] >= oriented[:, None]).sum(1)) / (n + 1)
        grid = np.arange(1, n + 2) / (n + 1)
        for a in np.concatenate([grid[:-1], grid[:-1] - 1e-9, grid[:-1] + 1e-9, [1e-6, 0.5, 0.999]]):
            if not 0 < a < 1:
                continue
            thr = g.flag_threshold(float(a))
            flagged = (
                np.zeros(len(scores), bool) if thr is None else (scores < thr if metric == "msp" else scores > thr)
            )
            np.testing.assert_array_equal(flagged, p <= a, err_msg=f"n={n} {metric} alpha={a}")


def test_a_model_without_guarantees_flags_past_its_build_threshold(tmp_path: Path):
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-plain", ood_threshold=0.4)
    with TestClient(create_app(settings_for(art))) as c:
        r = c.post("/predict", json={"images": _images()})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert {p["ood"]["flag"] for p in preds} == {True, False}
    for p in preds:
        assert p["ood"]["threshold"] == 0.4 and p["ood"]["flag"] == (p["ood"]["score"] < 0.4)
        assert (p["ood"].get("reason") is not None) == p["ood"]["flag"]
