"""Progress of long stages: bars on a terminal only; CI output and --no-progress logs hold no carriage returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from offline import progress

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _default():
    progress.set_enabled(None)
    yield
    progress.set_enabled(None)


def test_no_bar_and_no_carriage_return_when_stderr_is_not_a_terminal(capsys):
    assert not progress.enabled()  # pytest's captured stderr is no terminal, like CI or a Kubernetes Job
    for _ in progress.bar(range(50), desc="member 0"):
        pass
    assert "\r" not in capsys.readouterr().err


def test_bars_on_a_terminal_are_left_on_screen_and_can_be_switched_off(capsys):
    progress.set_enabled(True)  # as on a terminal
    for _ in progress.bar(range(5), desc="member 0"):
        pass
    err = capsys.readouterr().err
    assert "member 0" in err and "5/5" in err and err.endswith("\n")  # leave=True: the finished bar stays
    for _ in progress.bar(range(5), desc="quiet", wanted=False):
        pass
    assert capsys.readouterr().err == ""


def test_build_no_progress_flag_switches_bars_off(tmp_path):
    from offline.build import main

    progress.set_enabled(True)
    main(["--config", "offline/configs/text-fast.yaml", "--out", str(tmp_path), "--no-progress",
          "--calibration.tpr", "high"])  # fmt: skip
    assert not progress.enabled()


def test_every_bar_of_the_builder_goes_through_offline_progress():
    direct = [p.name for p in (ROOT / "offline").rglob("*.py")
              if p.name != "progress.py" and "tqdm(" in p.read_text()]  # fmt: skip
    assert direct == []
