"""Soak of ``python -m service`` on loopback: steady load for a long time, memory and latency sampled throughout.

Starts the server on 127.0.0.1 (a free port; nothing leaves the machine) with one artifact and its default
settings, warms it up with a short burst, then keeps ``--clients`` keep-alive clients posting ``POST /predict``
for ``--minutes``. Every ``--sample-s`` seconds it reads the server's resident memory from ``/proc`` and the
requests answered so far; every request's latency and answer are kept.

    python -m benchmarks.soak --artifact artifacts/default/text                    # 30 min, 32 clients
    python -m benchmarks.soak --tiny bert --minutes 2 --warmup-minutes 0.5         # a short check

With ``--feedback`` every answer is labelled as it arrives (``POST /v1/models/{name}/feedback`` with the answer's
id and its own top label), and the prediction store (SQLite in the soak's own state folder, capped at
``--store-max-rows``) is sampled beside the memory: its files' bytes and its rows.

    python -m benchmarks.soak --artifact artifacts/default/image --minutes 10 --warmup-minutes 3 --feedback

The checks (the soak's targets):

* ``no_errors``: every request answered 200: no error code, no timeout, no dropped connection;
* ``rss_growth``: from the first sample after the warm-up (``--warmup-minutes``, part of the soak) to the
  largest sample after it, resident memory grows by at most ``--rss-growth`` (5 %);
* ``p99_stable``: the p99 latency of the last ``--window-minutes`` (5) is within ``--p99-band`` (20 %) of the
  p99 of the first window after the warm-up; the first window of the soak itself, warm-up included, is reported
  and checked too (``p99_stable_from_start``);
* with ``--feedback``: ``feedback_accepted`` (every label answered ``accepted``), ``store_flat`` (the store's bytes
  grow by at most ``--store-growth``, 10 %, after the warm-up) and ``store_within_retention`` (its rows never
  exceed ``--store-max-rows`` plus what is answered between two of the writer's retention passes, a minute apart,
  plus one writer batch).

Writes ``benchmarks/results/soak_<name>.json`` (the samples, per-minute throughput, p50 and p99, the windows)
and ``soak_<name>.png`` (RSS and latency against time); exits 1 when a check fails. The CPU is named in the
result: latency depends on it, and nothing else may run on the machine while it soaks.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness


class Record:
    """What the load saw: per request (end time, latency, answer code), per sample (time, RSS, answered)."""

    def __init__(self) -> None:
        self.t_end: list[float] = []
        self.latency_ms: list[float] = []
        self.codes: dict[str, int] = {}
        self.timeouts = 0
        self.connection_errors = 0
        self.samples: list[dict[str, float]] = []
        self.feedback: dict[str, int] = {}  # --feedback: the labels' statuses (accepted, unknown_id, ...)


def store_size(state: Path) -> dict[str, float]:
    """The SQLite store in ``state``: its files' bytes (database, WAL, shared memory) and its prediction rows."""
    size = sum(f.stat().st_size for f in state.glob("store.db*")) if state.is_dir() else 0
    rows = -1
    db = state / "store.db"
    if db.is_file():
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
                rows = int(con.execute("SELECT count(*) FROM predictions").fetchone()[0])
        except sqlite3.Error:
            pass  # busy or not created yet: the next sample reads it
    return {"store_bytes": size, "store_rows": rows}


async def label(conn: harness.Connection, name: str, data: bytes, tally: Record) -> None:
    """Send the answer ``data``'s own top label back as its feedback; count the status."""
    answer = json.loads(data)
    item = {"id": answer["id"], "index": 0, "label": answer["predictions"][0]["label"]}
    body = json.dumps({"feedback": [item]}).encode()
    try:
        status, _, out = await conn.request("POST", f"/v1/models/{name}/feedback", body)
    except (OSError, ValueError, asyncio.IncompleteReadError):
        tally.feedback["connection_error"] = tally.feedback.get("connection_error", 0) + 1
        return
    code = json.loads(out)["results"][0]["status"] if status == 200 else harness.error_code(status, out)
    tally.feedback[code] = tally.feedback.get(code, 0) + 1


