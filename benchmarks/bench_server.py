"""Server throughput and latency against the raw model and a bare frontend, driven from outside by ``wrk``.

Starts ``python -m service`` on 127.0.0.1 (loopback only) with one artifact, once per ``--workers`` value
(``HYDRA_WORKERS``), and the floor (``benchmarks/floor_server.py``: a bare FastAPI endpoint that decodes the
same base64 PNG, normalises it and answers with ``orjson``; image artifacts), then drives each with ``wrk`` (Debian's
package: a C client that is not the bottleneck) at every ``--connections`` level, the servers' order alternating
per level so that load drift hits them alike. Per server and level: requests/s, p50 / p90 / p99 latency, the CPU
milliseconds per request of the server's whole process group (its workers included) and the mean batch the server
formed (``hydra_batch_size``). The raw model (the backend the server chose, same threads) is timed at each batch
size before and after, the better run kept, and so is the artifact's Single model (``benchmarks/single.py``: the
unpruned base architecture, exported by the same exporters, on the same backend, precision and threads).
Ratios: server / raw Single's best batch (the headline: answers per second with every uncertainty field, over what
the single model alone computes), server / raw model's best batch, server / floor, workers N / workers 1, p50 at 1
connection minus the raw batch-1 latency, p99 / p50.

    python -m benchmarks.bench_server --artifact artifacts/default/image
    python -m benchmarks.bench_server --tiny vit --server-cpus 0 --wrk-cpus 1   # one core each, as the floor row
    python -m benchmarks.bench_server --tiny vit --workers 1 2                   # HYDRA_WORKERS=2 against =1

Writes ``benchmarks/results/server/<name>[-<tag>].json`` and ``.md``; name the CPU with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the raw model runs under the server's OpenMP setting (the server sets it too), set before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks import harness
from benchmarks.wrk import group_cpu_s, post_script, run_wrk

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "floor"


def batch_stats(port: int) -> tuple[float, float]:
    """(sum, count) of the server's ``hydra_batch_size`` histogram over all models."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    _, _, data = asyncio.run(harness.request(port, "GET", "/metrics", timeout=10.0))
    total = count = 0.0
    for fam in text_string_to_metric_families(data.decode()):
        if fam.name == "hydra_batch_size":
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count


def _inputs(artifact: Path, body: dict[str, Any]) -> tuple[Any, Any]:
    """The artifact's preprocessor and the request body's one input, preprocessed."""
    from service.core.artifact import load_manifest
    from service.core.preprocess import ImagePreprocessor, decode_base64, make_preprocessor

    pre = make_preprocessor(load_manifest(artifact).preprocessing, artifact, 10**9)
    if isinstance(pre, ImagePreprocessor):
        return pre, pre(decode_base64(body["image"], "image"))
    return pre, pre.encode([body["text"]])[0]


def single_of(artifact: Path, body: dict[str, Any], out: Path) -> Path:
    """The artifact's Single model (:mod:`benchmarks.single`) in ``out``, traced on the body's input."""
    from benchmarks.single import single_artifact

    pre, item = _inputs(artifact, body)
    return single_artifact(artifact, out, pre.collate([item] * 2))


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
    from service.runtime.plan import Plan, load_backend

    if threads:
        torch.set_num_threads(threads)
    manifest = load_manifest(artifact)
    backend = load_backend(
        artifact, manifest, Plan(plan["backend"], plan["device"], plan["precision"], "bench"), threads=threads
    )
    pre, item = _inputs(artifact, body)
    out = {}
    for b in batches:
        inputs = pre.collate([item] * b)
        backend(inputs)  # warm-up for this shape
        times = []
        t_end = time.perf_counter() + min_seconds
        while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 2000):
            t0 = time.perf_counter()
            backend(inputs)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out[str(b)] = {"batch": b, "latency_ms": round(med * 1000, 4), "throughput_ips": round(b / med, 2)}
        print(f"  batch {b:3d}: {b / med:9.1f} inputs/s  ({med * 1000:.3f} ms per batch)", flush=True)
    return out


