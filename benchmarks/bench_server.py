"""Server throughput and latency vs the raw fused model, in one run.

Starts ``python -m service`` on 127.0.0.1 (loopback only) in a subprocess with one
artifact, drives ``POST /predict`` with a bounded number of concurrent clients
(1, 8 and 32 by default; each level bounded in requests and seconds), and reports
throughput and p50 / p95 / p99 latency next to the raw model's throughput at the
same batch sizes (the backend the server chose, same threads, measured before
and after the server ran, the better run kept). Target: at concurrency 32 the server delivers >= 80% of the raw
model's best throughput. Writes ``benchmarks/results/server_<name>.json``.

    python -m benchmarks.bench_server --artifact artifacts/default/image
    python -m benchmarks.bench_server --tiny vit --requests 300     # a tiny random artifact, to check the script

The clients (a minimal HTTP/1.1 client on asyncio streams, JSON bodies) run on
the same machine as the server and take some CPU from it: on a 2-core machine
that is part of what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# the raw model runs under the server's OpenMP setting (the server sets it too), set before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]


def batch_stats(url: str) -> tuple[float, float]:
    """(sum, count) of the server's ``hydra_batch_size`` histogram over all models."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        if fam.name == "hydra_batch_size":
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count


async def drive(port: int, body: dict[str, Any], concurrency: int, requests: int, duration: float) -> dict[str, Any]:
    """``concurrency`` clients in a loop until ``requests`` answers or ``duration`` seconds; latencies in ms."""
    data = json.dumps(body).encode()
    conns = [harness.Connection(port) for _ in range(concurrency)]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    sent = 0
    for conn in conns[: min(concurrency, 4)]:  # open connections, fill caches
        await conn.request("POST", "/predict", data)
    t_start = time.perf_counter()
    deadline = t_start + duration

    async def worker(conn: harness.Connection) -> None:
        nonlocal sent
        while sent < requests and time.perf_counter() < deadline:
            sent += 1
            t0 = time.perf_counter()
            status, _, answer = await conn.request("POST", "/predict", data)
            if status == 200:
                latencies.append((time.perf_counter() - t0) * 1000)
            else:
                code = json.loads(answer).get("error", {}).get("code", str(status))
                errors[code] = errors.get(code, 0) + 1

    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t_start
    for conn in conns:
        await conn.close()
    q = np.percentile(latencies, [50, 95, 99]) if latencies else [float("nan")] * 3
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": errors,
        "seconds": round(wall, 3),
        "throughput_rps": round(len(latencies) / wall, 2),
        "p50_ms": round(float(q[0]), 2),
        "p95_ms": round(float(q[1]), 2),
        "p99_ms": round(float(q[2]), 2),
    }


def raw_throughput(
    artifact: Path,
    plan: dict[str, str],
    body: dict[str, Any],
    batches: list[int],
    min_seconds: float,
    threads: int | None,
) -> dict[str, Any]:
    """The backend the server chose, alone: inputs/s of one forward pass at each batch size (median of runs)."""
    import torch

    from service.core.artifact import load_manifest
    from service.core.preprocess import ImagePreprocessor, decode_base64, make_preprocessor
    from service.runtime.plan import Plan, load_backend

    if threads:
        torch.set_num_threads(threads)
    manifest = load_manifest(artifact)
    backend = load_backend(
        artifact, manifest, Plan(plan["backend"], plan["device"], plan["precision"], "bench"), threads=threads
    )
    pre = make_preprocessor(manifest.preprocessing, artifact, 10**9)
    if isinstance(pre, ImagePreprocessor):
        item = pre(decode_base64(body["image"], "image"))
    else:
        item = pre.encode([body["text"]])[0]
    out = {}
    for b in batches:
        inputs = pre.collate([item] * b)
        backend(inputs)  # warm-up for this shape
        times = []
        t_end = time.perf_counter() + min_seconds
        while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 200):
            t0 = time.perf_counter()
            backend(inputs)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out[str(b)] = {
            "batch": b,
            "latency_ms": round(med * 1000, 3),
            "throughput_ips": round(b / med, 2),
            "runs": len(times),
        }
        print(f"  batch {b:3d}: {b / med:9.1f} inputs/s  ({med * 1000:.2f} ms per batch)", flush=True)
    return out


