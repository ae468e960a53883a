"""Run every benchmark (quality, cost, ablations) and write ``benchmarks/results/`` and the README tables.

    .venv/bin/python -m benchmarks.run --fast                  # smoke sizes, both settings, all parts
    .venv/bin/python -m benchmarks.run                         # full sizes (hours on 2 CPU cores)
    .venv/bin/python -m benchmarks.run --fast --only cost --layouts vit_b16 bert_base --batches 1 4
    .venv/bin/python -m benchmarks.run --only quality --settings image

Writes ``results/quality.json``, ``cost.json``, ``ablations.json`` (one row per measurement),
``summary.json`` (all of them in one file: machine, quality, cost, cost ratios, ablations, runs; its
shape is in ``benchmarks/README.md``), ``tables.md`` and ``plots/*.png``, and replaces the block
between the result markers of ``benchmarks/README.md``. Every JSON is written one row a line
(:mod:`benchmarks.result_json`).
A part run for some settings / layouts only replaces those rows and keeps the others, so the
files always hold the latest measurement of everything.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault(
    "THP_MEM_ALLOC_ENABLE", "1"
)  # as the server runs (service/entrypoints/app.py); before torch allocates

import numpy as np
import torch

from benchmarks import cost as cost_mod
from benchmarks import quality as q
from benchmarks import result_json
from benchmarks.tables import METHOD_NAMES, ablation_tables, avg_auroc, cost_tables, group, quality_tables

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- results:begin (written by benchmarks/run.py) -->", "<!-- results:end -->"
PARTS = ("quality", "cost", "ablations")
log = logging.getLogger("hydra.bench")


# ----------------------------------------------------------------------------- machine
def machine() -> str:
    """One line naming the machine: CPU model, cores, memory, OS, torch, and the load when the run started."""
    cpu = cost_mod.device_name("cpu").split(",")[0]
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, {gpu}; {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}; load average {load:.1f} at start"
    )


# ----------------------------------------------------------------------------- json files
def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def merge_rows(old: Sequence[dict], new: Sequence[dict], key: str, replaced: set[str]) -> list[dict]:
    """Rows of ``old`` whose ``key`` is not in ``replaced``, then ``new``."""
    return [r for r in old if r.get(key) not in replaced] + list(new)


def write_part(out: Path, part: str, rows: list[dict], key: str, replaced: set[str], meta: dict) -> dict:
    """Merge ``rows`` into ``out/<part>.json`` (replacing rows of the ``replaced`` settings/layouts)."""
    path = out / f"{part}.json"
    old = _load(path)
    merged = merge_rows(old.get("rows", []), rows, key, replaced)
    runs = {**old.get("runs", {}), **{k: meta for k in sorted(replaced)}}
    doc = {"rows": merged, "runs": runs}
    result_json.write(path, _jsonable(doc))
    return doc


# ----------------------------------------------------------------------------- plots
def _save_figure(fig: Any, out: Path, name: str) -> str:
    """Lay out, write ``out/plots/<name>`` and close a pyplot figure; returns its path relative to ``out``.

    Closing matters: pyplot keeps every figure alive until it is closed.
    """
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / "plots" / name, dpi=110)
    plt.close(fig)
    return f"plots/{name}"


def plots(out: Path, summary: dict) -> list[str]:
    """PNG plots of the summary, one per part with rows; returns their paths relative to ``out``."""
    import matplotlib

    matplotlib.use("Agg")

    (out / "plots").mkdir(parents=True, exist_ok=True)
    made = []
    for part, key, order, draw in _PLOTS:
        rows = summary.get(part, [])
        present = [v for v in order if any(r[key] == v for r in rows)]
        if present:
            made.append(_save_figure(draw(rows, present), out, f"{part}.png"))
    return made


def _quality_plot(quality: list[dict], settings: list[str]) -> Any:
    """Near- and far-OOD AUROC and ECE of every method (mean ± std over seeds), one row per setting."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(settings), 3, figsize=(15, 3.8 * len(settings)), squeeze=False)
    for i, s in enumerate(settings):
        groups = group([r for r in quality if r["setting"] == s])
        labels = [g[0] for g in groups]
        for j, (title, f) in enumerate(
            (
                ("near-OOD AUROC", lambda r: q.by_kind(r, "near", "auroc")),
                ("far-OOD AUROC", lambda r: q.by_kind(r, "far", "auroc")),
                ("ECE", lambda r: r["ece"]),
            )
        ):
            ms = [q.mean_std([f(r) for r in g]) for _, g in groups]
            ax = axes[i][j]
            ax.barh(
                range(len(labels)),
                [100 * m for m, _ in ms],
                xerr=[100 * sd for _, sd in ms],
                color=["C3" if "Hydra" in lb else "C0" for lb in labels],
            )
            ax.set_yticks(range(len(labels)), labels if j == 0 else [""] * len(labels))
            ax.invert_yaxis()
            ax.set_title(f"{s}: {title} (%)")
            lo = min(100 * m for m, _ in ms if math.isfinite(m)) if title != "ECE" else 0
            ax.set_xlim(max(0, lo - 5) if title != "ECE" else 0, None)
    return fig


