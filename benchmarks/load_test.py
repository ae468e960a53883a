"""Load test of ``python -m service`` on loopback: throughput, latency, errors by code, RSS before and after.

Starts the server on 127.0.0.1 (a free port; nothing leaves the machine) with
one artifact, warms it up, then runs bounded phases of concurrent clients
(keep-alive connections, ``POST /predict``), each for a fixed time and at most
``--max-requests`` requests in all. The queue is kept small by default
(``HYDRA_MAX_QUEUE=32``) so that the top concurrency overloads the server: the
overflow must be answered 503 ``overloaded`` with ``Retry-After``, quickly; no
request may hang (``--timeout``) or go unanswered, and the server must stay
ready. The server's RSS is read from ``/proc`` after warm-up and after the load;
its growth must stay under ``--rss-bound-mb``.

    python benchmarks/load_test.py --tiny vit                          # 16 clients 20 s, then 64 clients 30 s
    python benchmarks/load_test.py --artifact artifacts/default/image --concurrency 8 64 --duration 20 40

Writes ``benchmarks/results/load_<name>.json``; exits 1 when a check fails (lost
or hung requests, 5xx other than overloaded, RSS growth over the bound, not
ready after the load, server crashed). The helpers (server process, HTTP client)
are shared with ``benchmarks/sigterm_test.py`` and ``tests/reliability``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only, always

TEXT = "The new phone arrived two days late, but the screen is gorgeous and the battery easily lasts a whole day."


# ----------------------------------------------------------------------------- the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(artifact: Path, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a loopback server: offline Hugging Face, the artifact, host and port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HYDRA_ARTIFACTS": str(artifact),
                "HYDRA_HOST": HOST, "HYDRA_PORT": str(port), "HYDRA_LOG_LEVEL": "info"})  # fmt: skip
    env.update(extra or {})
    return env


def start_server(
    artifact: Path, port: int, extra_env: dict[str, str] | None = None, *, log_file: Path | None = None,
    module: str = "service",
) -> subprocess.Popen:  # fmt: skip
    """``python -m <module>`` on 127.0.0.1:``port``; its stdout and stderr go to ``log_file`` (else discarded)."""
    out = open(log_file, "wb") if log_file is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        return subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=server_env(artifact, port, extra_env),
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        if log_file is not None:
            out.close()  # the child holds its own descriptor


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 180.0) -> float:
    """Poll ``/readyz`` until 200; seconds it took. Raises ``RuntimeError`` if the server exits or times out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            status, _, _ = asyncio.run(request(port, "GET", "/readyz", timeout=2.0))
            if status == 200:
                return time.monotonic() - t0
        except (OSError, asyncio.TimeoutError, ValueError):  # noqa: UP041 (3.10: not the builtin)
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready after {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, wait; kill if it does not stop. The exit status (negative: killed by that signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def rss_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process from ``/proc/<pid>/status``: ``rss`` (VmRSS) and ``peak`` (VmHWM), MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "peak"] = round(int(value.split()[0]) / 1024, 1)
    return out


# ----------------------------------------------------------------------------- a minimal HTTP/1.1 client
class Connection:
    """Keep-alive HTTP/1.1 on asyncio streams: microseconds of CPU per request (httpx takes ~1 ms), so that the
    clients, on the same cores as the server, take little from it. Reconnects after an error."""

    def __init__(self, port: int, host: str = HOST) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, close: bool = False
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body). Raises ``OSError`` / ``ValueError`` (``IncompleteReadError``)."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Length: {len(body)}\r\n"
            if body:
                head += "Content-Type: application/json\r\n"
            for k, v in (headers or {}).items():
                head += f"{k}: {v}\r\n"
            if close:
                head += "Connection: close\r\n"
            self.writer.write((head + "\r\n").encode() + body)
            await self.writer.drain()
            status_line = await self.reader.readline()
            if not status_line:
                raise ConnectionResetError("connection closed before any response byte")
            status = int(status_line.split()[1])
            hdrs: dict[str, str] = {}
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                hdrs[name.strip().lower()] = value.strip()
            data = await self.reader.readexactly(int(hdrs.get("content-length", "0")))
        except BaseException:
            await self.close()
            raise
        if close or hdrs.get("connection", "").lower() == "close":
            await self.close()
        return status, hdrs, data

    async def close(self) -> None:
        writer, self.writer, self.reader = self.writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