def best_raw(raw_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The better of the raw runs per batch size: the server is compared with the raw model at its best."""
    return {b: max((run[b] for run in raw_runs), key=lambda r: r["throughput_ips"]) for b in raw_runs[0]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_artifact_arguments(p)
    p.add_argument("--connections", type=int, nargs="+", default=[1, 32, 64, 256], help="wrk connection levels")
    p.add_argument("--seconds", type=float, default=10.0, help="wrk's run per level (after a 2 s warm-up)")
    p.add_argument("--workers", nargs="+", default=["1"], help="HYDRA_WORKERS of each server (auto or N)")
    p.add_argument("--no-floor", action="store_true", help="do not run the bare FastAPI floor beside the server")
    p.add_argument("--server-cpus", default=None, help="pin the servers to these CPUs (taskset list, e.g. 0)")
    p.add_argument("--wrk-cpus", default=None, help="pin wrk to these CPUs (e.g. 1)")
    p.add_argument("--wrk-threads", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "torchscript", "onnx", "aoti"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="HYDRA_DEVICE")
    p.add_argument("--max-batch", type=int, default=32, help="HYDRA_MAX_BATCH")
    p.add_argument("--threads", type=int, default=None, help="HYDRA_THREADS (torch / ORT intra-op threads)")
    p.add_argument("--store", default="on", choices=["on", "off"], help="HYDRA_STORE (a fresh SQLite store)")
    p.add_argument("--raw-seconds", type=float, default=3.0, help="time per batch size for the raw model")
    p.add_argument("--tag", default="", help="added to the result's file name")
    p.add_argument("--out", type=Path, default=None, help="result folder (default benchmarks/results/server)")
    args = p.parse_args(argv)
    if any(not 1 <= c <= 4096 for c in args.connections) or not 0 < args.seconds <= 600:
        p.error("--connections must be in 1..4096 and --seconds in (0, 600]")
    return args


def server_env(args: argparse.Namespace, workers: str, state_dir: str) -> dict[str, str]:
    """A server's environment: the backend, precision, device, batching, workers and a store of its own."""
    env = {
        "HYDRA_BACKEND": args.backend,
        "HYDRA_PRECISION": args.precision,
        "HYDRA_DEVICE": args.device,
        "HYDRA_MAX_BATCH": str(args.max_batch),
        "HYDRA_MAX_QUEUE": str(max(1024, 4 * max(args.connections))),
        "HYDRA_LOG_LEVEL": "warning",
        "HYDRA_WORKERS": workers,
        "HYDRA_STORE": "true" if args.store == "on" else "false",
        "HYDRA_STATE_DIR": state_dir,
    }
    if args.threads:
        env["HYDRA_THREADS"] = str(args.threads)
    return env


def start(args: argparse.Namespace, artifact: Path, name: str, tmp: Path) -> Any:
    """One server (``name``: ``workers=<N>``) or the floor: ``(process, port)`` once it is ready."""
    import subprocess

    port = harness.free_port()
    prefix = ["taskset", "-c", args.server_cpus] if args.server_cpus else []
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (the child holds its own descriptor)
    if name == FLOOR:
        cmd = [*prefix, sys.executable, "-m", "benchmarks.floor_server", "--port", str(port)]
        env = harness.server_env(artifact, port)
    else:
        workers = name.split("=", 1)[1]
        state = tmp / f"state-{workers}"
        state.mkdir(exist_ok=True)
        cmd = [*prefix, sys.executable, "-m", "service"]
        env = harness.server_env(artifact, port, server_env(args, workers, str(state)))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    harness.wait_ready(port, proc, timeout=300)
    return proc, port


def settle(servers: dict[str, Any], limit_s: float = 60.0) -> None:
    """Wait until every server is idle (its process group uses under 3 % of a core): what a server still does after
    its run (the store's writer emptying its queue) must not be measured as the next server's load."""
    t_end = time.monotonic() + limit_s
    while time.monotonic() < t_end:
        before = [group_cpu_s(proc.pid) for proc, _ in servers.values()]
        time.sleep(0.5)
        after = [group_cpu_s(proc.pid) for proc, _ in servers.values()]
        if all(b - a < 0.015 for a, b in zip(before, after, strict=True)):
            return


def level(args: argparse.Namespace, server: Any, script: Path, connections: int, floor: bool) -> dict[str, Any]:
    """One connection level against one server: a 2 s warm-up, then the measured run."""
    proc, port = server
    url = f"http://{harness.HOST}:{port}/predict"
    run_wrk(url, script, connections, 2.0, args.wrk_threads, args.wrk_cpus)
    b0 = (0.0, 0.0) if floor else batch_stats(port)
    cpu0 = group_cpu_s(proc.pid)
    res = run_wrk(url, script, connections, args.seconds, args.wrk_threads, args.wrk_cpus)
    cpu1 = group_cpu_s(proc.pid)
    b1 = (0.0, 0.0) if floor else batch_stats(port)
    out = res.as_dict()
    out["cpu_ms_per_request"] = round(1000 * (cpu1 - cpu0) / max(res.requests, 1), 4)
    out["mean_batch"] = None if floor else round((b1[0] - b0[0]) / max(b1[1] - b0[1], 1), 2)
    return out


def drive(args: argparse.Namespace, artifact: Path, body: dict[str, Any], image: bool) -> dict[str, list[dict]]:
    """Every server at every level, the servers' order alternating per level."""
    names = [f"workers={w}" for w in args.workers] + ([] if args.no_floor or not image else [FLOOR])
    out: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="hydra-bench-") as tmp:
        script = post_script(Path(tmp) / "post.lua", json.dumps(body).encode())
        floor_script = post_script(Path(tmp) / "floor.lua", json.dumps({"image": body.get("image", "")}).encode())
        servers = {}
        try:
            for n in names:
                servers[n] = start(args, artifact, n, Path(tmp))
            for i, c in enumerate(args.connections):
                for n in names if i % 2 == 0 else names[::-1]:
                    settle(servers)
                    r = level(args, servers[n], floor_script if n == FLOOR else script, c, n == FLOOR)
                    r["rss_mb"] = harness.group_rss_mb(servers[n][0].pid)  # each process: supervisor, workers
                    out[n].append(r)
                    print(
                        f"  {n:>10} {c:4d} connections: {r['rps']:9.1f} req/s  p50 {r['p50_ms']:8.2f} ms  p99 "
                        f"{r['p99_ms']:8.2f} ms  cpu {r['cpu_ms_per_request']:.3f} ms/req  batch {r['mean_batch']}"
                        f"  errors {r['socket_errors'] or 0} non-2xx {r['non_2xx']}",
                        flush=True,
                    )
        finally:
            for proc, _ in servers.values():
                harness.stop_server(proc)
    return out


