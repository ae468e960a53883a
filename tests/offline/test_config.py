"""Config parsing, flag overrides and the one-line errors that stop a build before heavy work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offline.config import ConfigError, check_budget, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "offline" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.hydra.members >= 1


def test_fast_configs_exist_for_each_modality():
    names = [p.name for p in CONFIGS]
    for modality in ("text", "image"):
        assert any("fast" in n and modality in n for n in names), names


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_win_over_file(tmp_path):
    p = _write(tmp_path, "family: bert\ndata: {setting: tweets}\nhydra: {members: 3, prune_per_layer: 6}\n")
    cfg = load_config(p, {"hydra.members": 5, "hydra.seeds": [1, 2, 3, 4, 5], "name": "x"})
    assert cfg.hydra.members == 5 and cfg.name == "x" and cfg.hydra.seeds == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "text, overrides, match",
    [
        ("family: bert\nhydra: {colour: red}\n", {}, "unknown key 'hydra.colour'"),
        ("family: bert\nbogus: 1\n", {}, "unknown key 'bogus'"),
        ("family: bert\ndata: {setting: tweets}\nhydra: {members: 0, prune_per_layer: 6}\n", {}, "members must be"),
        (
            "family: vit\ndata: {setting: image-folder, path: /no/such/dir}\nhydra: {prune_per_layer: 1}\n",
            {},
            "data.path /no/such/dir does not exist",
        ),
        ("family: bert\ndata: {setting: tweets}\nhydra: {prune_per_layer: 6, prune_total: 3}\n", {}, "exactly one"),
        ("family: bert\ndata: {setting: tweets}\nhydra: {prune_per_layer: 6, strategy: magic}\n", {}, "strategy"),
        ("family: bert\ndata: {setting: fashion-mnist}\nhydra: {prune_per_layer: 6}\n", {}, "needs text data"),
        ("family: bert\ndata: {setting: tweets}\nhydra: {prune_per_layer: 6}\n", {"hydra.seeds": [0]}, "seeds"),
        ("family: bert\ndata: {setting: tweets, max_fit: -1}\nhydra: {prune_per_layer: 6}\n", {}, "max_fit must be"),
        (
            "family: bert\ndata: {setting: tweets}\nhydra: {prune_per_layer: 6}\n",
            {"guarantees.set_delta": 1.5},
            r"guarantees.set_delta must be in \(0, 1\) or null, got 1.5",
        ),
    ],
)
def test_invalid_configs_fail_with_one_clear_line(tmp_path, text, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text), overrides)


def test_budget_larger_than_model_is_refused():
    no_trunk = {"hydra.shared_blocks": 0}
    cfg = load_config(ROOT / "offline/configs/text-fast.yaml", {**no_trunk, "hydra.prune_per_layer": 13})
    with pytest.raises(ConfigError, match="exceeds the 12 heads of layer 0"):
        check_budget(cfg, [12] * 6)
    total = {"hydra.prune_per_layer": None, "hydra.prune_total": 80}
    cfg = load_config(ROOT / "offline/configs/text-fast.yaml", {**no_trunk, **total})
    with pytest.raises(ConfigError, match="exceeds the model's 72 heads"):
        check_budget(cfg, [12] * 6)
    cfg = load_config(ROOT / "offline/configs/text-fast.yaml", {**total, "hydra.prune_total": 30})  # as shipped: k = 4
    with pytest.raises(ConfigError, match="the 24 heads after the shared trunk"):
        check_budget(cfg, [12] * 6)


def test_cli_help_lists_every_option_and_errors_are_one_line(tmp_path):
    env_py = sys.executable
    out = subprocess.run([env_py, "offline/build.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True)
    for flag in ("--hydra.members", "--hydra.strategy", "--data.max_train", "--export.onnx", "--calibration.tpr"):
        assert flag in out.stdout
    bad = _write(tmp_path, "family: bert\nhydra: {colour: red}\n")
    res = subprocess.run(
        [env_py, "offline/build.py", "--config", str(bad), "--out", str(tmp_path / "a")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "unknown key 'hydra.colour'" in res.stderr
    cmd = [
        env_py,
        "offline/build.py",
        "--config",
        "offline/configs/text-fast.yaml",
        "--out",
        str(tmp_path / "b"),
        "--hydra.prune_per_layer",
        "20",
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "exceeds the 12 heads" in res.stderr


def test_base_cache_dir_is_shared_by_builds_that_differ_only_in_hydra_settings(tmp_path):
    from offline.pipelines.classifier_build import base_checkpoint_dir

    root = Path(__file__).resolve().parents[2] / "offline" / "configs"
    over = {"base.cache_dir": str(tmp_path / "bases")}
    taylor = load_config(root / "text-full-taylor.yaml", over)
    circuit = load_config(root / "text-full-circuit.yaml", over)
    assert taylor.hydra.strategy != circuit.hydra.strategy
    shared = base_checkpoint_dir(taylor, tmp_path / "a")
    assert shared == base_checkpoint_dir(circuit, tmp_path / "b")  # one base for both builds
    assert shared.parent == tmp_path / "bases"
    fewer = load_config(root / "text-full-taylor.yaml", {**over, "data.max_train": 100})
    assert base_checkpoint_dir(fewer, tmp_path / "a") != shared  # other data: another base
    plain = load_config(root / "text-fast.yaml")  # no cache_dir: the artifact's own resumable checkpoints
    assert plain.base.cache_dir is None
    assert base_checkpoint_dir(plain, tmp_path / "a") == tmp_path / "a" / ".checkpoints" / "base"


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("calibration.tpr", "high", "calibration.tpr: 'high' is not a valid float"),
        ("data.max_train", "lots", "data.max_train: 'lots' is not a valid int"),
        ("base.preset", "vit_huge", "base.preset 'vit_huge' is not a preset"),
        ("hydra.pool", "-3", "hydra.pool must be > 0"),
        ("hydra.seeds", "[0, 0, 0]", "hydra.seeds must differ"),
        ("hydra.members", "true", "hydra.members: True is not a valid int"),
        ("export.tolerance", "x", "export.tolerance: 'x' is not a valid float"),
        ("hydra.member_data", "shuffle", "hydra.member_data must be one of"),
        ("hydra.distill", "1.5", "hydra.distill must be in [0, 1]"),
        ("hydra.distill_temperature", "0", "distillation temperatures must be > 0"),
        ("hydra.distill_temperatures", "[1, 2]", "hydra.distill_temperatures lists 2 temperatures for 3 members"),
        ("hydra.finetune_blocks", "-2", "hydra.finetune_blocks must be an integer >= 0"),
        ("build.precision", "half", "build.precision must be one of"),
        ("build.device", "tpu", "build.device must be one of"),
        ("build.workers", "-1", "build.workers must be >= 0"),
        ("data.augment", "rotate", "data.augment must be one of"),
        ("data.crop_scale", "0", "data.crop_scale must be in (0, 1]"),
        ("base.deep_ensemble", "1", "base.deep_ensemble must be 0 (none) or >= 2"),
        pytest.param(
            "build.device",
            "cuda",
            "torch sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present"),
        ),
    ],
)
def test_a_bad_value_is_one_line_and_exit_status_2(tmp_path, capsys, flag, value, says):
    """Every bad config value ends in one line naming the key, the value and what is allowed; no traceback, and
    before any data or weights load (the build would take minutes to reach them)."""
    from offline.build import main

    code = main(["--config", "offline/configs/image-fast.yaml", "--out", str(tmp_path / "out"), f"--{flag}", value])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("config error: ") and says in err
    assert not (tmp_path / "out").exists()  # nothing was built
