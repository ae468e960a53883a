"""``hydra-predict`` (service/batch) on tiny artifacts: every input format gives the same rows in the input's order;
each row's answer is the server's ``/predict`` answer for the same input; a bad input is its own row's error; a run
killed between parts and started again finishes with the rows of an uninterrupted run; the batch's shift test
suspends the accepts as the drift alarm does under each policy; ``--select`` picks the top K; bad arguments fail in
one line. The shift test's null level and its agreement with SciPy are in test_batch_summary.py."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from service.batch.command import main
from service.entrypoints.app import create_app
from tests.fixtures.golden import close
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import b64, noise_images, png, settings_for

ROOT = Path(__file__).resolve().parents[3]
TEXTS = [f"ticket {i}: {'refund' if i % 3 else 'parcel'} please, {'fast' if i % 2 else 'now'}" for i in range(23)]
ENV = {"HYDRA_DEVICE": "cpu", "HYDRA_PRECISION": "fp32", "HYDRA_STORE": "off", "HYDRA_THREADS": "1"}


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch")
    return {
        "bert": make_tiny_artifact(root / "bert", "bert", guarantees={}),
        "vit": make_tiny_artifact(root / "vit", "vit", guarantees={}),
        "plain": make_tiny_artifact(root / "plain", "bert"),
        # a Mahalanobis score, which tells these images from the random calibration inputs; accepts at risk 0.5
        "maha": make_tiny_artifact(
            root / "maha", "vit", ood=True, ood_score="mahalanobis", guarantees={"risks": [0.05, 0.5], "risk": 0.5}
        ),
    }


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("HYDRA_")]:
        monkeypatch.delenv(k)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


def _tables(tmp: Path) -> dict[str, Path]:
    with (tmp / "t.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "text"])
        w.writerows([[f"k{i}", t] for i, t in enumerate(TEXTS)])
    (tmp / "t.jsonl").write_text("".join(json.dumps({"key": f"k{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(len(TEXTS))], "text": TEXTS}), tmp / "t.parquet")
    return {k: tmp / f"t.{k}" for k in ("csv", "jsonl", "parquet")}


def _rows(out: Path) -> list[dict]:
    parts = sorted(out.glob("part-*.parquet")) or sorted(out.glob("part-*.jsonl"))
    if parts and parts[0].suffix == ".jsonl":
        return [json.loads(line) for p in parts for line in p.read_text().splitlines()]
    return [r for p in parts for r in pq.read_table(p).to_pylist()]


def _run(art: Path, inp: Path, out: Path, *extra: str) -> int:
    return main([str(inp), "--artifact", str(art), "--out", str(out), "--no-progress", *extra])


def test_every_format_gives_the_same_rows_in_order_with_the_servers_answers(arts, tmp_path, capsys):
    tables = _tables(tmp_path)
    got = {}
    for kind, path in tables.items():
        fmt = "jsonl" if kind == "jsonl" else "parquet"
        args = ["--column", "text", "--id-column", "key", "--part-size", "5", "--batch-size", "4", "--format", fmt]
        assert _run(arts["plain"], path, tmp_path / kind, *args) == 0
        got[kind] = _rows(tmp_path / kind)
    assert [r["id"] for r in got["csv"]] == [f"k{i}" for i in range(len(TEXTS))]
    assert got["csv"] == got["parquet"] == got["jsonl"]
    assert len(list((tmp_path / "csv").glob("part-*.parquet"))) == 5  # 23 rows, 5 a part
    with TestClient(create_app(settings_for(arts["plain"]))) as c:
        served = c.post("/predict", json={"texts": TEXTS, "top_k": 5}).json()["predictions"]
    for row, want in zip(got["csv"], served, strict=True):
        answer = json.loads(row["answer"])
        assert answer["label"] == want["label"] == row["label"]
        assert [t["label"] for t in answer["top_k"]] == [t["label"] for t in want["top_k"]]
        assert answer["ood"]["flag"] == want["ood"]["flag"]
        for key in ("entropy", "mutual_information"):
            assert close(want["uncertainty"][key], answer["uncertainty"][key])
        assert close(want["confidence"], row["confidence"]) and close(want["ood"]["score"], row["ood_score"])
    summary = json.loads((tmp_path / "csv" / "summary.json").read_text())
    mean = sum(r["confidence"] for r in got["csv"]) / len(TEXTS)
    assert summary["rows"] == len(TEXTS) and abs(summary["estimated_accuracy"]["value"] - mean) < 1e-12
    assert "shift_test" not in summary  # no calibration split: no test, nothing suspended


def test_an_image_folder_in_path_order_and_a_bad_image_is_its_own_rows_error(arts, tmp_path):
    folder = tmp_path / "imgs"
    (folder / "b").mkdir(parents=True)
    for i, a in enumerate(noise_images(5, seed=4)):
        (folder / ("b" if i % 2 else "") / f"{i}.png").write_bytes(png(a))
    (folder / "broken.png").write_bytes(b"not a png")
    (folder / "notes.txt").write_text("not an image: left out")
    assert _run(arts["vit"], folder, tmp_path / "out", "--shift-alpha", "1e-300") == 0
    rows = _rows(tmp_path / "out")
    assert [r["id"] for r in rows] == ["0.png", "2.png", "4.png", "b/1.png", "b/3.png", "broken.png"]
    assert rows[-1]["error"].startswith("broken.png: ") and rows[-1]["label"] is None
    assert all(r["error"] is None and r["label"] for r in rows[:-1])
    with TestClient(create_app(settings_for(arts["vit"]))) as c:
        one = c.post("/predict", json={"images": [b64((folder / "b" / "1.png").read_bytes())]}).json()
    assert one["predictions"][0]["label"] == rows[3]["label"]
    assert close(one["predictions"][0]["ood"]["p_value"], rows[3]["ood_p_value"])


def test_a_killed_run_resumes_to_the_rows_of_an_uninterrupted_one(arts, tmp_path):
    texts = [f"{t} {i}" for i in range(12) for t in TEXTS]  # 276 inputs
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = ["--column", "text", "--part-size", "20", "--batch-size", "4"]
    assert _run(arts["bert"], tmp_path / "big.jsonl", tmp_path / "whole", *args) == 0
    cmd = [sys.executable, "-m", "service.batch", str(tmp_path / "big.jsonl"), "--artifact", str(arts["bert"])]
    cmd += ["--out", str(tmp_path / "killed"), "--no-progress", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "killed").glob("part-00002.*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(list((tmp_path / "killed").glob("part-*.parquet")))
    assert 3 <= written < 14, written  # killed mid-run
    assert _run(arts["bert"], tmp_path / "big.jsonl", tmp_path / "killed", *args) == 0
    assert _rows(tmp_path / "killed") == _rows(tmp_path / "whole")  # none lost, none twice, the same numbers
    killed, whole = sorted((tmp_path / "killed").glob("part-*")), sorted((tmp_path / "whole").glob("part-*"))
    for a, b in zip(killed, whole, strict=True):
        assert a.read_bytes() == b.read_bytes()
    assert not list((tmp_path / "killed").glob(".*.tmp"))


@pytest.mark.parametrize("policy", ["abstain", "mark", "off"])
def test_a_rejected_shift_test_suspends_as_the_drift_alarm_does(arts, tmp_path, monkeypatch, policy):
    monkeypatch.setenv("HYDRA_DRIFT_POLICY", policy)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, a in enumerate(noise_images(30, seed=9)):  # like the calibration inputs to this model: some accepted
        (folder / f"n{i:02d}.png").write_bytes(png(a))
    for i in range(30):  # two flat halves: foreign to it
        a = np.full((16, 16), (i * 8) % 256, dtype=np.uint8)
        a[:, :8] = 255 - a[:, :8]
        (folder / f"b{i:02d}.png").write_bytes(png(a))
    assert _run(arts["maha"], folder, tmp_path / "before", "--shift-alpha", "1e-300") == 0  # cannot reject
    assert _run(arts["maha"], folder, tmp_path / "out") == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    test = summary["shift_test"]
    assert test["rejected"] and test["p_value"] <= 0.01 and test["auc"] > 0.7 and (test["n"], test["m"]) == (60, 300)
    assert summary["suspended"] is (policy != "off")
    before, after = _rows(tmp_path / "before"), _rows(tmp_path / "out")
    assert sum(r["accept"] for r in before) >= 10 and not any(r["suspended"] for r in before)
    for b, a in zip(before, after, strict=True):
        sel = json.loads(a["answer"])["selective"]
        assert a["suspended"] is sel["suspended"] is (policy != "off")
        if policy == "abstain":
            assert a["accept"] is sel["accept"] is False and "shift test rejected it" in a["reason"]
        else:
            assert a["accept"] == b["accept"]
        if policy == "mark":
            assert a["reason"].startswith("the batch's shift test rejected it") and not sel["certified"]
        if policy == "off":
            assert a == b


def test_select_writes_the_top_k_by_each_criterion(arts, tmp_path):
    tables = _tables(tmp_path)
    for by in ("mutual_information", "margin", "entropy", "ood"):
        out = tmp_path / by
        args = ["--column", "text", "--select", "4", "--by", by]
        assert _run(arts["bert"], tables["csv"], out, *args) == 0
        rows = _rows(out)
        with (out / "to_label.csv").open() as f:
            picked = list(csv.DictReader(f))
        key = {
            "mutual_information": lambda r: r["mutual_information"],
            "entropy": lambda r: r["entropy"],
            "margin": lambda r: -r["margin"],
            "ood": lambda r: -r["ood_p_value"],
        }[by]
        ranked = sorted(range(len(rows)), key=lambda i: (-key(rows[i]), i))[:4]
        assert [int(p["position"]) for p in picked] == ranked and all(p["label"] == "" for p in picked)
        assert json.loads((out / "summary.json").read_text())["selected"] == {"k": 4, "by": by, "file": "to_label.csv"}


def test_bad_arguments_and_inputs_fail_in_one_line(arts, tmp_path, capsys):
    tables = _tables(tmp_path)
    cases = [
        ([str(tables["csv"]), "--column", "body"], "no column 'body'"),
        ([str(tables["csv"])], "name the column to read with --column"),
        ([str(tmp_path / "nope.csv"), "--column", "text"], "no such file or folder"),
        ([str(tmp_path), "--column", "text"], "a folder is read as images, but the model takes text"),
    ]
    for argv, fragment in cases:
        code = main([*argv, "--artifact", str(arts["bert"]), "--out", str(tmp_path / "o"), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and fragment in err[-1] and err[-1].startswith("hydra-predict: "), (argv, err)
    assert _run(arts["bert"], tables["csv"], tmp_path / "o2", "--column", "text") == 0
    assert _run(arts["bert"], tables["csv"], tmp_path / "o2", "--column", "text", "--top-k", "3") == 2
    assert "holds the output of another run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tables["csv"]), "--artifact", str(arts["bert"]), "--out", "o", "--part-size", "0"])
    assert "--part-size must be >= 1" in capsys.readouterr().err
