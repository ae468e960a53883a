"""Labels back from a batch (docs/batch.md, "Labels back"): ``--record`` stores every answer as the server stores
its answers; ``--select`` writes their ids; ``hydra-predict feedback`` sends the filled labels to the store, where a
server on the same store counts them in ``/monitor``, and a second send finds them duplicates."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.batch.command import main
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS, make_tiny_artifact
from tests.service.helpers import settings_for

TEXTS = [f"parcel {i} came {'late' if i % 2 else 'broken'}" for i in range(17)]


def test_labels_chosen_by_select_reach_the_store_as_feedback_does(tmp_path, monkeypatch, capsys):
    for k in [k for k in os.environ if k.startswith("HYDRA_")]:
        monkeypatch.delenv(k)
    env = {"HYDRA_DEVICE": "cpu", "HYDRA_PRECISION": "fp32", "HYDRA_STORE": "true", "HYDRA_STATE_DIR": str(tmp_path)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    art = make_tiny_artifact(tmp_path / "bert", "bert", guarantees={})
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    argv = [str(tmp_path / "t.jsonl"), "--artifact", str(art), "--out", str(tmp_path / "out"), "--column", "text"]
    assert main([*argv, "--select", "3", "--record", "--part-size", "5", "--no-progress"]) == 0
    capsys.readouterr()
    with (tmp_path / "out" / "to_label.csv").open() as f:
        rows = list(csv.DictReader(f))
    run = rows[0]["answer_id"].rsplit(":", 1)[0]
    assert [r["answer_id"] for r in rows] == [f"{run}:{r['position']}" for r in rows] and run.startswith("batch-")
    for r, label in zip(rows, [TINY_LABELS[0], TINY_LABELS[1], ""], strict=True):  # the last one left unlabelled
        r["label"] = label
    with (tmp_path / "labelled.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main(["feedback", str(tmp_path / "labelled.csv"), "--artifact", str(art)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "labels": 2,
        "accepted": 2,
        "duplicate": 0,
        "unknown_id": 0,
        "invalid_label": 0,
    }
    assert main(["feedback", str(tmp_path / "labelled.csv"), "--artifact", str(art)]) == 0
    assert json.loads(capsys.readouterr().out)["duplicate"] == 2
    with TestClient(create_app(settings_for(art, store=True, state_dir=str(tmp_path)))) as c:
        mon = c.get("/v1/models/tiny-bert/monitor").json()
    assert mon["labelled"] == 2


def test_feedback_of_a_run_not_recorded_fails_in_one_line(tmp_path, capsys):
    art = make_tiny_artifact(tmp_path / "bert", "bert")
    (tmp_path / "f.csv").write_text("position,id,predicted,mutual_information,label\n0,r0,cat,0.1,dog\n")
    assert main(["feedback", str(tmp_path / "f.csv"), "--artifact", str(art)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # its one line (other tests' log handlers aside)
    assert err.startswith("hydra-predict feedback: ") and "run it with --record" in err


@pytest.mark.parametrize("store", ["false"])
def test_record_needs_the_store(tmp_path, monkeypatch, capsys, store):
    monkeypatch.setenv("HYDRA_STORE", store)
    monkeypatch.setenv("HYDRA_DEVICE", "cpu")
    art = make_tiny_artifact(tmp_path / "bert", "bert")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    argv = [str(tmp_path / "t.jsonl"), "--artifact", str(art), "--out", str(tmp_path / "o"), "--column", "text"]
    assert main([*argv, "--record", "--no-progress"]) == 2
    assert "--record needs the prediction store: HYDRA_STORE is off" in capsys.readouterr().err


_ = Path
