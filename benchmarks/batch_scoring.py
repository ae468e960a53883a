"""``hydra-predict`` against the raw model, the server and itself on Ray, its memory on a long input, and its label-free
accuracy estimate against the truth, on the default image and text artifacts and their data's test split.

Per artifact, side by side in one run (every leg with the settings' defaults: the same backend, precision, device):

* **raw**: the same decode (the files read, the server's preprocessing) and the model's pass, one batch after another
  in one thread, at batch 16, 32, 64 and 128: the best rate, measured before and after the other legs (the better
  kept). Nothing else: no uncertainty, no guarantees, no output.
* **batch**: ``python -m service.batch`` in-process (its ``scored_now`` rate: from its first input to its last part
  written, the model loaded), at the raw model's best batch, in parts of 500 rows, twice (the better kept);
* **ray**: the same with ``--engine ray --actors 2`` (each actor one thread; Ray's own start left out, the actors'
  model loads in);
* **server**: ``python -m service`` (``HYDRA_WORKERS=auto``) driven by ``wrk`` with one input per request at 64
  connections, its best level on this machine (``benchmarks/results/server/``), 10 s after a 2 s warm-up.

Then: peak memory of ``--memory-inputs`` texts (100,000 by default) through the text artifact, sampled every 0.2 s,
at each tenth of the run (flat: the last tenth's peak within 10 % of the first's); and the batch summary's label-free
accuracy estimate on the test split (every input once) against the accuracy of the same rows by the data set's own
labels.

    python -m benchmarks.batch_scoring --image artifacts/default/image --text artifacts/default/text

Writes ``benchmarks/results/batch/summary.json`` and ``.md``; the machine is named in both.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from PIL import Image

from benchmarks import harness, result_json
from benchmarks.bench_server import drive
from benchmarks.bench_server import parse_args as server_args
from benchmarks.cli_args import parse_positive, parser
from offline.config import load_config
from offline.data import load
from service.runtime import load_runtime
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"image": "offline/configs/image-fast.yaml", "text": "offline/configs/text-fast.yaml"}
BATCHES = (16, 32, 64, 128)
PART = 500  # rows per part in every leg: 16 parts of the default 8,000 inputs, so that both Ray actors have work


def test_split(modality: str) -> tuple[list[Any], list[str]]:
    """The setting's test split as the artifact's build drew it: inputs and their labels by the data set's names."""
    data = load(load_config(ROOT / CONFIGS[modality]).data)
    return list(data.test.inputs), [data.class_names[int(y)] for y in data.test.labels]


def write_inputs(modality: str, inputs: list[Any], n: int, folder: Path) -> tuple[Path, list[Path | str]]:
    """``n`` inputs (the split cycled) as a user has them: PNG files in a folder, or a CSV with a ``text`` column."""
    folder.mkdir(parents=True, exist_ok=True)
    if modality == "image":
        files = []
        for i in range(n):
            path = folder / f"{i:06d}.png"
            Image.fromarray(np.asarray(inputs[i % len(inputs)], dtype=np.uint8)).save(path)
            files.append(path)
        return folder, list(files)
    path = folder / "texts.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        w.writerows([[inputs[i % len(inputs)]] for i in range(n)])
    return path, [inputs[i % len(inputs)] for i in range(n)]


def raw_rate(artifact: Path, raws: list[Path | str]) -> dict[int, float]:
    """Inputs per second of decode + preprocessing + the model's pass alone, per batch size."""
    rt = load_runtime(artifact, Settings(store=False))
    assert rt.backend is not None  # type: ignore[attr-defined]
    out = {}
    for b in BATCHES:
        t0 = time.perf_counter()
        for i in range(0, len(raws), b):
            chunk = [p.read_bytes() if isinstance(p, Path) else p for p in raws[i : i + b]]
            items = rt.prepare(chunk, "inputs", base64_encoded=False)
            rt.backend.outputs(rt.pre.collate(items))  # type: ignore[attr-defined]
        out[b] = round(len(raws) / (time.perf_counter() - t0), 1)
    return out