def _cost_plot(cost: list[dict], layouts: list[str]) -> Any:
    """Latency of every method relative to Single (min), one panel per layout."""
    import matplotlib.pyplot as plt

    rat = cost_mod.ratios(cost, "single")
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.5 * len(layouts), 3.8), squeeze=False)
    for ax, lay in zip(axes[0], layouts, strict=True):
        keys = sorted({(r["device"], r["precision"], r["batch"]) for r in rat if r["layout"] == lay})
        x = np.arange(len(keys))
        for k, m in enumerate(("member", "hydra", "hydra_unfused", "deep_ensemble")):
            vals = [
                next(
                    (
                        r["ratio_min"]
                        for r in rat
                        if r["layout"] == lay and r["method"] == m and (r["device"], r["precision"], r["batch"]) == key
                    ),
                    np.nan,
                )
                for key in keys
            ]
            ax.bar(x + 0.2 * (k - 1.5), vals, width=0.2, label=METHOD_NAMES[m])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, [f"{d} {p}\nb{b}" for d, p, b in keys], fontsize=8)
        ax.set_title(f"{lay}: latency / Single (min)")
    axes[0][0].legend(fontsize=8)
    return fig


def _ablations_plot(abl: list[dict], settings: list[str]) -> Any:
    """OOD AUROC, accuracy and MI on OOD along each ablation, one row per setting."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(settings), 3, figsize=(14, 3.5 * len(settings)), squeeze=False)
    for i, s in enumerate(settings):
        for j, name in enumerate(("members", "heads_kept", "diversity")):
            rs = [r for r in abl if r["setting"] == s and r["ablation"] == name]
            ax = axes[i][j]
            x = np.arange(len(rs))
            ax.plot(x, [100 * avg_auroc(r) for r in rs], "o-", label="OOD AUROC (mean of sets)")
            ax.plot(x, [100 * r["acc"] for r in rs], "s-", label="Acc")
            ax2 = ax.twinx()
            ax2.bar(x, [r["mi_ood"] for r in rs], alpha=0.25, color="C2", label="MI OOD")
            ax.set_xticks(x, [str(r["value"]) for r in rs])
            ax.set_title(f"{s}: {name}")
        axes[i][0].legend(fontsize=8, loc="lower right")
    return fig


# one plot per part: (the summary's rows, the key that picks a panel, the panels in their order, the drawing of the
# rows on the panels present); the figure is written to plots/<part>.png
_PLOTS: tuple[tuple[str, str, Sequence[str], Callable[[list[dict], list[str]], Any]], ...] = (
    ("quality", "setting", q.SETTINGS, _quality_plot),
    ("cost", "layout", cost_mod.LAYOUTS, _cost_plot),
    ("ablations", "setting", q.SETTINGS, _ablations_plot),
)


# ----------------------------------------------------------------------------- main
def write_outputs(out: Path, readme: Path | None, command: str) -> dict:
    """``summary.json``, ``tables.md``, plots and the README block from the part files in ``out``."""
    parts = {p: _load(out / f"{p}.json") for p in PARTS}
    summary = {
        "machine": machine(),
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "quality": parts["quality"].get("rows", []),
        "cost": parts["cost"].get("rows", []),
        "cost_ratios_to_single": cost_mod.ratios(parts["cost"].get("rows", []), "single"),
        "ablations": parts["ablations"].get("rows", []),
        "runs": {p: parts[p].get("runs", {}) for p in PARTS},
    }
    result_json.write(out / "summary.json", _jsonable(summary))
    made = plots(out, summary)
    lines = [f"Machine: {summary['machine']}.", "", f"Generated {summary['generated']} by `{command}`.", ""]
    lines += quality_tables(summary["quality"], summary["runs"]["quality"])
    lines += cost_tables(summary["cost"], summary["runs"]["cost"])
    lines += ablation_tables(summary["ablations"], summary["runs"]["ablations"])
    lines += [f"![{Path(p).stem}](results/{p})" for p in made]
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text.replace("](results/", "]("))
    if readme is not None:
        old = readme.read_text() if readme.is_file() else "# Benchmarks\n"
        block = f"{BEGIN}\n{text}{END}"
        if BEGIN in old and END in old:
            new = old[: old.index(BEGIN)] + block + old[old.index(END) + len(END) :]
        else:
            new = old.rstrip() + "\n\n" + block + "\n"
        readme.write_text(new)
    return summary


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="smoke sizes: small subsets, few steps (minutes)")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    ap.add_argument("--settings", nargs="+", choices=q.SETTINGS, default=list(q.SETTINGS))
    ap.add_argument(
        "--layouts", nargs="+", choices=cost_mod.LAYOUTS, default=None, help="cost layouts (default: all four)"
    )
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="cost batch sizes (fast: 1 4; full: 1 4 32)")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument(
        "--devices",
        nargs="+",
        choices=["cpu", "cuda"],
        default=None,
        help="cost devices (default: cpu, plus cuda when available)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per cost cell (fast: 3; full: 10)")
    ap.add_argument(
        "--backends",
        nargs="+",
        choices=cost_mod.BACKENDS,
        default=["eager"],
        help="cost: the serving backends to time Single, Hydra and the Deep Ensemble in (eager: every "
        "method; onnx, aoti: CPU fp32, exported and compiled first)",
    )
    ap.add_argument(
        "--methods", nargs="+", choices=q.METHODS, default=list(q.METHODS), help="quality methods to run (default: all)"
    )
    ap.add_argument("--hydra-seeds", type=int, default=3, help="Hydra seeds in the quality table (>= 3)")
    ap.add_argument("--ablation-strategy", choices=["taylor", "circ"], default="taylor")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for quality/ablations (1: small models on a shared 2-core machine run "
        "faster single-threaded)",
    )
    ap.add_argument("--cost-threads", type=int, default=0, help="torch threads for cost timings (0: torch default)")
    ap.add_argument(
        "--import-fusion",
        nargs="*",
        choices=["vit_b16", "bert_base"],
        default=None,
        help="take these layouts' CPU cost rows from benchmarks/results/fusion_<layout>.json "
        "(bench_fusion.py measures them the same way) instead of timing them again",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--cache", type=Path, default=q.DEFAULT_CACHE)
    ap.add_argument("--readme", type=Path, default=README, help="README whose result block is replaced")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = "python -m benchmarks.run " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    if "cost" in args.only:
        _run_cost(args, out, command)
    for layout in args.import_fusion or []:
        _import_fusion(layout, out, command)
    torch.set_num_threads(args.threads)
    for part in ("quality", "ablations"):
        if part in args.only:
            _run_quality(part, args, out, command)
    summary = write_outputs(out, None if args.no_readme else args.readme, command)
    log.info("all done in %.0f s; results in %s", time.perf_counter() - t_all, out)
    return summary


def _run_cost(args: argparse.Namespace, out: Path, command: str) -> None:
    """Time every layout asked for (but the imported ones); each layout's rows are written as soon as it is done."""
    if args.cost_threads:
        torch.set_num_threads(args.cost_threads)
    layouts = [x for x in args.layouts or cost_mod.LAYOUTS if x not in (args.import_fusion or [])]
    grid = cost_mod.Grid(
        batches=args.batches or ([1, 4] if args.fast else [1, 4, 32]),
        precisions=args.precisions,
        devices=args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]),
        repeats=args.repeats or (3 if args.fast else 10),
        backends=args.backends,
    )
    meta = {
        "mode": "fast" if args.fast else "full",
        "batches": grid.batches,
        "devices": grid.devices,
        "repeats": grid.repeats,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.is_available(),
        "command": command,
    }
    for layout in layouts:
        t0 = time.perf_counter()
        rows = cost_mod.run_layout(layout, grid, progress=lambda s: log.info("%s", s))
        write_part(out, "cost", rows, "layout", {layout}, meta)  # after each layout: a long run keeps its part
        log.info("cost %s done in %.0f s", layout, time.perf_counter() - t0)


