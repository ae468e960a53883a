"""SIGTERM under load: in-flight requests finish, new connections are refused (never reset), no request is lost,
exit status 0.

Starts ``python -m service`` on 127.0.0.1 (a free port) with one artifact, runs
``--concurrency`` clients that each send ``POST /predict`` on a fresh connection
per request (so that "refused" is unambiguous: a new connection is not
accepted), sends SIGTERM after ``--load-seconds``, keeps the clients trying for
``--after-seconds`` more, and waits for the server to exit; ``--repeat N`` does
it N times, a fresh server each time. Then it accounts for every request:

* ``in_flight_at_sigterm``: sent before the signal, answered after it (they finished);
* sent after the signal but before the server stopped accepting (uvicorn notices a
  signal within 0.1 s; ``service/entrypoints/http_server.py`` stops at the signal itself): served;
* ``refused``: the connection was refused (ECONNREFUSED): the server no longer
  accepts. ``reset``: the connection was reset, or closed, before any response
  byte; ``broken``: closed in the middle of a response. Both are failures: a
  connection the kernel accepted must be answered (``service/entrypoints/http_server.py`` answers
  the ones still in the accept queue at the signal; uvicorn alone resets them);
* ``lost``: reached the app and got no answer. The server logs how many requests
  it received and answered (``hydra.service`` at shutdown): ``lost = received -
  answered``, and the client's answer count must equal the server's.

Target: 0 resets (and broken) and 0 lost over 20 repetitions at 16 clients:

    python -m benchmarks.sigterm_test --tiny vit --repeat 20 --load-seconds 3 --after-seconds 2
    python -m benchmarks.sigterm_test --artifact artifacts/default/image --concurrency 32
    python -m benchmarks.sigterm_test --tiny vit --workers 2 --concurrency 256 --repeat 5   # every worker drains

Writes ``benchmarks/results/sigterm_<name>.json`` (every repetition and the totals); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness

# the server's shutdown log line: "stopped: ... (N requests received, M answered)"
SHUTDOWN_LINE = re.compile(r"\((\d+) requests received, (\d+) answered\)")


@dataclass
class Outcome:
    """One client request: when it was sent and answered (perf_counter seconds), and how it ended."""

    sent: float
    done: float
    # "answered"; "refused" (connect refused); "reset" (closed before any response byte: never reached the app, see
    # the server's counts); "broken" (closed in the middle of a response); "timeout"
    kind: str
    code: str = ""  # the contract's code of an answer ("ok" for 200)


async def load_until(
    port: int, body: bytes, concurrency: int, sigterm_at: float, stop_at: float, timeout: float, on_signal: Any
) -> tuple[list[Outcome], dict[str, Any]]:
    """Clients posting ``body`` until ``stop_at`` (perf_counter); ``on_signal()`` is called at ``sigterm_at``."""
    outcomes: list[Outcome] = []
    at_signal: dict[str, Any] = {}

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            conn = harness.Connection(port)
            t0 = time.perf_counter()
            try:
                status, _, data = await asyncio.wait_for(conn.request("POST", "/predict", body, close=True), timeout)
            except asyncio.TimeoutError:  # noqa: UP041 (3.10: not the builtin)
                outcomes.append(Outcome(t0, time.perf_counter(), "timeout"))
            except ConnectionRefusedError:
                outcomes.append(Outcome(t0, time.perf_counter(), "refused"))
                await asyncio.sleep(0.05)
            except OSError as e:
                kind = "refused" if e.errno == errno.ECONNREFUSED else "reset"
                outcomes.append(Outcome(t0, time.perf_counter(), kind))
                await asyncio.sleep(0.05)
            except (ValueError, asyncio.IncompleteReadError):  # closed in the middle of a response: a real loss
                outcomes.append(Outcome(t0, time.perf_counter(), "broken"))
            else:
                outcomes.append(Outcome(t0, time.perf_counter(), "answered", harness.error_code(status, data)))
            finally:
                await conn.close()

    async def signaller() -> None:
        await asyncio.sleep(max(0.0, sigterm_at - time.perf_counter()))
        at_signal["t"] = time.perf_counter()
        at_signal["answered_before"] = sum(o.kind == "answered" for o in outcomes)
        on_signal()

    await asyncio.gather(signaller(), *(worker() for _ in range(concurrency)))
    return outcomes, at_signal


def account(outcomes: list[Outcome], t_sig: float) -> dict[str, Any]:
    """Counts by fate. ``in_flight_at_sigterm``: sent before the signal, ended after it. The server stops accepting
    at the signal or a moment after it (uvicorn checks for it every 0.1 s, later on a busy machine): requests sent in
    between are accepted and served; ``sent_after_refusing`` starts at the first refused connection."""
    refused_at = [o.sent for o in outcomes if o.kind == "refused" and o.sent >= t_sig]
    t_refusing = min(refused_at) if refused_at else float("inf")
    before = [o for o in outcomes if o.sent < t_sig]
    between = [o for o in outcomes if t_sig <= o.sent < t_refusing]
    after = [o for o in outcomes if o.sent >= t_refusing]
    straddling = [o for o in before if o.done >= t_sig]

    def by_kind(xs: list[Outcome]) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in xs:
            key = o.code if o.kind == "answered" else o.kind
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    return {
        "sent": len(outcomes),
        "answered": sum(o.kind == "answered" for o in outcomes),
        "by_outcome": by_kind(outcomes),
        "sent_before_sigterm": by_kind(before),
        "in_flight_at_sigterm": by_kind(straddling),
        "sent_after_sigterm_before_refusing": by_kind(between),
        "refusing_after_sigterm_ms": round((t_refusing - t_sig) * 1000, 1) if refused_at else None,
        "sent_after_refusing": by_kind(after),
    }


# answers a request may get around a shutdown: served, or 503 not_ready once the server stops serving
ANSWERS = {"ok", "not_ready"}
# what the target counts per repetition: a connection reset, or closed, before or in the middle of its answer
RESETS = ("reset", "broken")


def run_once(args: argparse.Namespace, artifact: Path, body: bytes, workdir: Path) -> dict[str, Any]:
    """One server, loaded, stopped by SIGTERM under load: the client's and the server's accounts, and the checks."""
    env = {"HYDRA_MAX_QUEUE": str(args.max_queue), "HYDRA_LOG_LEVEL": "info", "HYDRA_WORKERS": str(args.workers)}
    port = harness.free_port()
    log_file = workdir / "server.log"
    proc = harness.start_server(artifact, port, env, log_file=log_file)
    try:
        control_answered, outcomes, at_signal, exit_status = _load_and_stop(args, port, proc, body)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = log_file.read_text(errors="replace")
    lines = SHUTDOWN_LINE.findall(log)  # one per worker (HYDRA_WORKERS): every worker's counts add up
    m = len(lines) == args.workers
    received = sum(int(a) for a, _ in lines) if m else -1
    answered = sum(int(b) for _, b in lines) if m else -1
    acc = account(outcomes, at_signal["t"])
    client_answered = acc["answered"] + control_answered
    lost = received - answered if m else None
    resets = sum(acc["by_outcome"].get(k, 0) for k in RESETS)
    checks = _checks(acc, exit_status, m, lost, resets, client_answered == answered)
    return {
        "loopback": f"{harness.HOST}:{port}",
        "client": acc,
        "answered_before_sigterm": at_signal["answered_before"],
        "server": {
            "requests_received": received,
            "requests_answered": answered,
            "of_which_readiness_and_metrics_polls": control_answered,
        },
        "resets": resets,
        "lost": lost,
        "exit_status": exit_status,
        "checks": checks,
        "passed": all(checks.values()),
        "server_log_tail": log.splitlines()[-12:],
    }


def _load_and_stop(
    args: argparse.Namespace, port: int, proc: subprocess.Popen, body: bytes
) -> tuple[int, list[Outcome], dict[str, Any], int]:
    """Load the ready server, SIGTERM it under load, wait for its exit: ``(answers before the load, the load's
    outcomes, the signal's time and count, exit status)``."""
    harness.wait_ready(port, proc)
    # wait_ready's polls reached the server too; count the server's answers so far from /metrics
    status, _, metrics = asyncio.run(harness.request(port, "GET", "/metrics"))
    assert status == 200
    control_answered = _requests_so_far(metrics.decode()) + 1  # + this /metrics request, answered after rendering
    t0 = time.perf_counter()
    outcomes, at_signal = asyncio.run(
        load_until(
            port,
            body,
            args.concurrency,
            t0 + args.load_seconds,
            t0 + args.load_seconds + args.after_seconds,
            args.timeout,
            lambda: proc.send_signal(signal.SIGTERM),
        )
    )
    try:
        exit_status = proc.wait(60)
    except Exception:
        proc.kill()
        exit_status = proc.wait(10)
    return control_answered, outcomes, at_signal, exit_status


def _checks(
    acc: dict[str, Any], exit_status: int, logged: bool, lost: int | None, resets: int, counts_agree: bool
) -> dict[str, bool]:
    """The checks of one repetition on the client's account ``acc`` and the server's."""
    in_flight = acc["in_flight_at_sigterm"]
    return {
        "exit_status_0": exit_status == 0,
        "shutdown_line_logged": logged,
        "lost_0": lost == 0,
        "resets_0": resets == 0,
        "client_and_server_answer_counts_agree": counts_agree,
        # a connection begun just before the signal may find the server no longer accepting: refused, not reset
        "in_flight_requests_finished_ok": in_flight.get("ok", 0) > 0 and set(in_flight) <= {"ok", "refused"},
        "no_timeouts": acc["by_outcome"].get("timeout", 0) == 0,
        "only_ok_or_not_ready_answers": set(acc["by_outcome"]) <= ANSWERS | {"refused", *RESETS},
        "new_connections_refused": set(acc["sent_after_refusing"]) <= {"refused"}
        and acc["sent_after_refusing"].get("refused", 0) > 0,
        "refusing_within_2_s_of_sigterm": (acc["refusing_after_sigterm_ms"] or 1e9) < 2000,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked: the load bounded."""
    p = harness.load_parser(__doc__, "sigterm_<name>.json", clients=16, most=512, clients_flag="--concurrency")
    p.add_argument("--workers", type=int, default=1, help="HYDRA_WORKERS: server processes on the one port")
    p.add_argument("--repeat", type=int, default=1, help="repetitions, a fresh server each (the target: 20)")
    p.add_argument("--load-seconds", type=float, default=8.0, help="load before SIGTERM")
    p.add_argument("--after-seconds", type=float, default=4.0, help="clients keep trying this long after SIGTERM")
    p.add_argument("--max-queue", type=int, default=1024, help="HYDRA_MAX_QUEUE (large: no overload here)")
    args = p.parse_args(argv)
    if not 1 <= args.concurrency <= 512 or not 0 < args.load_seconds <= 60 or not 0 < args.after_seconds <= 30:
        p.error("--concurrency in 1..512, --load-seconds in (0, 60], --after-seconds in (0, 30]")
    if not 1 <= args.workers <= 64:
        p.error("--workers in 1..64")
    if not 1 <= args.repeat <= 200:
        p.error("--repeat in 1..200")
    return args


def _totals(runs: list[dict[str, Any]]) -> dict[str, int]:
    """The repetitions' counts added up (a repetition without the server's shutdown line counts one lost)."""
    return {
        "repetitions": len(runs),
        "sent": sum(r["client"]["sent"] for r in runs),
        "answered": sum(r["client"]["answered"] for r in runs),
        "refused": sum(r["client"]["by_outcome"].get("refused", 0) for r in runs),
        "resets": sum(r["resets"] for r in runs),
        "lost": sum(r["lost"] if r["lost"] is not None else 1 for r in runs),
        "repetitions_passed": sum(r["passed"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    tmp, artifact, manifest, body = harness.open_run(args, "hydra-sigterm-")
    name = manifest["name"]
    print(
        f"python -m service with {artifact}: {args.concurrency} clients for {args.load_seconds} s, then SIGTERM; "
        f"{args.repeat} repetition(s)",
        flush=True,
    )
    runs = []
    for i in range(args.repeat):
        r = run_once(args, artifact, body, Path(tmp.name))
        runs.append(r)
        acc = r["client"]
        failed = "" if r["passed"] else f"; FAILED {[k for k, v in r['checks'].items() if not v]}"
        print(
            f"[{i + 1}/{args.repeat}] sent {acc['sent']}: {acc['by_outcome']}; in flight at SIGTERM: "
            f"{acc['in_flight_at_sigterm']}; refusing {acc['refusing_after_sigterm_ms']} ms after SIGTERM; "
            f"server received {r['server']['requests_received']}, answered {r['server']['requests_answered']}; "
            f"resets {r['resets']}, lost {r['lost']}, exit status {r['exit_status']}{failed}",
            flush=True,
        )
    totals = _totals(runs)
    checks = {
        "every_repetition_passed": totals["repetitions_passed"] == len(runs),
        "resets_0": totals["resets"] == 0,
        "lost_0": totals["lost"] == 0,
    }
    passed = all(checks.values())
    result = {
        **harness.result_head("sigterm_test", argv, name, args, artifact),
        "concurrency": args.concurrency,
        "workers": args.workers,
        "load_seconds": args.load_seconds,
        "after_seconds": args.after_seconds,
        "target": "0 resets and 0 lost over 20 repetitions at 16 clients",
        "totals": totals,
        "checks": checks,
        "passed": passed,
        "meets_target": passed and len(runs) >= 20 and args.concurrency >= 16,
        "repetitions": runs,
    }
    out = harness.save_run(result, args.out, f"sigterm_{name}.json")
    print(
        f"total over {len(runs)} repetition(s): sent {totals['sent']}, answered {totals['answered']}, refused "
        f"{totals['refused']}, resets {totals['resets']}, lost {totals['lost']}"
        f"{' (meets the target)' if result['meets_target'] else ''}"
    )
    return harness.close_run(tmp, checks, out, passed)


def _requests_so_far(metrics_text: str) -> int:
    """Requests the server answered so far: the sum of ``hydra_request_duration_seconds_count``."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("hydra_request_duration_seconds_count"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


if __name__ == "__main__":
    sys.exit(main())