def batch_run(artifact: Path, inp: Path, out: Path, batch: int, *extra: str, env: dict | None = None) -> dict:
    """One ``python -m service.batch`` run in a process of its own: its summary."""
    cmd = [sys.executable, "-m", "service.batch", str(inp), "--artifact", str(artifact), "--out", str(out)]
    cmd += ["--batch-size", str(batch), "--part-size", str(PART), "--no-progress"]
    cmd += ["--column", "text"] if inp.suffix == ".csv" else []
    done = subprocess.run([*cmd, *extra], cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"hydra-predict failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((out / "summary.json").read_text())


def server_rate(artifact: Path, raws: list[Path | str], seconds: float) -> float:
    """Requests per second of the server (one input each) at 64 connections, ``HYDRA_WORKERS=auto``."""
    args = server_args(["--artifact", str(artifact), "--workers", "auto", "--no-floor", "--connections", "64"])
    args.seconds = seconds
    first = raws[0]
    if isinstance(first, Path):
        import base64

        body: dict[str, Any] = {"image": base64.b64encode(first.read_bytes()).decode()}
    else:
        body = {"text": first}
    runs = drive(args, artifact, body, "image" in body)
    return max(r["rps"] for r in runs["workers=auto"])


def memory_profile(artifact: Path, texts: list[str], n: int, tmp: Path) -> dict[str, Any]:
    """Peak RSS (MB) of a ``n``-input run at each tenth of its rows, sampled every 0.2 s."""
    inp, _ = write_inputs("text", texts, n, tmp / "memory")
    out = tmp / "memory-out"
    cmd = [sys.executable, "-m", "service.batch", str(inp), "--artifact", str(artifact), "--out", str(out)]
    cmd += ["--column", "text", "--part-size", str(max(1, n // 10)), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peaks: dict[int, float] = {}
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        parts = len(list(out.glob("part-*"))) if out.exists() else 0
        try:
            rss = ps.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            break
        peaks[parts] = max(peaks.get(parts, 0.0), rss)
        time.sleep(0.2)
    tenths = [round(peaks[k], 1) for k in sorted(peaks) if 0 < k <= 10]
    return {"inputs": n, "peak_rss_mb_by_tenth": tenths, "flat": bool(tenths) and tenths[-1] <= 1.1 * tenths[0]}


def estimate_check(artifact: Path, modality: str, tmp: Path) -> dict[str, Any]:
    """The summary's label-free estimate on the whole test split against the rows' accuracy by the data's labels."""
    inputs, labels = test_split(modality)
    inp, _ = write_inputs(modality, inputs, len(inputs), tmp / f"{modality}-test")
    summary = batch_run(artifact, inp, tmp / f"{modality}-test-out", 64)
    rows = _rows(tmp / f"{modality}-test-out")
    accuracy = float(np.mean([r["label"] == y for r, y in zip(rows, labels, strict=True)]))
    est, adj = summary["estimated_accuracy"], summary.get("adjusted_accuracy")
    out = {
        "inputs": len(rows),
        "accuracy": accuracy,
        "estimated": est,
        "gap_points": round(100 * (est["value"] - accuracy), 2),
        "interval_holds_it": est["low"] <= accuracy <= est["high"],
    }
    if adj is not None:
        out |= {"adjusted": adj, "adjusted_gap_points": round(100 * (adj["value"] - accuracy), 2)}
    return out


def _rows(out: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [r for p in sorted(out.glob("part-*.parquet")) for r in pq.read_table(p, columns=["label"]).to_pylist()]


def setting(name: str, artifact: Path, n: int, tmp: Path, server_s: float, ray: bool) -> dict[str, Any]:
    """Every leg of one artifact, side by side."""
    inputs, _ = test_split(name)
    inp, raws = write_inputs(name, inputs, n, tmp / name)
    print(f"{name}: raw model ...", flush=True)
    raw = [raw_rate(artifact, raws)]
    best = max(raw[0], key=raw[0].get)
    batch = [batch_run(artifact, inp, tmp / f"{name}-b{i}", best)["scored_now"]["inputs_per_s"] for i in range(2)]
    print(f"{name}: batch {batch} inputs/s; server ...", flush=True)
    server = server_rate(artifact, raws, server_s)
    ray_rate = None
    if ray:
        env = {"HYDRA_THREADS": "1"}
        ray_rate = batch_run(artifact, inp, tmp / f"{name}-ray", best, "--engine", "ray", env=env)["scored_now"]
    raw.append(raw_rate(artifact, raws))
    raw_best = max(max(r.values()) for r in raw)
    out = {
        "inputs": n,
        "raw_inputs_per_s": raw,
        "raw_best": raw_best,
        "best_batch": best,
        "batch_inputs_per_s": batch,
        "server_requests_per_s": server,
        "ray": ray_rate,
        "batch_over_raw": round(max(batch) / raw_best, 3),
        "batch_over_server": round(max(batch) / server, 3),
    }
    if ray_rate is not None:
        out["ray_over_batch"] = round(ray_rate["inputs_per_s"] / max(batch), 3)
    return out


def _figure(f: dict[str, Any] | None) -> str:
    return "–" if f is None else f"{100 * f['value']:.1f} [{100 * f['low']:.1f}, {100 * f['high']:.1f}]"


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        "# hydra-predict: speed, memory and the label-free estimate",
        "",
        f"`{doc['command']}`",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cpus')} CPUs. Every leg with the default settings (backend, precision).",
        "",
        "| artifact | inputs | raw best (batch) | batch in-process | / raw | server (wrk, 64 conn.) | batch / server "
        "| Ray, 2 actors | Ray / in-process |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in doc["settings"].items():
        ray = s.get("ray") or {}
        lines.append(
            f"| {name} | {s['inputs']} | {s['raw_best']:.0f} ({s['best_batch']}) | "
            f"{max(s['batch_inputs_per_s']):.0f} | "
            f"{s['batch_over_raw']:.2f} | {s['server_requests_per_s']:.0f} | {s['batch_over_server']:.2f} | "
            f"{ray.get('inputs_per_s') or '–'} | {s.get('ray_over_batch', '–')} |"
        )
    mem = doc.get("memory")
    if mem:
        lines += ["", f"Memory, {mem['inputs']:,} texts: peak RSS MB at each tenth {mem['peak_rss_mb_by_tenth']}"]
        lines += [f"(flat: {mem['flat']})."]
    lines += [
        "",
        "| artifact | test inputs | accuracy % | label-free estimate % [95 %] | gap (points) | adjusted (difference "
        "of confidences) % [95 %] | gap (points) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in doc["estimates"].items():
        adj_gap = e.get("adjusted_gap_points")
        lines.append(
            f"| {name} | {e['inputs']} | {100 * e['accuracy']:.1f} | {_figure(e['estimated'])} | "
            f"{e['gap_points']:+.2f} | {_figure(e.get('adjusted'))} | {'–' if adj_gap is None else f'{adj_gap:+.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "benchmarks/results/batch/summary.json")
    p.add_argument("--image", type=Path, default=ROOT / "artifacts/default/image")
    p.add_argument("--text", type=Path, default=ROOT / "artifacts/default/text")
    p.add_argument("--inputs", type=int, default=8000, help="inputs per speed leg")
    p.add_argument("--memory-inputs", type=int, default=100_000)
    p.add_argument("--server-seconds", type=float, default=10.0)
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the long memory run")
    p.add_argument("--settings", nargs="+", default=["image", "text"], choices=["image", "text"])
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="HYDRA_DEVICE of every leg")
    args = parse_positive(p, argv, "inputs", "memory_inputs")
    if args.device:
        os.environ["HYDRA_DEVICE"] = args.device  # the legs' processes and the raw model's settings read it
    with tempfile.TemporaryDirectory(prefix="hydra-batch-bench-") as tmp:
        t = Path(tmp)
        doc: dict[str, Any] = {
            "command": " ".join(["python -m benchmarks.batch_scoring", *(argv or sys.argv[1:])]),
            "machine": harness.machine(),
            "settings": {},
            "estimates": {},
        }
        for name in args.settings:
            art = getattr(args, name)
            doc["settings"][name] = setting(name, art, args.inputs, t, args.server_seconds, not args.no_ray)
            doc["estimates"][name] = estimate_check(art, name, t)
        if not args.no_memory:
            texts, _ = test_split("text")
            doc["memory"] = memory_profile(args.text, texts, args.memory_inputs, t)
    out = args.out or ROOT / "benchmarks" / "results" / "batch" / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result_json.write(out, doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