def _import_fusion(layout: str, out: Path, command: str) -> None:
    """The CPU cost rows of ``layout`` from ``bench_fusion``'s results file in ``out``, instead of timing them."""
    src = out / f"fusion_{layout}.json"
    if not src.is_file():
        raise SystemExit(f"--import-fusion {layout}: {src} does not exist; run benchmarks/bench_fusion.py first")
    doc = json.loads(src.read_text())
    meta = {
        "mode": "bench_fusion",
        "source": str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src),
        "commands": doc["meta"]["commands"],
        "threads": doc["meta"]["threads"],
        "command": command,
    }
    write_part(out, "cost", cost_mod.rows_from_fusion(doc), "layout", {layout}, meta)
    log.info("cost %s imported from %s", layout, src)


def _run_quality(part: str, args: argparse.Namespace, out: Path, command: str) -> None:
    """The ``quality`` or ``ablations`` part of every setting asked for; each setting is written when done."""
    for setting in args.settings:
        t0 = time.perf_counter()
        spec = q.setting_spec(setting, args.fast)
        ctx = q.prepare(spec, args.cache, progress=not args.quiet)
        if part == "quality":
            rows = q.run_setting(ctx, hydra_seeds=tuple(range(args.hydra_seeds)), methods=args.methods)
        else:
            rows = q.run_ablations(ctx, args.ablation_strategy)
        meta = {
            "mode": "fast" if args.fast else "full",
            "sizes": spec.sizes,
            "spec": _jsonable(vars(spec)),
            "command": command,
            "seconds": round(time.perf_counter() - t0, 1),
            "threads": torch.get_num_threads(),
        }
        # written after every setting, so that a long run leaves its finished settings behind
        write_part(out, part, rows, "setting", {setting}, meta)
        log.info("%s %s done in %.0f s", part, setting, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
