"""The golden test: the recorded answers of ``tests/fixtures/golden`` (tiny image and text models with guarantees, in
eager, TorchScript and ONNX, through ``/predict`` and the Open Inference Protocol) are what the server answers now.
Every decision (label, top-k, set, flag, accept, rule, reason) is identical and every number agrees to within 1e-6
relative; ids, timings and the model's version (a hash of its manifest, which records when it was built) are
exempt. It is how work on the request path shows that it changed no answer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import golden

REL = 1e-6


def _diff(want: Any, got: Any, where: str) -> list[str]:
    """Where ``got`` differs from ``want``: numbers beyond ``REL`` relative (1e-9 absolute near 0), anything else at
    all, keys and lengths included."""
    if isinstance(want, bool) or isinstance(got, bool) or isinstance(want, str) or want is None:
        return [] if want == got and type(want) is type(got) else [f"{where}: {want!r} != {got!r}"]
    if isinstance(want, (int, float)):
        ok = isinstance(got, (int, float)) and math.isclose(want, got, rel_tol=REL, abs_tol=1e-9)
        return [] if ok else [f"{where}: {want!r} != {got!r}"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(want) != set(got):
            return [f"{where}: keys {sorted(want)} != {sorted(got) if isinstance(got, dict) else got!r}"]
        return [d for k in want for d in _diff(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            return [f"{where}: {len(want)} items != {got!r}"]
        return [d for i, (a, b) in enumerate(zip(want, got, strict=True)) for d in _diff(a, b, f"{where}[{i}]")]
    return [f"{where}: unexpected {type(want).__name__}"]


def test_the_diff_sees_a_changed_decision_and_a_moved_number():
    base = {"label": "cat", "p": 0.5, "set": ["cat"], "ok": True}
    assert _diff(base, dict(base), "a") == []
    assert _diff(base, {**base, "p": 0.5 * (1 + 2e-7)}, "a") == []
    assert _diff(base, {**base, "p": 0.5001}, "a") == ["a.p: 0.5 != 0.5001"]
    assert _diff(base, {**base, "ok": False}, "a") and _diff(base, {**base, "set": ["dog"]}, "a")
    assert _diff(base, {**base, "extra": 1}, "a") and _diff(base, {**base, "p": 1}, "a")
    assert _diff({"n": 3}, {"n": 3.0}, "a") == []  # JSON's 3 and 3.0 are one number


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return golden.collect(tmp_path_factory.mktemp("golden"))


def test_every_answer_is_the_recorded_one(answers: dict[str, Any]):
    want = json.loads(golden.GOLDEN.read_text())
    assert set(answers) == set(want) and len(want) == 2 * len(golden.BACKENDS) * len(golden.requests("vit"))
    diffs = [d for key in sorted(want) for d in _diff(want[key], answers[key], key)]
    assert diffs == [], "\n".join(diffs[:20])


def test_the_recording_covers_every_decision(answers: dict[str, Any]):
    """The recorded answers are worth holding to: accepted and not accepted answers, flagged and unflagged inputs,
    sets of one label and of several, reasons, member predictions and every score, in every backend."""
    preds = [p for a in answers.values() if "predictions" in a["body"] for p in a["body"]["predictions"]]
    assert {p["selective"]["accept"] for p in preds} == {True, False}
    assert {p["ood"]["flag"] for p in preds} == {True, False}
    assert {len(p["conformal"]["set"]) > 1 for p in preds} == {True, False}
    assert any("members" in p for p in preds) and any("scores" in p["ood"] for p in preds)
    assert any(p["selective"].get("reason") for p in preds) and any(p["ood"].get("reason") for p in preds)
    v2 = [a for k, a in answers.items() if "outputs" in a["body"]]
    assert len(v2) == 2 * 2 * len(golden.BACKENDS) and all(a["status"] == 200 for a in answers.values())


def test_the_golden_file_is_in_the_repository():
    assert golden.GOLDEN.is_file() and golden.GOLDEN.relative_to(Path(__file__).resolve().parents[2])