def check_served(server: tuple[Any, int], name: str, plan: dict[str, str]) -> None:
    """The server is ready and runs the backend, device and precision the raw model is measured with."""
    import httpx

    proc, port = server
    try:
        harness.wait_ready(port, proc, timeout=300)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    models = httpx.get(f"http://{harness.HOST}:{port}/v1/models", timeout=5).json()["models"]
    (model,) = [m for m in models if m["name"] == name]
    served = {k: model[k] for k in ("backend", "device", "precision")}
    if served != plan:
        raise SystemExit(f"the server runs {served}, the raw model was measured with {plan}")
    print(f"{name}: backend {plan['backend']}, device {plan['device']}, precision {plan['precision']}", flush=True)


def drive_level(port: int, body: dict[str, Any], c: int, requests: int, duration: float) -> dict[str, Any]:
    """One concurrency level against the server on ``port``, with the mean batch size it formed meanwhile."""
    url = f"http://{harness.HOST}:{port}"
    s0, n0 = batch_stats(url)
    res = asyncio.run(drive(port, body, c, requests, duration))
    s1, n1 = batch_stats(url)
    return {**res, "mean_batch": round((s1 - s0) / max(n1 - n0, 1), 2)}


def _plan_tuple(p: Any) -> tuple[str, str, str]:
    return p.backend, p.device, p.precision


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_artifact_arguments(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="client counts (each <= 64)")
    p.add_argument("--requests", type=int, default=200, help="most requests per concurrency level")
    p.add_argument("--duration", type=float, default=30.0, help="most seconds per concurrency level")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "torchscript", "onnx", "aoti"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="HYDRA_DEVICE")
    p.add_argument("--max-batch", type=int, default=32, help="HYDRA_MAX_BATCH")
    p.add_argument("--max-wait-ms", type=float, default=None, help="HYDRA_MAX_WAIT_MS (default: the server's)")
    p.add_argument("--threads", type=int, default=None, help="HYDRA_THREADS (torch / ORT intra-op threads)")
    p.add_argument("--raw-seconds", type=float, default=3.0, help="time per batch size for the raw model")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default benchmarks/results/server_<name>.json)")
    p.add_argument(
        "--batch-fill",
        nargs="+",
        default=["in_system"],
        choices=["in_system", "recent"],
        help="HYDRA_BATCH_FILL: several start one server each, driven in turn at every level (the order "
        "alternating per level), so the rules are compared side by side in one run",
    )
    args = p.parse_args(argv)
    if any(not 1 <= c <= 64 for c in args.concurrency):
        p.error("--concurrency values must be between 1 and 64")
    if not 1 <= args.requests <= 100_000 or not 0 < args.duration <= 600:
        p.error("--requests must be in 1..100000 and --duration in (0, 600]")
    return args


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The servers' environment: the backend, precision, device and batching the run asks for."""
    env = {
        "HYDRA_BACKEND": args.backend,
        "HYDRA_PRECISION": args.precision,
        "HYDRA_DEVICE": args.device,
        "HYDRA_MAX_BATCH": str(args.max_batch),
        "HYDRA_MAX_QUEUE": str(max(1024, 4 * max(args.concurrency))),
        "HYDRA_LOG_LEVEL": "warning",
    }
    if args.max_wait_ms is not None:
        env["HYDRA_MAX_WAIT_MS"] = str(args.max_wait_ms)
    if args.threads:
        env["HYDRA_THREADS"] = str(args.threads)
    return env


