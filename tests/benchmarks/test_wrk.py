"""benchmarks/wrk.py: wrk's report parsed (a known report), its Lua body round-trips any JSON, the process group's
CPU counted, and a real wrk against the floor server (skipped, saying so, without Debian's wrk)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.wrk import group_cpu_s, parse_wrk, post_script, run_wrk

REPORT = """Running 10s test @ http://127.0.0.1:8000/predict
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    18.70ms    3.99ms  45.55ms   74.84%
    Req/Sec     3.42k   250.89     3.89k    72.00%
  Latency Distribution
     50%   17.99ms
     75%   20.66ms
     90%   23.78ms
     99%   28.46ms
  34069 requests in 10.01s, 53.96MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 7
Requests/sec:   3404.10
Transfer/sec:      5.39MB
"""


def test_a_known_report():
    r = parse_wrk(REPORT, 64)
    assert (r.requests, r.rps, r.p50_ms, r.p99_ms, r.non_2xx) == (34069, 3404.10, 17.99, 28.46, 7)
    assert r.seconds == pytest.approx(10.01) and r.socket_errors == {"connect": 0, "read": 2, "write": 0, "timeout": 1}
    assert parse_wrk(REPORT.replace("17.99ms", "950.00us"), 64).p50_ms == pytest.approx(0.95)
    with pytest.raises(ValueError, match="not a wrk --latency report"):
        parse_wrk("Running 10s test\n", 64)


def test_the_lua_body_holds_any_json(tmp_path: Path):
    body = json.dumps({"text": 'a ]] and ]=] and "quotes" \u00e9'}).encode()
    script = post_script(tmp_path / "p.lua", body).read_text()
    assert "]==]" in script and 'wrk.method = "POST"' in script  # a long bracket the body cannot close


def test_the_process_group_cpu_grows_with_work():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.6: pass"], start_new_session=True
    )
    time.sleep(0.3)
    first = group_cpu_s(proc.pid)
    proc.wait(10)
    assert 0 < first <= 1.0


@pytest.mark.skipif(shutil.which("wrk") is None, reason="Debian's wrk is not installed (make wrk)")
def test_wrk_against_the_floor_server():
    port = harness.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.floor_server", "--port", str(port)],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        harness.wait_ready(port, proc, timeout=60)
        body = harness.payload({"preprocessing": {"type": "image", "size": [28, 28], "channels": 1}})
        script = post_script(Path(f"/tmp/wrk-test-{port}.lua"), json.dumps(body).encode())
        r = run_wrk(f"http://127.0.0.1:{port}/predict", script, 4, 1.0, threads=1)
        assert r.requests > 100 and r.non_2xx == 0 and 0 < r.p50_ms <= r.p99_ms
    finally:
        proc.terminate()
        proc.wait(10)
