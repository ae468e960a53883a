"""Several workers on one port (``HYDRA_WORKERS``, service/entrypoints/workers.py), through the real
``python -m service``: both workers answer, ``/metrics`` is one view of both, ``/readyz`` is 503 while a worker is
missing, a worker killed with SIGKILL under load loses only its requests in flight and is replaced while the other
answers, and SIGTERM stops them
all with status 0. A bad ``HYDRA_WORKERS`` refuses start-up in one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from benchmarks import harness
from service.entrypoints.workers import resolve_workers
from service.settings import Settings, settings_errors
from tests.fixtures import golden
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import b64, noise_images, png

ROOT = Path(__file__).resolve().parents[2]


def workers_of(pid: int) -> list[int]:
    """The worker processes of supervisor ``pid`` (its children that run the server)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and b"spawn_main" in cmd:
            out.append(int(entry.name))
    return sorted(out)


def cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(stat[11]) + int(stat[12])


def status(port: int, path: str) -> int:
    try:
        return asyncio.run(harness.request(port, "GET", path, timeout=5.0))[0]
    except (OSError, asyncio.TimeoutError, ValueError):  # noqa: UP041
        return 0


async def load(port: int, body: bytes, seconds: float, clients: int = 6) -> dict[str, int]:
    """``clients`` clients, a new connection per request, for ``seconds``: answers by outcome."""
    tally = {"ok": 0, "error": 0, "reset": 0}
    t_end = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < t_end:
            try:
                st, _, _ = await harness.request(port, "POST", "/predict", body, timeout=10.0)
                tally["ok" if st == 200 else "error"] += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                tally["reset"] += 1
                await asyncio.sleep(0.01)

    await asyncio.gather(*(client() for _ in range(clients)))
    return tally