async def request(
    port: int, method: str, path: str, body: bytes = b"", *, timeout: float = 10.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One request on a fresh connection (closed after)."""
    conn = Connection(port)
    try:
        return await asyncio.wait_for(conn.request(method, path, body, headers, close=True), timeout)
    finally:
        await conn.close()


def error_code(status: int, body: bytes) -> str:
    """The contract's error code of an answer (``ok`` for 2xx; the status when the body is not the contract's)."""
    if 200 <= status < 300:
        return "ok"
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


def payload(manifest: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """One ``/predict`` body of the artifact's modality: a noise image of the model's size, or a sentence."""
    prep = manifest["preprocessing"]
    if prep["type"] == "text":
        return {"text": TEXT}
    from PIL import Image

    h, w = prep["size"]
    shape = (h, w) if int(prep.get("channels", 3)) == 1 else (h, w, 3)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
    return {"image": base64.b64encode(buf.getvalue()).decode()}


# ----------------------------------------------------------------------------- load phases
@dataclass
class Phase:
    """Counters of one phase of load."""

    concurrency: int
    duration_s: float
    sent: int = 0
    answered: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    by_code: dict[str, int] = field(default_factory=dict)
    timeouts: int = 0
    connection_errors: int = 0
    overloaded_without_retry_after: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # of 200 answers
    overloaded_ms: list[float] = field(default_factory=list)  # time to an overloaded answer
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        q = np.percentile(self.latencies_ms, [50, 99]) if self.latencies_ms else [float("nan")] * 2
        oq = np.percentile(self.overloaded_ms, [50, 99]) if self.overloaded_ms else [float("nan")] * 2
        wall = max(self.wall_s, 1e-9)
        return {
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "wall_s": round(self.wall_s, 3),
            "sent": self.sent,
            "answered": self.answered,
            "lost": self.sent - self.answered,  # no answer: hung (timeouts) or the connection dropped
            "timeouts": self.timeouts,
            "connection_errors": self.connection_errors,
            "by_status": dict(sorted(self.by_status.items())),
            "errors_by_code": {k: v for k, v in sorted(self.by_code.items()) if k != "ok"},
            "ok": self.by_code.get("ok", 0),
            "throughput_rps": round(self.by_code.get("ok", 0) / wall, 2),
            "answered_rps": round(self.answered / wall, 2),
            "p50_ms": round(float(q[0]), 2),
            "p99_ms": round(float(q[1]), 2),
            "overloaded_p50_ms": round(float(oq[0]), 2),
            "overloaded_p99_ms": round(float(oq[1]), 2),
            "overloaded_without_retry_after": self.overloaded_without_retry_after,
        }


async def run_phase(
    port: int, body: bytes, concurrency: int, duration: float, max_requests: int, timeout: float
) -> Phase:
    """``concurrency`` keep-alive clients posting ``body`` in a loop for ``duration`` s (at most ``max_requests``)."""
    ph = Phase(concurrency, duration)
    conns = [Connection(port) for _ in range(concurrency)]
    t_start = time.perf_counter()
    deadline = t_start + duration

    async def worker(conn: Connection) -> None:
        while ph.sent < max_requests and time.perf_counter() < deadline:
            ph.sent += 1
            t0 = time.perf_counter()
            try:
                status, hdrs, data = await asyncio.wait_for(conn.request("POST", "/predict", body), timeout)
            except asyncio.TimeoutError:  # noqa: UP041 (3.10: not the builtin)
                ph.timeouts += 1
                await conn.close()
                continue
            except (OSError, ValueError, asyncio.IncompleteReadError):
                ph.connection_errors += 1
                await asyncio.sleep(0.05)
                continue
            ms = (time.perf_counter() - t0) * 1000
            ph.answered += 1
            ph.by_status[str(status)] = ph.by_status.get(str(status), 0) + 1
            code = error_code(status, data)
            ph.by_code[code] = ph.by_code.get(code, 0) + 1
            if code == "ok":
                ph.latencies_ms.append(ms)
            elif code == "overloaded":
                ph.overloaded_ms.append(ms)
                if not hdrs.get("retry-after", "").isdigit():
                    ph.overloaded_without_retry_after += 1
                await asyncio.sleep(0.005)  # a polite client backs off a little (still far below Retry-After)

    await asyncio.gather(*(worker(c) for c in conns))
    ph.wall_s = time.perf_counter() - t_start
    for c in conns:
        await c.close()
    return ph


# ----------------------------------------------------------------------------- the script
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", type=Path, help="artifact directory to serve")
    src.add_argument("--tiny", choices=["vit", "bert"], help="build a tiny random artifact of this family instead")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="clients per phase (each <= 64)")
    p.add_argument("--duration", type=float, nargs="+", default=[20.0, 30.0], help="seconds per phase")
    p.add_argument("--max-requests", type=int, default=200_000, help="most requests in all phases together")
    p.add_argument("--timeout", type=float, default=30.0, help="a request without an answer after this is hung")
    p.add_argument("--max-queue", type=int, default=32, help="HYDRA_MAX_QUEUE (small: the top phase overloads)")
    p.add_argument("--max-batch", type=int, default=16, help="HYDRA_MAX_BATCH")
    p.add_argument("--threads", type=int, default=None, help="HYDRA_THREADS")
    p.add_argument("--rss-bound-mb", type=float, default=64.0, help="most RSS growth from after warm-up to the end")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default benchmarks/results/load_<name>.json)")
    args = p.parse_args(argv)
    if len(args.duration) == 1:
        args.duration = args.duration * len(args.concurrency)
    if len(args.duration) != len(args.concurrency):
        p.error("give one --duration, or one per --concurrency value")
    if any(not 1 <= c <= 64 for c in args.concurrency) or any(not 0 < d <= 120 for d in args.duration):
        p.error("--concurrency values must be in 1..64 and --duration values in (0, 120]")
    if sum(args.duration) > 300 or not 1 <= args.max_requests <= 1_000_000:
        p.error("at most 300 s of load in all, and --max-requests in 1..1000000")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    tmp = tempfile.TemporaryDirectory(prefix="hydra-load-")
    if args.tiny:
        sys.path.insert(0, str(ROOT))
        from service.tiny_artifact import make_tiny_artifact

        artifact = make_tiny_artifact(Path(tmp.name) / args.tiny, args.tiny, name=f"tiny-{args.tiny}")
    else:
        artifact = args.artifact.resolve()
    manifest = json.loads((artifact / "manifest.json").read_text())
    name = manifest["name"]
    body = json.dumps(payload(manifest)).encode()
    items = min(args.max_queue, 64)  # HYDRA_MAX_QUEUE must be >= HYDRA_MAX_ITEMS
    env = {"HYDRA_MAX_QUEUE": str(args.max_queue), "HYDRA_MAX_ITEMS": str(items),
           "HYDRA_MAX_BATCH": str(args.max_batch), "HYDRA_LOG_LEVEL": "warning"}  # fmt: skip
    if args.threads:
        env["HYDRA_THREADS"] = str(args.threads)
    port = free_port()
    log_file = Path(tmp.name) / "server.log"
    print(f"starting python -m service on {HOST}:{port} with {artifact} ({env})", flush=True)
    proc = start_server(artifact, port, env, log_file=log_file)
    phases: list[dict[str, Any]] = []
    checks: dict[str, bool] = {}
    rss: dict[str, Any] = {}
    try:
        ready_s = wait_ready(port, proc)
        print(f"ready after {ready_s:.1f} s; warm-up burst (8 clients, 200 requests)", flush=True)
        warm = asyncio.run(run_phase(port, body, 8, 30.0, 200, args.timeout))
        rss["before"] = rss_mb(proc.pid)
        peak_during = rss["before"]["rss"]
        budget = args.max_requests
        for c, d in zip(args.concurrency, args.duration, strict=True):
            ph = asyncio.run(run_phase(port, body, c, d, budget, args.timeout))
            budget -= ph.sent
            peak_during = max(peak_during, rss_mb(proc.pid)["rss"])
            s = ph.summary()
            phases.append(s)
            print(f"  {c:2d} clients {s['wall_s']:5.1f} s: sent {s['sent']}, answered {s['answered']}, "
                  f"{s['throughput_rps']:.1f} ok/s, p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, "
                  f"errors {s['errors_by_code'] or 0}, timeouts {s['timeouts']}, "
                  f"connection errors {s['connection_errors']}", flush=True)  # fmt: skip
        rss["after"] = rss_mb(proc.pid)
        rss["peak_sampled"] = peak_during
        rss["growth"] = round(rss["after"]["rss"] - rss["before"]["rss"], 1)
        rss["bound"] = args.rss_bound_mb
        status, _, _ = asyncio.run(request(port, "GET", "/readyz"))
        checks["ready_after_load"] = status == 200
        checks["server_alive"] = proc.poll() is None
    finally:
        exit_status = stop_server(proc)
    allowed = {"ok", "overloaded"}
    checks["no_lost_requests"] = all(s["lost"] == 0 for s in phases)
    checks["no_hung_requests"] = all(s["timeouts"] == 0 for s in phases)
    checks["no_connection_errors"] = all(s["connection_errors"] == 0 for s in phases)
    checks["only_ok_or_overloaded"] = all(set(s["errors_by_code"]) <= allowed for s in phases)
    checks["overloaded_has_retry_after"] = all(s["overloaded_without_retry_after"] == 0 for s in phases)
    checks["rss_growth_within_bound"] = rss.get("growth", float("inf")) <= args.rss_bound_mb
    checks["exit_status_0_on_sigterm"] = exit_status == 0
    log_tail = log_file.read_text(errors="replace").splitlines()[-20:]
    result = {
        "command": "python benchmarks/load_test.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "name": name,
        "artifact": f"tiny {args.tiny} (random weights)" if args.tiny else str(artifact),
        "server_env": env,
        "loopback": f"{HOST}:{port}",
        "warmup": warm.summary(),
        "phases": phases,
        "totals": {
            "sent": sum(s["sent"] for s in phases),
            "answered": sum(s["answered"] for s in phases),
            "ok": sum(s["ok"] for s in phases),
            "errors_by_code": _merge([s["errors_by_code"] for s in phases]),
            "timeouts": sum(s["timeouts"] for s in phases),
            "connection_errors": sum(s["connection_errors"] for s in phases),
            "lost": sum(s["lost"] for s in phases),
        },
        "rss_mb": rss,
        "server_exit_status": exit_status,
        "checks": checks,
        "passed": all(checks.values()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "server_log_tail": log_tail,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"load_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    t = result["totals"]
    print(f"sent {t['sent']}, answered {t['answered']} ({t['ok']} ok), errors {t['errors_by_code']}, "
          f"timeouts {t['timeouts']}, connection errors {t['connection_errors']}, lost {t['lost']}; RSS "
          f"{rss.get('before', {}).get('rss')} -> {rss.get('after', {}).get('rss')} MiB (growth {rss.get('growth')}, "
          f"bound {args.rss_bound_mb}); server exit status {exit_status}")  # fmt: skip
    for k, v in checks.items():
        print(f"  {'PASS' if v else 'FAIL'} {k}")
    print(f"wrote {out}")
    tmp.cleanup()
    return 0 if result["passed"] else 1


def _merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


if __name__ == "__main__":
    sys.exit(main())