async def soak(
    port: int, pid: int, body: bytes, args: argparse.Namespace, name: str = "", state: Path | None = None
) -> Record:
    """``args.clients`` keep-alive clients for ``args.minutes``, RSS sampled every ``args.sample_s`` seconds;
    with ``args.feedback`` each answer is labelled (model ``name``) and the store in ``state`` sampled too."""
    rec = Record()
    t0 = time.perf_counter()
    deadline = t0 + args.minutes * 60

    async def client() -> None:
        conn = harness.Connection(port)
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            answer = await conn.post_counted("/predict", body, args.timeout, rec)
            if answer is None:
                continue
            status, _, data = answer
            now = time.perf_counter()
            code = harness.error_code(status, data)
            rec.codes[code] = rec.codes.get(code, 0) + 1
            rec.t_end.append(now - t0)
            rec.latency_ms.append((now - t) * 1000)
            if args.feedback and status == 200:
                await label(conn, name, data, rec)
        await conn.close()

    async def sampler() -> None:
        last_print = -1e9
        while True:
            now = time.perf_counter() - t0
            mem = harness.rss_mb(pid)
            sample = {"t_s": round(now, 1), "rss_mb": mem["rss"], "answered": len(rec.t_end)}
            if args.feedback and state is not None:
                sample.update(store_size(state))
            rec.samples.append(sample)
            if now - last_print >= 60:
                last_print = now
                recent = rec.latency_ms[bisect.bisect_right(rec.t_end, now - 60) :]  # t_end is sorted
                p99 = float(np.percentile(recent, 99)) if recent else float("nan")
                print(
                    f"soak t={now / 60:5.1f} min answered={len(rec.t_end)} rss_mb={mem['rss']} "
                    f"last_min_rps={len(recent) / 60:.1f} last_min_p99_ms={p99:.1f} "
                    f"errors={sum(v for k, v in rec.codes.items() if k != 'ok') + rec.timeouts}",
                    flush=True,
                )
            if time.perf_counter() >= deadline:
                return
            await asyncio.sleep(min(args.sample_s, max(deadline - time.perf_counter(), 0.0)))

    await asyncio.gather(sampler(), *(client() for _ in range(args.clients)))
    return rec


def window(rec: Record, start_s: float, end_s: float) -> dict[str, Any]:
    """Throughput, p50 and p99 of the requests that ended in ``[start_s, end_s)``."""
    t = np.asarray(rec.t_end)
    lat = np.asarray(rec.latency_ms)[(t >= start_s) & (t < end_s)]
    q = np.percentile(lat, [50, 99]) if lat.size else [float("nan")] * 2
    return {
        "from_min": round(start_s / 60, 2),
        "to_min": round(end_s / 60, 2),
        "requests": int(lat.size),
        "rps": round(lat.size / max(end_s - start_s, 1e-9), 2),
        "p50_ms": round(float(q[0]), 2),
        "p99_ms": round(float(q[1]), 2),
    }


