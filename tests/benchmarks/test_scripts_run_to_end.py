"""The benchmark scripts that README.md and docs/ cite, each run to its end at its shortest settings on tiny artifacts:
its exit status, and the result files it writes holding what its docstring promises. A script that measures and
then crashes while writing its result passes every test of its parts; only a run to the end catches it.

Run to their end elsewhere: ``benchmarks/load_test.py`` (tests/reliability/test_scripts.py),
``benchmarks/store_cost.py`` and ``benchmarks/soak.py`` (test_store_scripts.py), ``benchmarks/frontier.py``
(test_frontier.py), ``benchmarks/truth.py`` on the default artifacts (test_truth_benchmark.py, where they are built).
``benchmarks/gpu.sh`` needs CUDA: test_gpu_script.py checks its commands (``--dry-run``).

The scripts whose exit status says whether the issue's targets were met on real models (``truth``, ``stream``,
``nine_inputs``) exit 1 on a random model: for them the status must be the one their own checks give.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from benchmarks import (
    bench_server,
    calibration_draw,
    drift_cost,
    guarantee_cost,
    harness,
    nine_inputs,
    recipe,
    shift_views,
    stream,
    truth,
    user_build,
)
from offline.config import load_config
from offline.data import FASHION_CLASSES, FASHION_ID_CLASSES
from offline.method.corruptions import corruptions
from tests.fixtures.fashion import needs_fashion
from tests.fixtures.tiny_artifact import make_tiny_artifact, make_tiny_clip_artifact
from tests.offline.conftest import ticket_config, write_user_files

ROOT = Path(__file__).resolve().parents[2]
GARMENTS = [FASHION_CLASSES[c] for c in FASHION_ID_CLASSES]
CALIBRATION = 200  # the tiny image artifact's recorded calibration split
# the data section its build record names: image-fast's setting (Fashion-MNIST), small splits
SMALL_DATA = {
    "data.max_train": 60,
    "data.max_val": 60,
    "data.max_test": 60,
    "data.max_ood": 20,
    "data.max_calibration": CALIBRATION,
}


def _status_follows_checks(status: int, checks: dict[str, bool]) -> None:
    assert checks and all(isinstance(v, bool) for v in checks.values())
    assert status == (0 if all(checks.values()) else 1)


@pytest.fixture(scope="module")
def fashion(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random image classifier of the six garments (the default image model's labels, its served score
    ``mahalanobis_layers`` and guarantees) whose manifest records an image-fast build config with small splits, as a
    build's does (the scripts redraw its splits from it), beside a report with no figures; and a tiny zero-shot
    model of the same labels, built without a calibration split (its answers carry no p-value)."""
    root = tmp_path_factory.mktemp("fashion")
    image = make_tiny_artifact(
        root / "image",
        "vit",
        name="tiny-fashion",
        labels=GARMENTS,
        ood=True,
        ood_score="mahalanobis_layers",
        ood_threshold=None,
        guarantees={"risks": [0.05, 0.5], "risk": 0.5},
    )
    manifest = json.loads((image / "manifest.json").read_text())
    cfg = load_config(ROOT / "offline" / "configs" / "image-fast.yaml", {"name": "tiny-fashion", **SMALL_DATA})
    manifest["build"] = {"config": cfg.to_dict()}
    (image / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (image / "report.json").write_text(json.dumps({"rows": [], "extra": {}}) + "\n")
    zeroshot = make_tiny_clip_artifact(root / "zeroshot", name="tiny-zeroshot", labels=GARMENTS)
    return {"image": image, "zeroshot": zeroshot}


# ----------------------------------------------------------------------------- the server against wrk
def _bench_server_runs() -> list:
    """The Makefile's two ``bench-server`` commands at their shortest: one connection level, 1 s of wrk, one batch."""
    cpus = sorted(os.sched_getaffinity(0))
    one_core = [
        *("--server-cpus", str(cpus[0]), "--wrk-cpus", str(cpus[-1]), "--wrk-threads", "1", "--threads", "1"),
        *("--precision", "fp32", "--tag", "one-core", "--connections", "1", "--max-batch", "1"),
    ]
    workers = [
        *("--workers", "1", "2", "--no-floor", "--precision", "fp32", "--tag", "workers"),
        *("--connections", "2", "--max-batch", "2"),
    ]
    return [
        pytest.param(one_core, {"workers=1", "floor"}, id="one-core"),
        pytest.param(workers, {"workers=1", "workers=2"}, id="workers"),
    ]


@pytest.mark.skipif(shutil.which("wrk") is None, reason="Debian's wrk is not installed (make wrk)")
@pytest.mark.parametrize(("flags", "servers"), _bench_server_runs())
def test_bench_server(tmp_path: Path, flags: list[str], servers: set[str]):
    argv = ["--tiny", "vit", *flags, "--seconds", "1", "--raw-seconds", "0.2", "--out", str(tmp_path)]
    assert bench_server.main(argv) == 0
    tag = flags[flags.index("--tag") + 1]
    doc = json.loads((tmp_path / f"tiny-vit-{tag}.json").read_text())
    assert doc["command"] == "python -m benchmarks.bench_server " + shlex.join(argv)
    assert doc["name"] == "tiny-vit" and doc["artifact"] == "tiny vit (random weights)"
    assert doc["precision"] == "fp32" and doc["machine"]["cpu"]
    assert set(doc["servers"]) == servers
    level = int(flags[flags.index("--connections") + 1])
    for name, rows in doc["servers"].items():
        (row,) = rows
        assert row["connections"] == level and row["requests"] > 0 and row["rps"] > 0 and row["non_2xx"] == 0
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] and row["cpu_ms_per_request"] > 0
        assert (row["mean_batch"] is None) == (name == "floor")
    assert set(doc["raw"]) == {"1", str(level)} and len(doc["raw_runs"]) == 2  # before and after the servers
    ratios = doc["ratios"]
    assert ratios["raw_best_ips"] == max(r["throughput_ips"] for r in doc["raw"].values())
    assert ratios["workers=1"][f"server_over_raw_at_{level}"] > 0
    if "floor" in servers:
        assert ratios["workers=1"][f"server_over_floor_at_{level}"] > 0
        assert doc["settings"]["server_cpus"] is not None and doc["settings"]["wrk_cpus"] is not None
    else:
        assert ratios["workers=2"][f"over_workers=1_at_{level}"] > 0
    md = (tmp_path / f"tiny-vit-{tag}.md").read_text()
    assert md.startswith("# Server against the raw model and the floor: tiny-vit")
    assert all(f"| {name} | {level} |" in md for name in servers)


