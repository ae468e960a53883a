"""``offline/build.py --stage base|score|member|finish``: a build split over processes (pods, GPUs) that share
its ``--out`` folder gives the artifact a one-process build gives, and a stage run out of order says so in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offline.build import main
from service.core.artifact import load_manifest

from .conftest import ticket_build


def _flags(ckpt: Path, data: Path) -> list[str]:
    recipe = {"strategy": "taylor", "finetune_steps": 4, "member_data": "bootstrap", "reinit_head": True}
    over = ticket_build(ckpt, data, **{f"hydra.{k}": v for k, v in recipe.items()})
    return [f for k, v in over.items() for f in (f"--{k}", json.dumps(v) if not isinstance(v, str) else v)]


def _run(config: Path, out: Path, flags: list[str], *extra: str) -> int:
    return main(["--config", str(config), "--out", str(out), "--no-progress", *flags, *extra])


def test_stages_build_the_artifact_one_process_builds(user_files, tmp_path, capsys):
    ckpt, data = user_files
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    flags = _flags(ckpt, data)
    assert _run(config, tmp_path / "one", flags) == 0

    staged = tmp_path / "staged"
    assert _run(config, staged, flags, "--stage", "finish") == 2  # nothing scored yet
    assert "run --stage base, then --stage score" in capsys.readouterr().err
    assert _run(config, staged, flags, "--stage", "base") == 0
    assert _run(config, staged, flags, "--stage", "score") == 0
    assert _run(config, staged, flags, "--stage", "member", "--member", "3") == 2
    assert "0 <= K < hydra.members=3" in capsys.readouterr().err
    for k in (2, 0):  # members in any order, each in its own process
        assert _run(config, staged, flags, "--stage", "member", "--member", str(k)) == 0
    assert _run(config, staged, flags, "--stage", "finish") == 2  # member 1 missing
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "config error: --stage finish: member 1 is at step 0 of 4 (run --stage member --member 1 first)"
    assert _run(config, staged, flags, "--stage", "member", "--member", "1") == 0
    assert _run(config, staged, flags, "--stage", "finish") == 0

    one, two = load_manifest(tmp_path / "one"), load_manifest(staged)
    assert two.files["model.safetensors"] == one.files["model.safetensors"]  # the same weights, bit for bit
    assert two.heads == one.heads and two.uncertainty == one.uncertainty
    times = two.build["timings_s"]
    assert any(k.startswith("stage member1: ") for k in times) and "calibration" in times
    assert not (staged / ".checkpoints").exists()  # the shared state goes once the artifact is written


def test_stage_flags_are_checked(user_files, tmp_path, capsys):
    ckpt, data = user_files
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    assert _run(config, tmp_path / "a", _flags(ckpt, data), "--member", "0") == 2
    assert "--member K goes with --stage member" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run(config, tmp_path / "a", _flags(ckpt, data), "--stage", "train")