def drive_servers(
    args: argparse.Namespace, artifact: Path, name: str, plan: dict[str, str], body: Any
) -> dict[str, list[dict[str, Any]]]:
    """One server per batch fill rule, each driven at every concurrency level (the rules' order alternating per
    level, so load drift hits them alike); the levels' results per rule."""
    env = server_env(args)
    servers = {}  # batch fill rule -> (process, port)
    by_fill: dict[str, list[dict[str, Any]]] = {f: [] for f in args.batch_fill}
    try:
        for fill in args.batch_fill:
            port = harness.free_port()
            print(f"starting the server (HYDRA_BATCH_FILL={fill}) on port {port} with {artifact}", flush=True)
            proc = harness.start_server(artifact, port, {**env, "HYDRA_BATCH_FILL": fill}, inherit_output=True)
            servers[fill] = (proc, port)
            check_served(servers[fill], name, plan)
        for i, c in enumerate(args.concurrency):
            for fill in args.batch_fill if i % 2 == 0 else args.batch_fill[::-1]:
                res = drive_level(servers[fill][1], body, c, args.requests, args.duration)
                by_fill[fill].append({**res, "batch_fill": fill})
                print(
                    f"  {fill:>9} concurrency {c:3d}: {res['throughput_rps']:9.1f} req/s  p50 {res['p50_ms']:8.1f} "
                    f"ms  p95 {res['p95_ms']:8.1f} ms  p99 {res['p99_ms']:8.1f} ms  mean batch "
                    f"{res['mean_batch']:5.1f}  errors {res['errors'] or 0}",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            harness.stop_server(proc)
    return by_fill


def best_raw(raw_runs: list[dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """The better of the raw runs per batch size: the server is compared with the raw model at its best."""
    raw = {b: max((run[b] for run in raw_runs), key=lambda r: r["throughput_ips"]) for b in raw_runs[0]}
    print("raw model, the better of the two runs:")
    for r in raw.values():
        print(f"  batch {r['batch']:3d}: {r['throughput_ips']:9.1f} inputs/s  ({r['latency_ms']:.2f} ms per batch)")
    return raw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="hydra-bench-")
    artifact, doc = harness.open_artifact(args, Path(tmp.name))
    from service.core.artifact import load_manifest
    from service.runtime.plan import resolve_plan

    manifest = load_manifest(artifact)
    body = harness.payload(doc)
    # the backend the server will pick (checked against /v1/models below); raw runs before and after the server
    resolved = resolve_plan(manifest, device=args.device, backend=args.backend, precision=args.precision)
    plan = dict(zip(("backend", "device", "precision"), _plan_tuple(resolved), strict=True))
    batches = sorted(set(args.concurrency))
    print(f"raw model, before the server ({plan['backend']}, {plan['device']}, {plan['precision']}):", flush=True)
    raw_runs = [raw_throughput(artifact, plan, body, batches, args.raw_seconds, args.threads)]
    by_fill = drive_servers(args, artifact, manifest.name, plan, body)
    levels = by_fill[args.batch_fill[0]]
    print("raw model, after the server:", flush=True)
    raw_runs.append(raw_throughput(artifact, plan, body, batches, args.raw_seconds, args.threads))
    raw = best_raw(raw_runs)
    top_raw = max(r["throughput_ips"] for r in raw.values())
    top = max(levels, key=lambda x: x["concurrency"])
    ratio = top["throughput_rps"] / top_raw if top_raw else float("nan")
    print(f"server at concurrency {top['concurrency']} / best raw = {ratio:.2f} (target >= 0.80)")
    where = artifact.resolve()
    result = {
        "name": manifest.name,
        "artifact": f"tiny {args.tiny} (random weights)"
        if args.tiny
        else (str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(artifact)),
        "family": manifest.family,
        "members": manifest.members,
        **plan,
        "settings": {
            "max_batch": args.max_batch,
            "max_wait_ms": args.max_wait_ms or "server default",
            "batch_fill": args.batch_fill,
            "threads": args.threads,
            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        },
        "machine": harness.machine(),
        "server": levels,
        "server_by_batch_fill": by_fill,
        "raw": raw,
        "raw_runs": raw_runs,
        "ratio_top_concurrency_vs_best_raw": round(ratio, 3),
        "target": 0.8,
        "target_met": bool(ratio >= 0.8),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = harness.write_result(result, args.out, f"server_{manifest.name}.json")
    print(f"wrote {out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