def summarise(rec: Record, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, bool]]:
    total_s, warm_s, win_s = args.minutes * 60, args.warmup_minutes * 60, args.window_minutes * 60
    per_minute = [window(rec, m * 60, min((m + 1) * 60, total_s)) for m in range(int(np.ceil(args.minutes)))]
    first, after_warmup = window(rec, 0, win_s), window(rec, warm_s, warm_s + win_s)
    last = window(rec, total_s - win_s, total_s)
    post = [s for s in rec.samples if s["t_s"] >= warm_s]
    base = post[0]["rss_mb"] if post else float("nan")
    peak = max((s["rss_mb"] for s in post), default=float("nan"))
    growth = (peak - base) / base if post else float("nan")
    errors = sum(v for k, v in rec.codes.items() if k != "ok") + rec.timeouts + rec.connection_errors

    def drift(a: dict[str, Any]) -> float:
        return abs(last["p99_ms"] - a["p99_ms"]) / a["p99_ms"] if a["requests"] else float("inf")

    checks = {
        "no_errors": errors == 0 and len(rec.t_end) > 0,
        "rss_growth": bool(growth <= args.rss_growth),
        "p99_stable": drift(after_warmup) <= args.p99_band,
        "p99_stable_from_start": drift(first) <= args.p99_band,
    }
    store: dict[str, Any] = {}
    if args.feedback:
        store = _store_summary(post, args, max(w["rps"] for w in per_minute))
        checks["feedback_accepted"] = set(rec.feedback) == {"accepted"}
        checks["store_flat"] = bool(store["growth_fraction"] <= args.store_growth)
        checks["store_within_retention"] = bool(0 <= store["peak_rows"] <= store["rows_bound"])
    summary = {
        "requests": len(rec.t_end),
        "answers_by_code": dict(sorted(rec.codes.items())),
        "timeouts": rec.timeouts,
        "connection_errors": rec.connection_errors,
        "errors": errors,
        "rss_mb": {
            "after_warmup": base,
            "peak_after_warmup": peak,
            "end": rec.samples[-1]["rss_mb"],
            "growth_fraction": round(growth, 4),
            "bound": args.rss_growth,
        },
        "p99": {
            "first_window": first,
            "first_window_after_warmup": after_warmup,
            "last_window": last,
            "change_vs_after_warmup": round(drift(after_warmup), 4),
            "change_vs_first": round(drift(first), 4),
            "band": args.p99_band,
        },
        "per_minute": per_minute,
    }
    if args.feedback:
        summary["feedback_by_status"] = dict(sorted(rec.feedback.items()))
        summary["store"] = store
    return summary, checks


def _store_summary(post: list[dict[str, float]], args: argparse.Namespace, rps: float) -> dict[str, Any]:
    """The store's bytes after the warm-up against their peak, and its largest row count against what retention
    allows: the cap, plus the rows answered (at the busiest minute's rate ``rps``) between two of the writer's
    retention passes, plus one writer batch."""
    from service.store.store import StoreConfig

    cfg = StoreConfig(url="")
    sized = [s for s in post if s.get("store_rows", -1) >= 0]
    base = sized[0]["store_bytes"] if sized else float("nan")
    peak = max((s["store_bytes"] for s in sized), default=float("nan"))
    return {
        "bytes_after_warmup": base,
        "peak_bytes_after_warmup": peak,
        "growth_fraction": round((peak - base) / base, 4) if sized and base else float("nan"),
        "bound": args.store_growth,
        "peak_rows": max((int(s["store_rows"]) for s in sized), default=-1),
        "max_rows": args.store_max_rows,
        "rows_bound": int(args.store_max_rows + rps * cfg.retention_interval_s + cfg.flush_rows),
        "retention_interval_s": cfg.retention_interval_s,
    }


