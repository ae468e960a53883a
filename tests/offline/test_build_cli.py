"""The builder's command line (offline/build.py): every flag described in ``--help``, the help true to the code, and
a mistyped flag answered in one line with the closest valid flags (exit status 2)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from offline.build import main, make_parser
from offline.compute import resolve_precision
from offline.config import BuildConfig, _section_classes


def help_entries(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``--help``'s text, parsed: each long flag -> its help text (wrapped lines joined)."""
    monkeypatch.setenv("COLUMNS", "120")
    text = make_parser().format_help()
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        start = re.match(r"^  (?:-\w, )?(--[\w.-]+)(?: [A-Z_]+)?(?:\s{2,}(.*))?$", line)
        if start:
            flag = start.group(1)
            entries[flag] = (start.group(2) or "").strip()
        elif flag is not None and line.startswith(" " * 8) and line.strip():
            entries[flag] = (entries[flag] + " " + line.strip()).strip()
        else:
            flag = None
    return entries


def test_every_flag_has_a_description(monkeypatch: pytest.MonkeyPatch):
    entries = help_entries(monkeypatch)
    config_flags = {f"--{sec}.{f.name}" for sec, cls in _section_classes().items() for f in dataclasses.fields(cls)}
    config_flags |= {f"--{f.name}" for f in dataclasses.fields(BuildConfig) if f.name not in _section_classes()}
    assert config_flags <= set(entries), sorted(config_flags - set(entries))  # the parser found every flag
    undescribed = sorted(f for f, text in entries.items() if not text.split("(default:")[0].strip())
    assert undescribed == [], f"flags without a description in --help: {undescribed}"
    # the keys whose description sits on the lines above the field (too long for one line) are described too
    for flag in ("--base.cache_dir", "--base.image_init", "--data.max_calibration", "--export.aoti", "--build.device"):
        assert len(entries[flag].split("(default:")[0]) > 20, (flag, entries[flag])


def test_precision_auto_help_says_what_the_code_does(monkeypatch: pytest.MonkeyPatch):
    """``build.precision: auto`` is bf16 on CUDA and on a CPU with native bf16, fp32 on other CPUs: the help says
    that (it once said fp32 on every CPU)."""
    text = help_entries(monkeypatch)["--build.precision"]
    assert "native bf16" in text and "avx512_bf16" in text and "amx_bf16" in text, text
    assert "fp32 on CPU)" not in text
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu, native_bf16=True) == "bf16"
    assert resolve_precision("auto", cpu, native_bf16=False) == "fp32"
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--hydra.membres", "5"], "unknown flag --hydra.membres (did you mean --hydra.members?)"),
        (["--hydra.membres=5"], "unknown flag --hydra.membres (did you mean --hydra.members?)"),
        (["--members", "5"], "--hydra.members"),  # the section left out
        (["--build.precison", "bf16"], "did you mean --build.precision"),
        (["--export.onxx", "false"], "did you mean --export.onnx?"),
        (["--calibration.ood-score", "msp"], "did you mean --calibration.ood_score?"),
        (["--zzz", "1", "--hydra.seed", "[1]"], "unknown flags --zzz, --hydra.seed (did you mean --hydra.seeds"),
    ],
)
def test_an_unknown_flag_is_one_line_naming_the_closest_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--config", "offline/configs/text-fast.yaml", "--out", str(out), *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert err.count("\n") == 0 and "usage:" not in err, err
    assert err.startswith("offline/build.py: error: ") and says in err, err
    assert not out.exists()


def test_other_command_line_errors_are_one_line_too(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as e:
        main(["--out", "x"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--config" in err and "--help" in err