def ratios(
    servers: dict[str, list[dict]], raw: dict[str, Any], connections: list[int], single: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The issue's ratios from the measured levels (``single``: the raw Single model's runs, best per batch)."""
    best = max(r["throughput_ips"] for r in raw.values())
    at = {n: {r["connections"]: r for r in rows} for n, rows in servers.items()}
    first = next(n for n in at if n != FLOOR)
    out: dict[str, Any] = {"raw_best_ips": best}
    if single:
        out["single_best_ips"] = max(r["throughput_ips"] for r in single.values())
        out["raw_over_single"] = round(best / out["single_best_ips"], 3)
    for n, rows in at.items():
        if n == FLOOR:
            continue
        out[n] = {}
        if single:
            out[n] = {f"server_over_single_at_{c}": round(rows[c]["rps"] / out["single_best_ips"], 3) for c in rows}
        out[n].update({f"server_over_raw_at_{c}": round(rows[c]["rps"] / best, 3) for c in connections if c in rows})
        if FLOOR in at:
            out[n].update({f"server_over_floor_at_{c}": round(rows[c]["rps"] / at[FLOOR][c]["rps"], 3) for c in rows})
        if 1 in rows and "1" in raw:
            out[n]["p50_at_1_minus_raw_batch1_ms"] = round(rows[1]["p50_ms"] - raw["1"]["latency_ms"], 3)
        if 64 in rows:
            out[n]["p99_over_p50_at_64"] = round(rows[64]["p99_ms"] / rows[64]["p50_ms"], 2)
        if n != first:
            out[n].update({f"over_{first}_at_{c}": round(rows[c]["rps"] / at[first][c]["rps"], 3) for c in rows})
    return out


def markdown(doc: dict[str, Any]) -> str:
    machine = (
        f"{doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs. Backend {doc['backend']}, "
        f"{doc['device']}, {doc['precision']}. Client: wrk ({doc['settings']['wrk_threads']} threads"
        + (f", pinned to CPUs {doc['settings']['wrk_cpus']}" if doc["settings"]["wrk_cpus"] else "")
        + ")"
        + (f"; servers pinned to CPUs {doc['settings']['server_cpus']}" if doc["settings"]["server_cpus"] else "")
        + f"; {doc['settings']['seconds']:g} s per level after a 2 s warm-up. Raw model best: "
        f"{doc['ratios']['raw_best_ips']:.0f} inputs/s"
        + (
            f"; raw Single best: {doc['ratios']['single_best_ips']:.0f} inputs/s (same backend, precision, threads)."
            if "single_best_ips" in doc["ratios"]
            else "."
        )
    )
    lines = [
        *harness.page_head(f"Server against the raw model and the floor: {doc['name']}", doc, machine),
        "",
        "| server | connections | requests/s | p50 ms | p99 ms | CPU ms / request | mean batch | errors | largest "
        "process RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, rows in doc["servers"].items():
        for r in rows:
            errs = sum(r["socket_errors"].values()) + r["non_2xx"]
            rss = max((m.get("rss", 0.0) for m in r.get("rss_mb", {}).values()), default=None)
            lines.append(
                f"| {n} | {r['connections']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{r['cpu_ms_per_request']:.3f} | {r['mean_batch'] if r['mean_batch'] is not None else '–'} | {errs} | "
                f"{'–' if rss is None else f'{rss:.0f}'} |"
            )
    lines += [
        "",
        "Raw model: "
        + ", ".join(
            f"batch {r['batch']} {r['throughput_ips']:.0f} inputs/s ({r['latency_ms']:.3f} ms)"
            for r in doc["raw"].values()
        ),
        "",
        "Raw Single: "
        + ", ".join(
            f"batch {r['batch']} {r['throughput_ips']:.0f} inputs/s ({r['latency_ms']:.3f} ms)"
            for r in doc.get("single", {}).values()
        ),
        "",
        "```json",
        json.dumps({k: v for k, v in doc["ratios"].items()}, indent=1),
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="hydra-bench-")
    artifact, doc = harness.open_artifact(args, Path(tmp.name), full=True)
    from service.core.artifact import load_manifest
    from service.runtime.plan import resolve_plan

    manifest = load_manifest(artifact)
    body = harness.payload(doc)
    resolved = resolve_plan(manifest, device=args.device, backend=args.backend, precision=args.precision)
    plan = {"backend": resolved.backend, "device": resolved.device, "precision": resolved.precision}
    batches = sorted({1, *[c for c in args.connections if c <= args.max_batch], args.max_batch})
    single_dir = single_of(artifact, body, Path(tmp.name) / "single")
    legs = {"Hydra": artifact, "Single": single_dir}
    runs: dict[str, list[dict[str, Any]]] = {leg: [] for leg in legs}
    for when in ("before", "after"):
        if when == "after":
            servers = drive(args, artifact, body, "image" in body)
        for leg, path in legs.items():
            print(f"raw {leg}, {when} the servers ({plan['backend']}, {plan['device']}, {plan['precision']}):")
            runs[leg].append(raw_throughput(path, plan, body, batches, args.raw_seconds, args.threads))
    raw_runs, raw = runs["Hydra"], best_raw(runs["Hydra"])
    single = best_raw(runs["Single"])
    result = {
        **harness.result_head("bench_server", argv, manifest.name, args, artifact),
        "family": manifest.family,
        "members": manifest.members,
        **plan,
        "settings": {
            "max_batch": args.max_batch,
            "threads": args.threads,
            "store": args.store,
            "seconds": args.seconds,
            "wrk_threads": args.wrk_threads,
            "wrk_cpus": args.wrk_cpus,
            "server_cpus": args.server_cpus,
        },
        "machine": harness.machine(),
        "servers": servers,
        "raw": raw,
        "raw_runs": raw_runs,
        "single": single,
        "single_runs": runs["Single"],
        "ratios": ratios(servers, raw, args.connections, single),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stem = manifest.name + (f"-{args.tag}" if args.tag else "")
    out_dir = args.out or ROOT / "benchmarks" / "results" / "server"
    path = harness.write_result(result, out_dir / f"{stem}.json", f"server/{stem}.json")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    print(json.dumps(result["ratios"], indent=1))
    print(f"wrote {path}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
