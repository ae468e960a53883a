"""One drift alarm for every worker (service/core/drift_shared.py): workers that feed their chunks into one shared
state compute exactly the statistic of one monitor fed the merged stream; the false-alarm bound holds for the
merged stream (simulation); real processes, one killed mid-stream with SIGKILL, lose no evidence; a state file that
is removed or corrupt is refused, never read as a fresh start."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from service.core.drift import DriftMonitor
from service.core.drift_shared import SIZE, DriftStateError, SharedDriftMonitor

CAL = np.random.default_rng(0).standard_normal(999)


def _worker(path: str, seed: int, chunks: int, size: int, done: mp.Queue) -> None:  # a child process
    mon = SharedDriftMonitor(path, CAL, delta=0.01)
    rng = np.random.default_rng(seed)
    for _ in range(chunks):
        mon.update(rng.standard_normal(size).tolist())
    done.put(mon.episodes_started_here)


def test_workers_sharing_a_state_compute_the_merged_streams_statistic(tmp_path: Path):
    """Chunks from three 'workers' (each its own open file: flock sees them as three holders) in an interleaving
    fixed by arrival, with a shift in the middle: count, statistic, alarm input and every episode equal one
    in-memory monitor fed the same chunks in the same order."""
    path = tmp_path / "drift.state"
    workers = [SharedDriftMonitor(path, CAL, delta=0.01) for _ in range(3)]
    alone = DriftMonitor(CAL, delta=0.01)
    rng = np.random.default_rng(1)
    for step in range(300):
        shift = 2.5 if 100 <= step < 160 else 0.0  # a drift, then back to normal: an episode opens and clears
        chunk = (rng.standard_normal(int(rng.integers(1, 6))) + shift).tolist()
        w = workers[int(rng.integers(3))]
        w.update(chunk)
        alone.update(chunk)
        if step == 259:  # one worker resets (after an investigation): the others see it
            workers[0].reset()
            alone.reset()
    for w in workers:
        w.sync()
        assert (w.count, w.log10_statistic, w.alarm_at) == (alone.count, alone.log10_statistic, alone.alarm_at)
        assert w.state() == alone.state()
    assert alone.episodes_total >= 1 and alone.episodes[0].cleared_by == "traffic"
    assert sum(w.episodes_started_here for w in workers) == alone.episodes_total  # each episode counted once


def test_a_reset_by_one_worker_is_seen_by_the_others(tmp_path: Path):
    a, b = (SharedDriftMonitor(tmp_path / "d", CAL, delta=0.01) for _ in range(2))
    a.update([5.0] * 40)  # far above every calibration score: the alarm goes on
    b.sync()
    assert b.alarm and b.alarm_at == a.alarm_at
    b.reset()
    assert a.state()["alarm"] is False and a.state()["history"][-1]["cleared_by"] == "reset"


def test_the_false_alarm_bound_holds_for_the_merged_stream(tmp_path: Path):
    """The bound ``P(alarm within m inputs) <= m / A`` for traffic like the calibration data, with the statistic in
    the shared file and two workers whose chunks interleave by arrival (not by value): 60 streams at A = 40, m = 20
    (bound 0.5; the in-memory procedure measures about 0.02 at A / 2)."""
    arl, m, streams = 40.0, 20, 60
    alarms = 0
    for s in range(streams):
        rng = np.random.default_rng(100 + s)
        cal = rng.standard_normal(200)
        path = tmp_path / f"s{s}"
        w = [SharedDriftMonitor(path, cal, delta=0.05, arl=arl) for _ in range(2)]
        fed = 0
        while fed < m:
            n = min(int(rng.integers(1, 4)), m - fed)
            w[int(rng.integers(2))].update(rng.standard_normal(n).tolist())
            fed += n
        w[0].sync()
        alarms += w[0].episodes_total > 0
    assert alarms / streams <= m / arl


def test_real_processes_one_killed_mid_stream_lose_no_evidence(tmp_path: Path):
    """Two worker processes feed the shared state while a third is killed with SIGKILL mid-stream: every input of the
    two that finished is in the count, the state still reads, and the lock was not left held."""
    path = str(tmp_path / "drift.state")
    SharedDriftMonitor(path, CAL, delta=0.01)  # the file exists before the workers start
    ctx = mp.get_context("spawn")
    done: mp.Queue = ctx.Queue()
    victim = ctx.Process(target=_worker, args=(path, 9, 10**6, 4, done))
    victim.start()
    time.sleep(1.5)  # the victim is feeding
    workers = [ctx.Process(target=_worker, args=(path, seed, 200, 3, done)) for seed in (1, 2)]
    for p in workers:
        p.start()
    time.sleep(0.3)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    reader = SharedDriftMonitor(path, CAL, delta=0.01)
    assert reader.count >= 2 * 200 * 3 and (reader.count - 2 * 200 * 3) % 4 == 0  # the victim's chunks are whole
    reader.update([0.0])  # the lock is free
    assert reader.count % 4 == 1


def test_a_removed_or_corrupt_state_is_refused(tmp_path: Path):
    path = tmp_path / "drift.state"
    mon = SharedDriftMonitor(path, CAL, delta=0.01)
    mon.update([0.1, 0.2])
    with path.open("r+b") as f:  # both slots damaged
        f.write(b"\0" * SIZE)
    with pytest.raises(DriftStateError, match="corrupt"):
        mon.update([0.3])
    with pytest.raises(DriftStateError, match="corrupt"):
        SharedDriftMonitor(path, CAL, delta=0.01).sync()  # not read as a fresh start
    other = tmp_path / "other.state"
    mon2 = SharedDriftMonitor(other, CAL, delta=0.01)
    other.unlink()
    with pytest.raises(DriftStateError, match="is gone"):
        mon2.sync()


def test_one_damaged_slot_falls_back_to_the_other(tmp_path: Path):
    """A worker killed while writing leaves one slot torn: the other, one update older, is read."""
    path = tmp_path / "drift.state"
    mon = SharedDriftMonitor(path, CAL, delta=0.01)
    mon.update([0.1])
    mon.update([0.2, 0.3])  # the newest state is in the slot of sequence 3
    newest = (mon._seq % 2) * (SIZE // 2)
    with path.open("r+b") as f:
        f.seek(newest + 30)
        f.write(b"garbage")
    fresh = SharedDriftMonitor(path, CAL, delta=0.01)
    assert fresh.count == 1  # the update before the torn one