# ----------------------------------------------------------------------------- in one process
def test_guarantee_cost(tmp_path: Path):
    artifact = harness.tiny_artifact(tmp_path, "vit", full=True)  # with guarantees
    out = tmp_path / "guarantee_cost.json"
    assert guarantee_cost.main(["--artifact", str(artifact), "--repeats", "2", "--block", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["name"] == "tiny-vit" and doc["batch"] == 1 and doc["backend"] and doc["precision"]
    reps = doc["repetitions"]
    assert len(reps["with_ms"]) == len(reps["without_ms"]) == 2
    assert doc["with_ms"]["min"] == min(reps["with_ms"]) and doc["without_ms"]["min"] == min(reps["without_ms"])
    assert doc["ratio_min_over_min"] == pytest.approx(min(reps["with_ms"]) / min(reps["without_ms"]), rel=1e-3)
    assert doc["guarantees_step_ms"] > 0 and 0 < doc["guarantees_step_in_path_share"] < 1


def test_drift_cost(tmp_path: Path):
    out = tmp_path / "drift_cost.json"
    assert drift_cost.main(["--repeats", "2", "--block", "20", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["chunk"] for r in doc["rows"]] == list(drift_cost.CHUNKS) and doc["machine"]["cpu"]
    for r in doc["rows"]:
        extra = r["shared_us_per_update"]["median"] - r["local_us_per_update"]["median"]
        # the script rounds the difference of the unrounded medians; this one, of the rounded ones
        assert r["shared_extra_us_per_answer"] == pytest.approx(extra / r["chunk"], abs=0.02)


@needs_fashion
def test_shift_views(fashion: dict[str, Path], tmp_path: Path):
    out = tmp_path / "shift_views.json"
    assert shift_views.main(["--artifact", str(fashion["image"]), "--inputs", "8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["artifact"] == "tiny-fashion" and doc["inputs"] == 8
    assert doc["views"] == ["served (mahalanobis_layers)", "last feature", "block 0", "MSP"]
    streams = [f"{kind} @{severity}" for kind in corruptions("image") for severity in shift_views.SEVERITIES]
    assert [r["stream"] for r in doc["rows"]] == ["ID validation", "mild-shift validation", "clean", *streams]
    for r in doc["rows"]:
        assert len(r["flagged"]) == len(doc["views"]) and all(0 <= f <= 1 for f in r["flagged"])
    md = out.with_suffix(".md").read_text()
    assert all(f"| {r['stream']} |" in md for r in doc["rows"])


@needs_fashion
def test_calibration_draw(fashion: dict[str, Path], tmp_path: Path):
    out = tmp_path / "calibration_draw.json"
    assert calibration_draw.main(["--artifact", str(fashion["image"]), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cal, unused = doc["sets"]["calibration"], doc["sets"]["unused"]
    assert doc["build"] == "tiny-fashion" and cal["n"] == CALIBRATION and unused["n"] > CALIBRATION
    assert set(cal["per_class"]) == set(unused["per_class"]) == set(GARMENTS)
    # the pretrained backbone scores real garments: far above chance (1/6) on both draws
    assert cal["accuracy"] > 0.6 and unused["accuracy"] > 0.6
    assert doc["gap"] == pytest.approx(cal["accuracy"] - unused["accuracy"]) and math.isfinite(doc["z"])


# ----------------------------------------------------------------------------- through a running server
@needs_fashion
def test_stream(fashion: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # the replica simulation has no flag of its own: its shortest run (2 replicas, 4 runs) instead of a minute's
    monkeypatch.setattr(stream, "replica_simulation", functools.partial(stream.replica_simulation, (2,), 4))
    with pytest.raises(SystemExit, match="without a calibration split"):  # this tiny zero-shot model has none
        stream.main(["--zeroshot", str(fashion["zeroshot"]), "--out", str(tmp_path / "zs")])
    argv = ["--image", str(fashion["image"]), "--inputs", "6", "--severities", "5", "--only", "noise", "--prefix", "3"]
    argv += ["--clean-streams", "1", "--clean-inputs", "6", "--labelled", "6", "--cached-streams", "2"]
    status = stream.main([*argv, "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "stream.json").read_text())
    _status_follows_checks(status, doc["checks"])
    assert doc["models"]["image"]["name"] == "tiny-fashion" and doc["models"]["image"]["risk"] == 0.5
    assert [(r["modality"], r["corruption"], r["severity"], r["inputs"]) for r in doc["shifted"]] == [
        ("image", "noise", 5, 6)
    ]
    row = doc["shifted"][0]  # 3 clean inputs, then the shift: counted from it, the prefix only for the recall
    assert row["prefix"] == 3 and row["suspended_before_shift"] == 0 and "lorden_bound" in row
    assert row["recalled"] >= 0 and row["wrong_accepts_recalled"] <= row["wrong_accepts_before_alarm"]
    assert [(r["modality"], r["corruption"], r["inputs"]) for r in doc["clean"]] == [("image", None, 6)]
    (labelled,) = doc["labelled"]
    assert (labelled["corruption"], labelled["severity"], labelled["inputs"]) == (*stream.LABELLED["image"], 6)
    assert "online_risk_at_end" in labelled
    assert all(c["streams"] == 2 for c in doc["cached_false_suspensions"].values())
    assert {r["replicas"] for rows in doc["replicas"].values() for r in rows} == {2}
    md = (tmp_path / "stream.md").read_text()
    assert "| noise @5 |" in md and "## Checks" in md
    assert (tmp_path / "plots" / "stream.png").stat().st_size > 0


@needs_fashion
def test_truth(fashion: dict[str, Path], tmp_path: Path):
    out = tmp_path / "truth.json"
    argv = ["--image", str(fashion["image"]), "--zeroshot", str(fashion["zeroshot"]), "--per-class", "2"]
    status = truth.main([*argv, "--out", str(out)])
    doc = json.loads(out.read_text())
    _status_follows_checks(status, doc["checks"])
    c = doc["classifier"]
    assert c["id_images"] == 12 and c["near_images"] == 8  # 2 of each of the test file's 10 classes
    assert {g: v["n"] for g, v in c["per_class"].items()} == dict.fromkeys(GARMENTS, 2)
    assert doc["classifier_calibration_split"]["id_images"] == CALIBRATION
    assert doc["classifier_exchangeable"]["id_images"] > CALIBRATION
    assert doc["zero_shot"]["user_words"]["labels"] == [truth.USER_WORDS[g] for g in GARMENTS]
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# Real test images by their true names (tiny-fashion, tiny-zeroshot)")
    assert all(f"{'PASS' if v else 'FAIL'} {k}" in md for k, v in doc["checks"].items())


def test_nine_inputs(fashion: dict[str, Path], tmp_path: Path):
    """The zero-shot model answers without a p-value (no calibration split): the page shows none."""
    out = tmp_path / "nine_inputs.json"
    status = nine_inputs.main(
        ["--image", str(fashion["image"]), "--zeroshot", str(fashion["zeroshot"]), "--out", str(out)]
    )
    doc = json.loads(out.read_text())
    assert status == (0 if all(v == 9 for v in doc["flagged_of_9"].values()) else 1)
    assert len(doc["inputs"]) == 9 and doc["models"] == {"image": "tiny-fashion", "zeroshot": "tiny-zeroshot"}
    assert all(r["predict"]["p_value"] is not None and r["zero_shot"]["p_value"] is None for r in doc["inputs"])
    lines = out.with_suffix(".md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| input ")]
    assert [r.split(" | ")[0][2:] for r in rows] == [r["input"] for r in doc["inputs"]]
    assert all(re.search(r"\| \d\.\d{4} \| .* \| – \|", r) for r in rows)


# ----------------------------------------------------------------------------- through real builds
def test_recipe_over_two_seeds(tmp_path: Path):
    """One variant of a tiny text build at two seeds: the table, and the one over seeds with Hydra's verdicts."""
    ckpt, tickets = write_user_files(tmp_path / "user")
    config = tmp_path / "tickets.yaml"
    config.write_text(yaml.safe_dump(ticket_config(ckpt, tickets).to_dict()))
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--config", str(config), "--out", str(out), "--variants", "shipped", "--seeds", "0", "1"]
    assert recipe.main([*argv, "--work", str(work), "--cache", str(tmp_path / "bases")]) == 0
    doc = json.loads((out / "recipe.json").read_text())
    assert doc["seeds"] == [0, 1] and doc["machine"]
    assert [(r["recipe"], r["seed"], r["variant"]) for r in doc["rows"]] == [
        ("shipped", 0, "shipped"),
        ("shipped", 1, "shipped@seed1"),
    ]
    for r in doc["rows"]:  # each row's figures are its build's own
        report = json.loads((work / "tickets" / r["variant"] / "report.json").read_text())
        hydra = next(row for row in report["rows"] if row["method"] == "hydra")
        assert r["acc"] == hydra["acc"]
    md = (out / "recipe.md").read_text()
    assert "Over seeds (mean ± std):" in md and "**shipped** (seeds 0, 1)" in md
    assert re.search(r"\| accuracy % \| .* \| (win|tie|loss) \|", md)


@pytest.mark.slow
def test_user_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The user's ViT-Tiny at 224 px takes minutes to build on 2 cores even at a step or two (slow): the script's own
    build with its steps and folder cut to the fewest."""
    full = user_build.config

    def fewest(folder: Path, ckpt: Path, precision: str) -> dict:
        cfg = full(folder, ckpt, precision)
        cfg["base"]["steps"] = 1
        cfg["data"].update(max_train=24, max_val=12, max_test=12)
        cfg["hydra"].update(calib_samples=4, finetune_steps=1)
        return cfg

    monkeypatch.setattr(user_build, "config", fewest)
    monkeypatch.setattr(user_build, "IMAGES_PER_CLASS", 16)
    assert user_build.main(["--out", str(tmp_path), "--precision", "fp32"]) == 0
    run = json.loads((tmp_path / "user_build.json").read_text())["fp32"]
    assert run["resolved_precision"] == "fp32" and run["machine"]["cores"] == os.cpu_count()
    assert run["wall_s"] > 0 and {"base model", "member fine-tuning", "export"} <= set(run["stages_s"])
    assert re.fullmatch(r"[0-9a-f]{64}", run["model_sha256"]) and 0 <= run["test_accuracy"] <= 1
