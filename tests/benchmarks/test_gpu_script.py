"""``benchmarks/gpu.sh --dry-run``: the one-command GPU run prints its commands, and each of them is accepted by the
program it calls (its own argument parser; the build's config validation), so that the first GPU session does not
find a typo after the minutes it takes to start."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def commands() -> list[list[str]]:
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]


def _name(cmd: list[str]) -> str:
    """The program a command runs: the script (``python offline/build.py``) or the module (``python -m x``)."""
    if len(cmd) > 2 and cmd[1] == "-m":
        return cmd[2]
    return cmd[1] if len(cmd) > 1 else cmd[0]


def _programs(commands: list[list[str]], script: str) -> list[list[str]]:
    """The arguments of every command that runs ``script``."""
    return [c[3:] if c[1] == "-m" else c[2:] for c in commands if _name(c) == script]


def _program(commands: list[list[str]], script: str) -> list[str]:
    (args,) = _programs(commands, script)
    return args


def test_it_runs_the_cuda_tests_a_cuda_build_and_both_benchmarks(commands):
    programs = [_name(c) for c in commands]
    assert "pytest" in programs and any(c[1:4] == ["-m", "pytest", "-m"] and c[4] == "gpu" for c in commands)
    for script in ("offline/build.py", "benchmarks.run", "benchmarks.bench_server", "benchmarks.batch_scoring"):
        assert script in programs, script
    assert "gpu" in (ROOT / "pyproject.toml").read_text()  # the marker pytest -m gpu selects


def test_the_build_command_is_a_valid_cuda_build(commands):
    from offline.build import NOT_OVERRIDES, parse_args
    from offline.config import load_config, overrides_from_args

    args = parse_args(_program(commands, "offline/build.py"))
    over = overrides_from_args(args, skip=NOT_OVERRIDES)
    assert over["build.device"] == "cuda"
    cfg = load_config(ROOT / args.config, {**over, "build.device": "cpu"})  # this machine may have no GPU
    assert cfg.build.precision == "auto" and cfg.build.workers == 4


@pytest.mark.parametrize("script", ["benchmarks.run", "benchmarks.bench_server", "benchmarks.batch_scoring"])
def test_the_benchmark_commands_parse(commands, script, monkeypatch):
    """Each program's parser takes the arguments (``--help`` last: every argument before it is checked first)."""
    import importlib

    module = importlib.import_module(script)
    for args in _programs(commands, script):
        with pytest.raises(SystemExit) as done:
            module.main([*args, "--help"])
        assert done.value.code == 0


def test_the_server_benchmarks_drive_256_connections_on_both_artifacts(commands):
    """The issue's GPU rows: fashion-vit-fast and a ViT-B/16-sized artifact, at 256 connections and at 1."""
    from benchmarks.bench_server import parse_args

    runs = [parse_args(a) for a in _programs(commands, "benchmarks.bench_server")]
    assert {r.tiny for r in runs} == {None, "vit_b16"} and all(r.device == "cuda" for r in runs)
    assert all({1, 256} <= set(r.connections) for r in runs)