def metric_sum(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_two_workers_answer_as_one_server_survive_a_kill_and_stop_cleanly(tmp_path):
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-w", guarantees={"risks": [0.5], "risk": 0.5})
    port = harness.free_port()
    extra = {"HYDRA_WORKERS": "2", "HYDRA_STATE_DIR": str(tmp_path / "state"), "HYDRA_LOG_LEVEL": "info"}
    proc = harness.start_server(art, port, extra, log_file=tmp_path / "server.log", new_session=True)
    try:
        harness.wait_ready(port, proc, timeout=120)
        pids = workers_of(proc.pid)
        assert len(pids) == 2, pids
        body = json.dumps({"image": b64(png(noise_images(1, seed=3)[0]))}).encode()
        before = {p: cpu_ticks(p) for p in pids}
        tally = asyncio.run(load(port, body, 3.0))
        assert tally["ok"] > 50 and tally["error"] == tally["reset"] == 0, tally
        assert all(cpu_ticks(p) > before[p] for p in pids)  # both workers answered
        text = asyncio.run(harness.request(port, "GET", "/metrics"))[2].decode()
        # one view of both: every answer counted once (plus each worker's warm-up input)
        assert metric_sum(text, "hydra_predictions_total") == tally["ok"] + 2
        assert "hydra_ready 1.0" in text
        # SIGKILL one worker under load: only its requests in flight are lost, the other keeps answering
        victim = pids[0]
        loop_result: dict[str, int] = {}

        async def kill_during_load() -> None:
            task = asyncio.create_task(load(port, body, 4.0))
            await asyncio.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            loop_result.update(await task)

        asyncio.run(kill_during_load())
        assert loop_result["ok"] > 50 and loop_result["error"] == 0, loop_result
        assert loop_result["reset"] <= 6, loop_result  # at most the clients' requests in flight on it
        # a replacement starts; /readyz says 503 until it is ready, then 200
        t0, seen_503 = time.monotonic(), False
        while time.monotonic() - t0 < 90:
            code = status(port, "/readyz")
            seen_503 |= code == 503
            new = workers_of(proc.pid)
            if code == 200 and len(new) == 2 and victim not in new:
                break
            time.sleep(0.2)
        assert len(new) == 2 and victim not in new and status(port, "/readyz") == 200
        assert seen_503 or time.monotonic() - t0 < 0.5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert workers_of(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = (tmp_path / "server.log").read_text()
    assert f"worker {victim} died" in text and "starting a replacement" in text


def test_workers_setting_is_checked_and_auto_is_one_per_core_on_cpu(monkeypatch):
    assert Settings(workers="auto").workers == "auto" and Settings(workers="3").workers == 3
    for bad in ("0", "many", "2.5", "-1", "65"):
        with pytest.raises(ValidationError) as e:
            Settings(workers=bad)
        (line,) = settings_errors(e.value)
        assert line == f"HYDRA_WORKERS must be auto or an integer from 1 to 64; got {bad!r}"
    assert resolve_workers("auto", "cpu") == len(os.sched_getaffinity(0)) and resolve_workers(4, "cpu") == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # taskset or a container's CPU limit
    assert resolve_workers("auto", "cpu") == 3


async def _slow_client(port: int, seconds: float) -> None:
    """A client that sends a request's head and then its body a few bytes at a time (a slow uplink, or a slowloris
    attack): the worker that took it holds the connection, and must not stall on it."""
    reader, writer = await asyncio.open_connection(harness.HOST, port)
    writer.write(
        b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            writer.write(b'{"image"   ')
            await writer.drain()
            await asyncio.sleep(0.2)
    except OSError:
        pass
    finally:
        writer.close()


async def _too_large(port: int, limit: int) -> tuple[int, bytes]:
    """A body of 8 times the limit, streamed: the answer (413) comes without the server reading it all."""
    reader, writer = await asyncio.open_connection(harness.HOST, port)
    size = 8 * limit
    head = f"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    writer.write(head.encode())
    try:
        for _ in range(size // 4096):
            writer.write(b" " * 4096)
            await writer.drain()
    except OSError:  # the server answered and closed before the body was sent
        pass
    got = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status = int(got.split()[1])
    length = int(next(ln.split(b":")[1] for ln in got.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    return status, body


def test_slow_clients_and_an_oversized_body_stall_no_worker(tmp_path):
    """With two workers, 16 slow clients (spread over both by the kernel) and a body over the limit do not keep
    either worker from answering the others: every normal request during them is answered."""
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-s")
    port, limit = harness.free_port(), 64 * 1024
    extra = {"HYDRA_WORKERS": "2", "HYDRA_STORE": "off", "HYDRA_MAX_BODY_BYTES": str(limit)}
    proc = harness.start_server(art, port, extra, log_file=tmp_path / "server.log")
    try:
        harness.wait_ready(port, proc, timeout=120)
        assert len(workers_of(proc.pid)) == 2
        body = json.dumps({"image": b64(png(noise_images(1, seed=4)[0]))}).encode()

        async def scenario() -> tuple[dict[str, int], tuple[int, bytes]]:
            slow = [asyncio.create_task(_slow_client(port, 4.0)) for _ in range(16)]
            await asyncio.sleep(0.3)
            big = asyncio.create_task(_too_large(port, limit))
            tally = await load(port, body, 3.0)
            out = await big
            await asyncio.gather(*slow)
            return tally, out

        tally, (code, answer) = asyncio.run(scenario())
        assert tally["ok"] > 30 and tally["error"] == tally["reset"] == 0, tally
        assert code == 413 and json.loads(answer)["error"]["code"] == "payload_too_large"
    finally:
        assert harness.stop_server(proc) == 0


def _ready_dir(worker: int) -> Path:
    env = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    (folder,) = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"HYDRA_SERVE_READY_DIR=")]
    return Path(folder)


def _drift(port: int) -> dict:
    st, _, body = asyncio.run(harness.request(port, "GET", "/v1/models/tiny-d/drift"))
    assert st == 200, body
    return json.loads(body)


def test_two_workers_share_one_drift_alarm_keep_its_evidence_and_abstain_without_it(tmp_path):
    """Every worker's inputs advance one alarm: the drift route answers the same whichever worker serves it, the
    input count is every input served, the first suspension comes as with one worker; a worker killed with SIGKILL
    takes no evidence with it; a state file that cannot be read makes every answer abstain, saying why, and the
    server not ready."""
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-d", guarantees={"risks": [0.5], "risk": 0.5})
    port = harness.free_port()
    extra = {"HYDRA_WORKERS": "2", "HYDRA_STORE": "off"}
    proc = harness.start_server(art, port, extra, log_file=tmp_path / "server.log", new_session=True)
    try:
        harness.wait_ready(port, proc, timeout=120)
        pids = workers_of(proc.pid)
        assert len(pids) == 2
        # the tiny models' calibration inputs are grey noise (tests/fixtures/golden.py's images); uniform noise is not
        normal = json.dumps({"images": golden.images()[:4]}).encode()
        foreign = json.dumps({"images": [b64(png(a)) for a in noise_images(4, seed=5)]}).encode()
        # a shift, sent one request at a time (on fresh connections: either worker), so that the input the alarm goes
        # on at is known: the request whose inputs turn it on is the first suspended, as with one worker
        answers, ids = [], []
        for _ in range(40):
            st, hdrs, body = asyncio.run(harness.request(port, "POST", "/predict", foreign))
            assert st == 200, body
            answers.append(json.loads(body)["predictions"])
            ids.append(hdrs["x-request-id"])
            if answers[-1][-1]["selective"]["suspended"]:
                break
        first = next(i for i, preds in enumerate(answers) if any(p["selective"]["suspended"] for p in preds))
        shifted = _drift(port)
        assert shifted["alarm"] is True and shifted["inputs"] == 4 * len(answers), shifted
        assert 4 * first < shifted["alarm_at"] <= 4 * (first + 1)
        # both workers answer under load; every input of both is in the one alarm
        before = {p: cpu_ticks(p) for p in pids}
        tally = asyncio.run(load(port, normal, 2.0, clients=4))
        assert tally["ok"] > 10 and tally["error"] == tally["reset"] == 0, tally
        assert all(cpu_ticks(p) > before[p] for p in pids)  # both workers answered
        views = [_drift(port) for _ in range(6)]  # fresh connections: both workers serve some of them
        assert all(v == views[0] for v in views) and views[0]["inputs"] == 4 * (len(answers) + tally["ok"])
        alarm = views[0]
        # the recall: the answers of both workers from the change point to the alarm, listed once, read alike by both
        (rec,) = alarm["recalled"]
        window = {
            (ids[k], i): 4 * k + i + 1
            for k, preds in enumerate(answers)
            for i, p in enumerate(preds)
            if not p["selective"]["suspended"] and rec["changed_at"] <= 4 * k + i + 1 < rec["started_at"]
        }
        assert window and {(a["id"], a["index"]): a["input"] for a in rec["answers"]} == window
        # SIGKILL a worker: the replacement reads the same alarm
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90 and not (len(workers_of(proc.pid)) == 2 and status(port, "/readyz") == 200):
            time.sleep(0.2)
        assert pids[0] not in workers_of(proc.pid)
        after = [_drift(port) for _ in range(6)]
        assert all(a["inputs"] == alarm["inputs"] and a["alarm_at"] == alarm["alarm_at"] for a in after), after
        # the state file damaged: answers abstain, saying why, and /readyz says why
        (state,) = _ready_dir(workers_of(proc.pid)[0]).glob("drift-tiny-d-*.state")
        state.write_bytes(b"\0" * state.stat().st_size)
        for _ in range(4):
            st, _, body = asyncio.run(harness.request(port, "POST", "/predict", normal))
            preds = json.loads(body)["predictions"]
            assert st == 200 and all(p["selective"]["accept"] is False for p in preds)
            assert all("drift alarm's state cannot be read" in p["selective"]["reason"] for p in preds)
        st, _, body = asyncio.run(harness.request(port, "GET", "/readyz"))
        assert st == 503 and b"shared state cannot be read" in body, body
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_the_supervisor_leaves_its_process_environment_as_it_found_it(monkeypatch):
    """What the workers inherit (the shared folder, the thread share) is put back when the supervisor returns: run
    inside a longer-lived process, it must not make that process a 'worker' of a folder that is gone."""
    import socket

    from service.entrypoints.workers import supervise
    from service.fleet import READY_DIR_ENV, shared_file

    monkeypatch.delenv(READY_DIR_ENV, raising=False)
    monkeypatch.delenv("HYDRA_THREADS", raising=False)
    taken = socket.socket()
    taken.bind((harness.HOST, 0))
    taken.listen()
    try:  # the port is taken: the supervisor refuses before starting any worker
        assert supervise(2, harness.HOST, taken.getsockname()[1], 1.0) == 3
    finally:
        taken.close()
    assert READY_DIR_ENV not in os.environ and "HYDRA_THREADS" not in os.environ and shared_file("x") is None
