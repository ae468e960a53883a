"""Progress of long stages: bars on a terminal only; CI output and --no-progress logs hold no carriage returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.core import progress

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
    argv = ["--config", "offline/configs/text-fast.yaml", "--out", str(tmp_path), "--no-progress"]
    main([*argv, "--calibration.tpr", "high"])
    assert not progress.enabled()


def test_every_bar_of_the_builder_goes_through_offline_progress():
    direct = [p.name for p in (ROOT / "offline").rglob("*.py") if p.name != "progress.py" and "tqdm(" in p.read_text()]
    assert direct == []


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_without_a_terminal(caplog):
    """Without a terminal a stage logs a line at its start, every `every` seconds and at its end: the stage, the
    step of the total, its loss, the rate and the ETA, as stable key=value text and as the record's fields."""
    clock = _Clock()
    with caplog.at_level("INFO", logger="hydra.progress"):
        p = progress.ProgressLog(range(60), desc="member 0", every=30.0, clock=clock)
        for i, _ in enumerate(p):
            clock.t += 1.0  # one step a second
            if i == 9:
                p.set_postfix(loss="0.4123")
    lines = [r for r in caplog.records if r.name == "hydra.progress"]
    events = [r.event for r in lines]
    assert events == ["start", "update", "update", "end"]  # at 30 s and 60 s of 60
    start, update, end = lines[0], lines[1], lines[-1]
    assert start.getMessage() == 'progress stage="member 0" event=start step=0/60 pct=0.0 elapsed=0s'
    assert (update.step, update.total, update.pct, update.loss) == (30, 60, 50.0, "0.4123")
    assert update.rate == pytest.approx(1.0) and update.eta_s == pytest.approx(30.0)
    assert "step=30/60 pct=50.0 loss=0.4123 rate=1/s elapsed=30s eta=30s" in update.getMessage()
    assert (end.step, end.pct, end.elapsed_s) == (60, 100.0, 60.0) and "eta=" not in end.getMessage()


def test_a_stage_without_a_total_and_the_interval_setting(caplog):
    with pytest.raises(ValueError, match="> 0"):
        progress.set_every(0)
    progress.set_every(12.5)
    try:
        assert progress.every() == 12.5
        with caplog.at_level("INFO", logger="hydra.progress"), progress.stage("export"):
            pass
    finally:
        progress.set_every(progress.DEFAULT_EVERY)
    msgs = [r.getMessage() for r in caplog.records if r.name == "hydra.progress"]
    assert msgs[0].startswith('progress stage="export" event=start step=0 ') and "event=end" in msgs[-1]


def test_a_stage_without_steps_logs_a_line_every_interval_while_it_runs(caplog):
    """Calibration and export have no steps of their own: a heartbeat line every interval, none after the end."""
    import time

    progress.set_enabled(False)
    progress.set_every(0.2)
    try:
        with caplog.at_level("INFO", logger="hydra.progress"):
            with progress.stage("calibration"):
                time.sleep(0.9)
            time.sleep(0.5)  # closed: the heartbeat has stopped
    finally:
        progress.set_every(progress.DEFAULT_EVERY)
    events = [r.getMessage().split()[2] for r in caplog.records if r.name == "hydra.progress"]
    assert events[0] == "event=start" and events[-1] == "event=end"
    assert 3 <= events.count("event=update") <= 5 and events.count("event=end") == 1


def test_a_tiny_build_with_stderr_to_a_pipe_logs_progress_lines(user_files, tmp_path):
    """The build as a Kubernetes Job runs it: stderr a pipe, JSON logs. Every long stage logs its start and end,
    and updates in between (the interval set tiny here), with step, total, rate and, while training, the loss."""
    import json
    import subprocess
    import sys

    import yaml

    from .conftest import ticket_build

    ckpt, data = user_files
    nested: dict = {}
    for key, value in ticket_build(ckpt, data, **{"data.max_calibration": 20}).items():
        *path, last = key.split(".")
        d = nested
        for k in path:
            d = d.setdefault(k, {})
        d[last] = value
    cfg = tmp_path / "tickets.yaml"
    cfg.write_text(yaml.safe_dump(nested))
    flags = ["--progress-every", "0.001", "--log-format", "json"]
    command = [sys.executable, "offline/build.py", "--config", str(cfg), "--out", str(tmp_path / "a"), *flags]
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stderr
    records = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    prog = [x for x in records if x.get("logger") == "hydra.progress"]
    stages = {x["stage"] for x in prog}
    for stage in (
        "fine-tune",
        "taylor scoring (layers)",
        "member 0",
        "member 1",
        "evaluation (methods x sets)",
        "calibration",
        "export",
    ):
        events = [x["event"] for x in prog if x["stage"] == stage]
        assert events[:1] == ["start"] and events[-1:] == ["end"], (stage, events, sorted(stages))
    member = [x for x in prog if x["stage"] == "member 0" and x["event"] == "update"]
    assert member and all(x["total"] == 2 and x["rate"] is not None and "eta_s" in x for x in member)
    assert any("loss" in x for x in prog if x["stage"] == "fine-tune")
