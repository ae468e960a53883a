"""What the prediction store costs the answers: the store on vs off, paired in one run, at 32 clients.

Starts two servers of one artifact on 127.0.0.1 (free ports; nothing leaves the machine): one with the store on
(the default: SQLite in this run's own state folder) and one with ``HYDRA_STORE=false``. Both stay up for the
whole run, and the load goes to one at a time: ``--rounds`` rounds, each driving both servers for ``--seconds``
with ``--clients`` keep-alive clients posting ``POST /predict``, the order alternating (on, off; then off, on), so
that both see the same machine state, round by round. The idle server uses no CPU.

    python -m benchmarks.store_cost --artifact artifacts/default/image
    python -m benchmarks.store_cost --tiny vit --rounds 2 --seconds 5       # a short check

Reported per round and server: throughput, p50 and p99; then the round-by-round ratios on / off, their median
and range, and the store's own count of records written and dropped (``hydra_store_records``). The checks (the
issue's targets): the median throughput ratio is at least ``1 - --throughput-band`` (0.95), the median p99
ratio at most ``1 + --p99-band`` (1.10), no error, and no record dropped. Writes
``benchmarks/results/store_cost/<name>.json``. The CPU is named in the result; nothing else may run on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness

MODES = ("on", "off")


async def drive(port: int, body: bytes, clients: int, seconds: float, timeout: float) -> dict[str, Any]:
    """``clients`` keep-alive clients posting ``body`` for ``seconds``: throughput, p50, p99 and errors."""
    latency: list[float] = []
    codes: dict[str, int] = {}

    class Tally:
        timeouts = 0
        connection_errors = 0

    tally = Tally()
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def client() -> None:
        conn = harness.Connection(port)
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            answer = await conn.post_counted("/predict", body, timeout, tally)
            if answer is None:
                continue
            code = harness.error_code(answer[0], answer[2])
            codes[code] = codes.get(code, 0) + 1
            latency.append((time.perf_counter() - t) * 1000)
        await conn.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    q = np.percentile(latency, [50, 99]) if latency else [float("nan")] * 2
    return {
        "requests": len(latency),
        "rps": round(len(latency) / wall, 2),
        "p50_ms": round(float(q[0]), 2),
        "p99_ms": round(float(q[1]), 2),
        "errors": sum(v for k, v in codes.items() if k != "ok") + tally.timeouts + tally.connection_errors,
    }


def store_records(port: int) -> dict[str, float]:
    """``hydra_store_records`` of the server's ``/metrics``, by outcome (written, queued, dropped ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = asyncio.run(harness.request(port, "GET", "/metrics"))
    assert status == 200, status
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == "hydra_store_records":
            for s in fam.samples:
                outcome = s.labels.get("outcome", "?")
                out[outcome] = out.get(outcome, 0.0) + s.value
    return out


def ratios(rounds: list[dict[str, dict[str, Any]]], key: str) -> dict[str, float]:
    """The round-by-round ratio on / off of ``key``: median, min and max."""
    r = [x["on"][key] / x["off"][key] for x in rounds if x["off"][key]]
    return {"median": round(statistics.median(r), 4), "min": round(min(r), 4), "max": round(max(r), 4)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = harness.load_parser(__doc__, "store_cost/<name>.json")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each drives both servers once")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of load per server and round")
    p.add_argument("--warmup", type=int, default=300, help="requests sent to each server before the rounds")
    harness.add_bands(
        p,
        {
            "throughput-band": (0.05, "throughput loss with the store on"),
            "p99-band": (0.10, "p99 rise with the store on"),
        },
    )
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 64 or args.rounds < 1 or args.seconds <= 0:
        p.error("--clients must be in 1..64, --rounds at least 1 and --seconds positive")
    return args


def run_rounds(
    args: argparse.Namespace, artifact: Path, body: bytes, work: Path
) -> tuple[list[dict[str, dict[str, Any]]], dict[str, float]]:
    """Both servers up (the store's in ``work``), warmed, then ``args.rounds`` rounds: each round's result per
    server, and the store-on server's record counts at the end."""
    envs = {
        "on": {"HYDRA_LOG_LEVEL": "warning", "HYDRA_STATE_DIR": str(work / "state")},
        "off": {"HYDRA_LOG_LEVEL": "warning", "HYDRA_STORE": "false"},
    }
    ports = {m: harness.free_port() for m in MODES}
    procs = {}
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for m in MODES:
            procs[m] = harness.start_server(artifact, ports[m], envs[m], log_file=work / f"server-{m}.log")
        for m in MODES:
            harness.wait_ready(ports[m], procs[m])
            asyncio.run(harness.burst(ports[m], body, args.warmup))
        for r in range(args.rounds):
            row: dict[str, dict[str, Any]] = {}
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                row[m] = asyncio.run(drive(ports[m], body, args.clients, args.seconds, args.timeout))
            rounds.append(row)
            print(
                f"round {r + 1}: on {row['on']['rps']:.1f} req/s p99 {row['on']['p99_ms']:.1f} ms; "
                f"off {row['off']['rps']:.1f} req/s p99 {row['off']['p99_ms']:.1f} ms",
                flush=True,
            )
        return rounds, store_records(ports["on"])
    finally:
        for proc in procs.values():
            harness.stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    tmp, artifact, manifest, body = harness.open_run(args, "hydra-store-cost-")
    print(f"store on vs off with {artifact}: {args.clients} clients on {harness.cpu_name()}", flush=True)
    rounds, records = run_rounds(args, artifact, body, Path(tmp.name))
    throughput, p99 = ratios(rounds, "rps"), ratios(rounds, "p99_ms")
    errors = sum(x[m]["errors"] for x in rounds for m in MODES)
    checks = {
        "throughput_within_band": throughput["median"] >= 1 - args.throughput_band,
        "p99_within_band": p99["median"] <= 1 + args.p99_band,
        "no_errors": errors == 0,
        "no_record_dropped": records.get("written", 0.0) > 0
        and sum(v for k, v in records.items() if k.startswith("dropped")) == 0,
    }
    result = {
        **harness.result_head("store_cost", argv, manifest["name"], args, artifact),
        "clients": args.clients,
        "seconds_per_run": args.seconds,
        "rounds": rounds,
        "ratio_on_over_off": {"throughput": throughput, "p99": p99},
        "store_records": records,
        "checks": checks,
        "passed": all(checks.values()),
    }
    out = harness.save_run(result, args.out, f"store_cost/{manifest['name']}.json")
    print(
        f"on / off, median over {args.rounds} rounds: throughput {throughput['median']:.3f} "
        f"(range {throughput['min']:.3f}-{throughput['max']:.3f}), p99 {p99['median']:.3f} "
        f"(range {p99['min']:.3f}-{p99['max']:.3f}); store records {records}"
    )
    return harness.close_run(tmp, checks, out, result["passed"])


if __name__ == "__main__":
    sys.exit(main())
