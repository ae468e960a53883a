"""``hydra-predict --engine ray`` on a local Ray with 2 CPUs and 2 actors: the same parts, byte for byte, as the
in-process run; a job restarted after losing parts scores only those and ends equal to the uninterrupted run."""

from __future__ import annotations

import json
import os

import pytest

from service.batch.command import main
from tests.fixtures.tiny_artifact import make_tiny_artifact

pytest.importorskip("ray")  # the batch extra (make test installs it)

TEXTS = [f"order {i}: {'late' if i % 3 else 'broken'} and {'loud' if i % 2 else 'quiet'}" for i in range(45)]


def test_ray_writes_the_in_process_parts_and_resumes(tmp_path, monkeypatch, request):
    for k in [k for k in os.environ if k.startswith("HYDRA_")]:
        monkeypatch.delenv(k)
    for k, v in {"HYDRA_DEVICE": "cpu", "HYDRA_PRECISION": "fp32", "HYDRA_STORE": "off", "HYDRA_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    import ray

    env = {k: os.environ[k] for k in os.environ if k.startswith("HYDRA_")}
    ray.init(num_cpus=2, runtime_env={"env_vars": env}, log_to_driver=False, include_dashboard=False)
    request.addfinalizer(ray.shutdown)  # one local Ray of 2 CPUs for both runs, as a notebook's would be
    art = make_tiny_artifact(tmp_path / "bert", "bert", guarantees={})
    inp = tmp_path / "t.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = [str(inp), "--artifact", str(art), "--column", "text", "--part-size", "10", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    assert main([*common, "--out", str(tmp_path / "ray"), "--engine", "ray", "--actors", "2"]) == 0
    local, ray_parts = sorted((tmp_path / "local").glob("part-*")), sorted((tmp_path / "ray").glob("part-*"))
    assert [p.name for p in local] == [p.name for p in ray_parts] and len(local) == 5
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(local, ray_parts, strict=True))
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    local_summary = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert summary.pop("scored_now")["inputs"] == local_summary.pop("scored_now")["inputs"] == 45
    assert summary == local_summary
    for k in (1, 3):  # a job that lost two parts (killed before writing them): started again, it writes those
        (tmp_path / "ray" / f"part-{k:05d}.parquet").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in sorted((tmp_path / "ray").glob("part-*"))}
    assert main([*common, "--out", str(tmp_path / "ray"), "--engine", "ray", "--actors", "2"]) == 0
    after = sorted((tmp_path / "ray").glob("part-*"))
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(local, after, strict=True))
    assert all(p.stat().st_mtime_ns == before[p.name] for p in after if p.name in before)  # the others untouched
