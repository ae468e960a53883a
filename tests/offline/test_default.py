"""``python -m offline.default``: stale artifacts build side by side, output prefixed, failures named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from offline import default


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_side_by_side_prefixes_output_and_names_failures(capsys: pytest.CaptureFixture[str]) -> None:
    jobs = [
        ("good", _py("import os; print('one'); print('threads', os.environ['OMP_NUM_THREADS'])")),
        ("bad", _py("import sys; print('broken'); sys.exit(3)")),
    ]
    failed = default.run_side_by_side(jobs, width=2, threads=1)
    out = capsys.readouterr().out.splitlines()
    assert failed == ["bad"]
    assert "[good] one" in out and "[good] threads 1" in out and "[bad] broken" in out


@pytest.mark.parametrize(("width", "overlapped"), [(1, False), (2, True)])
def test_width_bounds_how_many_run_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], width: int, overlapped: bool
) -> None:
    done = tmp_path / "first-done"
    first = _py(f"import time, pathlib; time.sleep(2); pathlib.Path({str(done)!r}).touch()")
    second = _py(f"import pathlib; print('overlapped', not pathlib.Path({str(done)!r}).exists())")
    assert default.run_side_by_side([("a", first), ("b", second)], width=width, threads=1) == []
    assert f"[b] overlapped {overlapped}" in capsys.readouterr().out.splitlines()


def test_up_to_date_artifacts_are_not_rebuilt(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(default, "is_current", lambda out, config: True)
    monkeypatch.setattr(default, "run_side_by_side", lambda *a, **k: pytest.fail("nothing is stale"))
    assert default.main(["--out", "unused"]) == 0
    assert capsys.readouterr().out.count("is up to date") == len(default.SERVED)


def test_stale_artifacts_build_in_children_and_a_failure_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, object] = {}

    def fake(jobs, width, threads):  # type: ignore[no-untyped-def]
        seen.update(names=[n for n, _ in jobs], width=width, threads=threads, argv=jobs[0][1])
        return ["image"]

    monkeypatch.setattr(default, "is_current", lambda out, config: False)
    monkeypatch.setattr(default, "run_side_by_side", fake)
    monkeypatch.setattr(default.os, "cpu_count", lambda: 2)
    assert default.main(["--out", "arts"]) == 1
    assert seen["names"] == list(default.SERVED) and seen["width"] == 2 and seen["threads"] == 1
    argv = seen["argv"]
    assert isinstance(argv, list) and argv[1:3] == ["-m", "offline.default"] and argv[-2:] == ["--only", "text"]
    assert "image failed" in capsys.readouterr().out


def test_negative_jobs_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        default.main(["--jobs", "-1"])
    assert exc.value.code == 2
