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

    python -m benchmarks.load_test --tiny vit                          # 16 clients 20 s, then 64 clients 30 s
    python -m benchmarks.load_test --artifact artifacts/default/image --concurrency 8 64 --duration 20 40

Writes ``benchmarks/results/load_<name>.json``; exits 1 when a check fails (lost
or hung requests, 5xx other than overloaded, RSS growth over the bound, not
ready after the load, server crashed). The server process and the HTTP client
are ``benchmarks/harness.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness


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
    conns = [harness.Connection(port) for _ in range(concurrency)]
    t_start = time.perf_counter()
    deadline = t_start + duration

    async def worker(conn: harness.Connection) -> None:
        while ph.sent < max_requests and time.perf_counter() < deadline:
            ph.sent += 1
            t0 = time.perf_counter()
            answer = await conn.post_counted("/predict", body, timeout, ph)
            if answer is None:
                continue
            status, hdrs, data = answer
            ms = (time.perf_counter() - t0) * 1000
            ph.answered += 1
            ph.by_status[str(status)] = ph.by_status.get(str(status), 0) + 1
            code = harness.error_code(status, data)
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
def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked: as many durations as concurrencies, and the load bounded."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_artifact_arguments(p)
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
    return args


def _server_env(args: argparse.Namespace) -> dict[str, str]:
    """The server's settings: a small queue (so the top phase overloads it), the batch size, the threads."""
    items = min(args.max_queue, 64)  # HYDRA_MAX_QUEUE must be >= HYDRA_MAX_ITEMS
    env = {
        "HYDRA_MAX_QUEUE": str(args.max_queue),
        "HYDRA_MAX_ITEMS": str(items),
        "HYDRA_MAX_BATCH": str(args.max_batch),
        "HYDRA_LOG_LEVEL": "warning",
    }
    if args.threads:
        env["HYDRA_THREADS"] = str(args.threads)
    return env


def _drive(port: int, proc: Any, body: bytes, args: argparse.Namespace) -> tuple[Phase, list, dict, dict]:
    """Warm the ready server up, then run the phases: ``(warm-up, phase summaries, RSS, checks)``."""
    phases: list[dict[str, Any]] = []
    checks: dict[str, bool] = {}
    rss: dict[str, Any] = {}
    ready_s = harness.wait_ready(port, proc)
    print(f"ready after {ready_s:.1f} s; warm-up burst (8 clients, 200 requests)", flush=True)
    warm = asyncio.run(run_phase(port, body, 8, 30.0, 200, args.timeout))
    rss["before"] = harness.rss_mb(proc.pid)
    peak_during = rss["before"]["rss"]
    budget = args.max_requests
    for c, d in zip(args.concurrency, args.duration, strict=True):
        ph = asyncio.run(run_phase(port, body, c, d, budget, args.timeout))
        budget -= ph.sent
        peak_during = max(peak_during, harness.rss_mb(proc.pid)["rss"])
        s = ph.summary()
        phases.append(s)
        print(
            f"  {c:2d} clients {s['wall_s']:5.1f} s: sent {s['sent']}, answered {s['answered']}, "
            f"{s['throughput_rps']:.1f} ok/s, p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, "
            f"errors {s['errors_by_code'] or 0}, timeouts {s['timeouts']}, "
            f"connection errors {s['connection_errors']}",
            flush=True,
        )
    rss["after"] = harness.rss_mb(proc.pid)
    rss["peak_sampled"] = peak_during
    rss["growth"] = round(rss["after"]["rss"] - rss["before"]["rss"], 1)
    rss["bound"] = args.rss_bound_mb
    status, _, _ = asyncio.run(harness.request(port, "GET", "/readyz"))
    checks["ready_after_load"] = status == 200
    checks["server_alive"] = proc.poll() is None
    return warm, phases, rss, checks


def _check_phases(phases: list[dict[str, Any]], rss: dict[str, Any], bound: float, exit_status: int) -> dict:
    """The checks on the phases' answers, the RSS growth and the server's exit."""
    allowed = {"ok", "overloaded"}
    return {
        "no_lost_requests": all(s["lost"] == 0 for s in phases),
        "no_hung_requests": all(s["timeouts"] == 0 for s in phases),
        "no_connection_errors": all(s["connection_errors"] == 0 for s in phases),
        "only_ok_or_overloaded": all(set(s["errors_by_code"]) <= allowed for s in phases),
        "overloaded_has_retry_after": all(s["overloaded_without_retry_after"] == 0 for s in phases),
        "rss_growth_within_bound": rss.get("growth", float("inf")) <= bound,
        "exit_status_0_on_sigterm": exit_status == 0,
    }


def _totals(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The phases' counts added up."""
    return {
        "sent": sum(s["sent"] for s in phases),
        "answered": sum(s["answered"] for s in phases),
        "ok": sum(s["ok"] for s in phases),
        "errors_by_code": _merge([s["errors_by_code"] for s in phases]),
        "timeouts": sum(s["timeouts"] for s in phases),
        "connection_errors": sum(s["connection_errors"] for s in phases),
        "lost": sum(s["lost"] for s in phases),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    tmp, artifact, manifest, body = harness.open_run(args, "hydra-load-")
    name = manifest["name"]
    env = _server_env(args)
    port = harness.free_port()
    log_file = Path(tmp.name) / "server.log"
    print(f"starting python -m service on {harness.HOST}:{port} with {artifact} ({env})", flush=True)
    proc = harness.start_server(artifact, port, env, log_file=log_file)
    try:
        warm, phases, rss, checks = _drive(port, proc, body, args)
    finally:
        exit_status = harness.stop_server(proc)
    checks.update(_check_phases(phases, rss, args.rss_bound_mb, exit_status))
    log_tail = log_file.read_text(errors="replace").splitlines()[-20:]
    result = {
        "command": "python -m benchmarks.load_test " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "name": name,
        "artifact": f"tiny {args.tiny} (random weights)" if args.tiny else str(artifact),
        "server_env": env,
        "loopback": f"{harness.HOST}:{port}",
        "warmup": warm.summary(),
        "phases": phases,
        "totals": _totals(phases),
        "rss_mb": rss,
        "server_exit_status": exit_status,
        "checks": checks,
        "passed": all(checks.values()),
        "server_log_tail": log_tail,
    }
    out = harness.save_run(result, args.out, f"load_{name}.json")
    t = result["totals"]
    print(
        f"sent {t['sent']}, answered {t['answered']} ({t['ok']} ok), errors {t['errors_by_code']}, "
        f"timeouts {t['timeouts']}, connection errors {t['connection_errors']}, lost {t['lost']}; RSS "
        f"{rss.get('before', {}).get('rss')} -> {rss.get('after', {}).get('rss')} MiB (growth {rss.get('growth')}, "
        f"bound {args.rss_bound_mb}); server exit status {exit_status}"
    )
    return harness.close_run(tmp, checks, out, result["passed"])


def _merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


if __name__ == "__main__":
    sys.exit(main())
