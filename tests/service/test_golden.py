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

from tests.fixtures import golden, golden_batch


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


# The batch leg (tests/fixtures/golden_batch.py): the recorded /predict requests of the eager backend, their inputs
# scored by service.batch (hydra-predict's path, without HTTP) on the same tiny artifacts, options and settings; each
# row's answer is the recorded prediction. It covers vit/torch/{1,2,5} and bert/torch/{0..5}; it skips the Open
# Inference Protocol requests (vit/torch/6, vit/torch/7, bert/torch/6: not /predict's answer), and the recording holds
# no request with options a batch lacks (adaptive, labels, template; multipart). A batch does not feed the online
# drift alarm, which fired at input 12 of the server's text traffic (inside bert/torch/2): in the predictions recorded
# suspended (bert/torch/2 to 5) the alarm's fields (golden_batch.ALARM_FIELDS: the three `suspended`, `alarm_at`,
# `certified`, `accept`, `reason`) are held to what the batch gives without it: not suspended, no alarm_at, and the
# selective decision recorded unsuspended for the same input at the same risk (bert/torch/0's, for 3, 4 and 5); at
# risk 0.05 (bert/torch/2), asked of no unsuspended request, `accept`, `certified` and `reason` are not compared.
BATCH_KEYS = {f"vit/torch/{i}" for i in (1, 2, 5)} | {f"bert/torch/{i}" for i in range(6)}


@pytest.fixture(scope="module")
def batch_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return golden_batch.collect(tmp_path_factory.mktemp("golden-batch"))


def _batch_diff(batch: dict[str, list[dict[str, Any]]], tol: float) -> list[str]:
    """Where the batch answers differ from the recorded predictions (``golden_batch.expected``)."""
    want = json.loads(golden.GOLDEN.read_text())
    out = []
    for key in sorted(batch):
        expected = golden_batch.expected(want, key)
        if len(expected) != len(batch[key]):
            out.append(f"batch {key}: {len(expected)} predictions != {len(batch[key])} rows")
            continue
        for n, ((w, drop), got) in enumerate(zip(expected, batch[key], strict=True)):
            out += _diff(w, golden_batch.without(got, drop), f"batch {key}[{n}]", tol)
    return out


def test_the_batch_leg_sends_every_recorded_predict_request_it_can():
    eager = {k for k in golden.keys() if k.split("/")[1] == golden_batch.BACKEND}
    covered = {f"{f}/{golden_batch.BACKEND}/{i}" for f in golden.SENT for i, _ in golden_batch.requests(f)}
    skipped = golden_batch.skipped()
    assert covered == BATCH_KEYS and covered | set(skipped) == eager and not covered & set(skipped)
    assert set(skipped) == {"vit/torch/6", "vit/torch/7", "bert/torch/6"}
    assert all("not /predict" in why for why in skipped.values())
    # the leg holds both kinds of suspended prediction: with an unsuspended one to stand for it and without
    want = json.loads(golden.GOLDEN.read_text())
    drops = {k: {bool(d) for _, d in golden_batch.expected(want, k)} for k in covered}
    suspended = {k for k in covered for p in want[k]["body"]["predictions"] if p["selective"]["suspended"]}
    assert suspended == {f"bert/torch/{i}" for i in (2, 3, 4, 5)}
    assert drops["bert/torch/2"] == {True} and all(drops[k] == {False} for k in covered - {"bert/torch/2"})


def test_the_batch_path_gives_the_recorded_answers(batch_answers: dict[str, list[dict[str, Any]]]):
    """Every row's answer is the server's recorded prediction: the same decisions, numbers within the golden test's
    tolerance (``STRICT`` on the recording's machine, ``TOL`` elsewhere), ids and timings exempt."""
    assert set(batch_answers) == BATCH_KEYS
    tol = golden.STRICT if _recorded_here() else golden.TOL
    diffs = _batch_diff(batch_answers, tol)
    assert diffs == [], f"tolerance {tol} ({golden.machine()})\n" + "\n".join(diffs[:20])


def test_the_batch_leg_sees_a_moved_number_or_decision(batch_answers: dict[str, list[dict[str, Any]]]):
    """A row whose confidence moved by 1e-3, whose decision or set changed, or that says it is suspended fails."""
    import copy

    def moved(key: str, n: int, change: Any) -> list[str]:
        batch = copy.deepcopy(batch_answers)
        change(batch[key][n])
        return _batch_diff(batch, golden.TOL)

    def nudge(p: dict[str, Any]) -> None:
        p["confidence"] += 1e-3

    def flip(block: str, field: str) -> Any:
        return lambda p: p[block].update({field: not p[block][field]})

    (diff,) = moved("vit/torch/1", 0, nudge)  # the one number moved, and nothing else
    assert diff.startswith("batch vit/torch/1[0].confidence: "), diff
    assert moved("bert/torch/4", 0, flip("selective", "accept"))  # compared with bert/torch/0's unsuspended decision
    assert moved("bert/torch/2", 1, flip("ood", "flag")) and moved("bert/torch/2", 1, flip("selective", "suspended"))
    assert moved("bert/torch/3", 2, lambda p: p["conformal"]["set"].pop())
    assert moved("vit/torch/2", 3, lambda p: p["selective"].update(reason="another reason"))
    assert moved("vit/torch/5", 0, lambda p: p["ood"].update(score=p["ood"]["score"] * (1 + 1e-3)))