def plot(rec: Record, summary: dict[str, Any], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot([s["t_s"] / 60 for s in rec.samples], [s["rss_mb"] for s in rec.samples], lw=1.2)
    a.set_ylabel("server RSS (MiB)")
    a.set_title(title, fontsize=9)
    mins = [w["from_min"] + 0.5 for w in summary["per_minute"]]
    b.plot(mins, [w["p50_ms"] for w in summary["per_minute"]], marker=".", label="p50")
    b.plot(mins, [w["p99_ms"] for w in summary["per_minute"]], marker=".", label="p99")
    b.set_ylabel("latency per minute (ms)")
    b.set_xlabel("minutes of load")
    b.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked: the load bounded, the warm-up and a p99 window inside the soak."""
    p = harness.load_parser(__doc__, "soak_<name>.json")
    p.add_argument("--minutes", type=float, default=30.0, help="length of the soak, warm-up included")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="the first minutes, before RSS is the baseline")
    p.add_argument("--window-minutes", type=float, default=5.0, help="the p99 windows compared")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument(
        "--store-max-rows",
        type=int,
        default=5_000,
        help="HYDRA_STORE_MAX_ROWS: the rows kept (full within the warm-up)",
    )
    p.add_argument("--feedback", action="store_true", help="label every answer (its own top label) by feedback")
    harness.add_bands(
        p,
        {
            "rss-growth": (0.05, "RSS growth after the warm-up"),
            "p99-band": (0.20, "p99 change, last window vs first"),
            "store-growth": (0.10, "store growth after the warm-up"),
        },
    )
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 64 or not 0 < args.minutes <= 240 or args.sample_s <= 0:
        p.error("--clients must be in 1..64, --minutes in (0, 240] and --sample-s positive")
    if args.warmup_minutes + args.window_minutes > args.minutes or args.window_minutes <= 0:
        p.error("the warm-up and a p99 window must fit in --minutes")
    return args


def _print_summary(summary: dict[str, Any], window_minutes: float) -> None:
    """One line: requests, errors, RSS growth after the warm-up and the p99 of the windows."""
    r, q = summary["rss_mb"], summary["p99"]
    print(
        f"{summary['requests']} requests, errors {summary['errors']}; RSS {r['after_warmup']} -> peak "
        f"{r['peak_after_warmup']} MiB after the warm-up ({100 * r['growth_fraction']:+.1f} %); p99 "
        f"{q['first_window']['p99_ms']} (first {window_minutes:g} min), "
        f"{q['first_window_after_warmup']['p99_ms']} (after the warm-up), {q['last_window']['p99_ms']} ms (last)"
    )
    if "store" in summary:
        st = summary["store"]
        print(
            f"feedback {summary['feedback_by_status']}; store {st['bytes_after_warmup'] / 2**20:.1f} -> peak "
            f"{st['peak_bytes_after_warmup'] / 2**20:.1f} MiB after the warm-up "
            f"({100 * st['growth_fraction']:+.1f} %), at most {st['peak_rows']} rows (bound {st['rows_bound']})"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    tmp, artifact, manifest, body = harness.open_run(args, "hydra-soak-")
    name = manifest["name"]
    state = Path(tmp.name) / "state"  # the store lives with the run, not in the user's state folder
    env = {"HYDRA_LOG_LEVEL": "warning", "HYDRA_STATE_DIR": str(state)}
    if args.feedback:
        env["HYDRA_STORE_MAX_ROWS"] = str(args.store_max_rows)
    port = harness.free_port()
    log_file = Path(tmp.name) / "server.log"
    print(
        f"starting python -m service on {harness.HOST}:{port} with {artifact}; {args.clients} clients for "
        f"{args.minutes:g} min on {harness.cpu_name()}",
        flush=True,
    )
    proc = harness.start_server(artifact, port, env, log_file=log_file)
    try:
        ready_s = harness.wait_ready(port, proc)
        asyncio.run(harness.burst(port, body))
        rec = asyncio.run(soak(port, proc.pid, body, args, name, state))
        alive = proc.poll() is None
    finally:
        exit_status = harness.stop_server(proc)
    summary, checks = summarise(rec, args)
    checks["server_alive"] = alive
    checks["exit_status_0_on_sigterm"] = exit_status == 0
    result = {
        **harness.result_head("soak", argv, name, args, artifact),
        "clients": args.clients,
        "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes,
        "ready_s": round(ready_s, 1),
        "server_env": {k: v for k, v in env.items() if k != "HYDRA_STATE_DIR"},
        "feedback": args.feedback,
        **summary,
        "rss_samples": rec.samples,
        "checks": checks,
        "passed": all(checks.values()),
        "server_exit_status": exit_status,
        "server_log_tail": log_file.read_text(errors="replace").splitlines()[-20:],
    }
    out = harness.save_run(result, args.out, f"soak_{name}.json")
    png = out.with_suffix(".png")
    plot(
        rec,
        summary,
        f"soak of {name}: {args.clients} clients, {args.minutes:g} min, {harness.cpu_name()} "
        f"({harness.machine()['cpus']} cores)",
        png,
    )
    _print_summary(summary, args.window_minutes)
    return harness.close_run(tmp, checks, f"{out} and {png}", result["passed"])


if __name__ == "__main__":
    sys.exit(main())
