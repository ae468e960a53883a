"""The golden test: the recorded answers of ``tests/fixtures/golden`` (tiny image and text models with guarantees, in
eager, TorchScript and ONNX, through ``/predict`` and the Open Inference Protocol) are what the server answers now.
Every decision (label, top-k, set, flag, accept, rule, reason) is identical; ids, timings and the model's version (a
hash of its manifest, which records when it was built) are exempt. The numbers agree to within ``golden.TOL *
(|value| + golden.SCALE)`` on any CPU: 13 times the largest move measured across instruction sets
(``tests/fixtures/golden/spread.json``). Two stricter checks keep a small change to the request path in sight: on
the machine that recorded the answers every number agrees to ``golden.STRICT``, and on any machine the eager and the
TorchScript answers of one run (the same kernels, two backends) agree to ``golden.STRICT``. It is how work on the
request path shows that it changed no answer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import golden


def _diff(want: Any, got: Any, where: str, tol: float = golden.TOL) -> list[str]:
    """Where ``got`` differs from ``want``: a number beyond ``tol * (|want| + SCALE)``, a message in its words or in a
    number it writes beyond the digits shown (:func:`golden.same_words`), anything else at all, keys and lengths
    included."""
    if isinstance(want, str) and isinstance(got, str):
        return [] if golden.same_words(want, got, tol) else [f"{where}: {want!r} != {got!r}"]
    if isinstance(want, bool) or isinstance(got, bool) or isinstance(want, str) or want is None:
        return [] if want == got and type(want) is type(got) else [f"{where}: {want!r} != {got!r}"]
    if isinstance(want, (int, float)):
        ok = isinstance(got, (int, float)) and golden.close(want, got, tol)
        return [] if ok else [f"{where}: {want!r} != {got!r}"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(want) != set(got):
            return [f"{where}: keys {sorted(want)} != {sorted(got) if isinstance(got, dict) else got!r}"]
        return [d for k in want for d in _diff(want[k], got[k], f"{where}.{k}", tol)]
    if isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            return [f"{where}: {len(want)} items != {got!r}"]
        return [d for i, (a, b) in enumerate(zip(want, got, strict=True)) for d in _diff(a, b, f"{where}[{i}]", tol)]
    return [f"{where}: unexpected {type(want).__name__}"]


def test_the_diff_sees_a_changed_decision_and_a_moved_number():
    base = {"label": "cat", "p": 0.5, "set": ["cat"], "ok": True, "why": "score 2.82 is above 2.489"}
    assert _diff(base, dict(base), "a") == []
    assert _diff(base, {**base, "p": 0.5 * (1 + 2e-5)}, "a") == []  # a move another CPU makes
    assert _diff(base, {**base, "p": 0.5 * (1 + 2e-5)}, "a", golden.STRICT) != []  # not on the recording's machine
    assert _diff(base, {**base, "p": 0.5002}, "a") == ["a.p: 0.5 != 0.5002"]
    assert _diff(base, {**base, "ok": False}, "a") and _diff(base, {**base, "set": ["dog"]}, "a")
    assert _diff(base, {**base, "extra": 1}, "a") and _diff(base, {**base, "p": 1}, "a")
    assert _diff({"n": 3}, {"n": 3.0}, "a") == []  # JSON's 3 and 3.0 are one number
    assert _diff({"mi": 0.0114}, {"mi": 0.0114 + 5e-5}, "a") == []  # a difference of two entropies moves in absolute
    assert _diff({"mi": 0.0114}, {"mi": 0.0116}, "a") != []
    assert _diff({"x": 1.0}, {"x": math.nan}, "a") != []
    # a message: its words exactly, its numbers to their last digit shown (a value on a rounding edge may round over)
    assert _diff(base, {**base, "why": "score 2.83 is above 2.489"}, "a") == []
    assert _diff(base, {**base, "why": "score 2.85 is above 2.489"}, "a") != []
    assert _diff(base, {**base, "why": "score 2.82 is below 2.489"}, "a") != []


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return golden.collect(tmp_path_factory.mktemp("golden"))


def _recorded_here() -> bool:
    return json.loads(golden.RECORDED_ON.read_text()) == golden.machine()


def test_every_answer_is_the_recorded_one(answers: dict[str, Any]):
    want = json.loads(golden.GOLDEN.read_text())
    assert set(answers) == set(want) == golden.keys()
    tol = golden.STRICT if _recorded_here() else golden.TOL
    diffs = [d for key in sorted(want) for d in _diff(want[key], answers[key], key, tol)]
    assert diffs == [], f"tolerance {tol} ({golden.machine()})\n" + "\n".join(diffs[:20])


def test_eager_and_torchscript_answer_alike_in_one_run(answers: dict[str, Any]):
    """The same kernels behind two backends: a change to the path of one of them shows at ``STRICT`` on any CPU."""
    pairs = [(k, k.replace("/torch/", "/torchscript/")) for k in answers if "/torch/" in k]
    pairs = [(a, b) for a, b in pairs if b in answers]
    assert len(pairs) == sum(len(sent["torchscript"]) for sent in golden.SENT.values())
    diffs = [d for a, b in pairs for d in _diff(answers[a], answers[b], f"{a} ~ {b}", golden.STRICT)]
    assert diffs == [], "\n".join(diffs[:20])


def test_the_tolerance_covers_the_measured_spread_with_a_margin():
    """``TOL`` is at least 5 times the largest fp32 move that ``golden_spread`` measured (another instruction set,
    ONNX Runtime without its fused kernels, against the run and the recording), and no decision moved there."""
    spread = json.loads((golden.GOLDEN.parent / "spread.json").read_text())
    assert spread["scale"] == golden.SCALE and 5 * spread["fp32_max_scaled"] <= golden.TOL
    fp32 = {n: v for n, v in spread["variants"].items() if v["precision"] == "fp32"}
    assert {"aten-default", "aten-avx2", "avx2-everywhere", "ort-unoptimised"} <= set(fp32)
    assert all(not v[k]["decisions_changed"] for v in fp32.values() for k in ("vs_native", "vs_recording"))
    assert spread["other_cpus"] and all(not v["decisions_changed"] for v in spread["other_cpus"].values())


def test_the_recording_covers_every_decision(answers: dict[str, Any]):
    """The recorded answers are worth holding to: accepted and not accepted answers, flagged and unflagged inputs,
    sets of one label and of several, every kind of reason, member predictions and every score, both routes, and in
    every backend accepted, abstained, flagged and unflagged answers. A cut of the requests that drops one of these
    kinds (``golden.DECISIONS``) fails here, in the recording and in this run's answers alike."""
    want = json.loads(golden.GOLDEN.read_text())
    assert golden.decisions(want) == golden.decisions(answers) == golden.DECISIONS
    for other in sorted((golden.GOLDEN.parent / "other-cpus").glob("*.json")):  # recorded elsewhere: the same requests
        assert set(json.loads(other.read_text())) == golden.keys(), other.name
    preds = [p for a in answers.values() if "predictions" in a["body"] for p in a["body"]["predictions"]]
    assert {p["selective"]["accept"] for p in preds} == {True, False}
    assert {p["ood"]["flag"] for p in preds} == {True, False}
    assert {len(p["conformal"]["set"]) > 1 for p in preds} == {True, False}
    v2 = [k for k, a in answers.items() if "outputs" in a["body"]]
    assert {k.split("/")[0] for k in v2} == set(golden.SENT) and all(a["status"] == 200 for a in answers.values())


def test_a_cut_that_drops_a_decision_is_seen():
    """:func:`golden.decisions` tells a recording without the drift alarm, a reason or a backend's abstention."""
    want = json.loads(golden.GOLDEN.read_text())
    assert golden.decisions(want) == golden.DECISIONS
    for drop in ("bert/torch/6", "vit/torch/2", "vit/onnx/1", "vit/torch/7"):
        assert golden.decisions({k: v for k, v in want.items() if k != drop}) != golden.DECISIONS, drop


def test_the_golden_file_is_in_the_repository():
    assert golden.GOLDEN.is_file() and golden.GOLDEN.relative_to(Path(__file__).resolve().parents[2])
    assert set(json.loads(golden.RECORDED_ON.read_text())) == set(golden.machine())
