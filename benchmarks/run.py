"""Run every benchmark (quality, cost, ablations) and write ``benchmarks/results/`` and the README tables.

    .venv/bin/python -m benchmarks.run --fast                  # smoke sizes, both settings, all parts
    .venv/bin/python -m benchmarks.run                         # full sizes (hours on 2 CPU cores)
    .venv/bin/python -m benchmarks.run --fast --only cost --layouts vit_b16 bert_base --batches 1 4
    .venv/bin/python -m benchmarks.run --only quality --settings image

Writes ``results/quality.json``, ``cost.json``, ``ablations.json`` (one row per measurement),
``summary.json`` (all of them in one file: machine, quality, cost, cost ratios, ablations, runs; its
shape is in ``benchmarks/README.md``), ``tables.md`` and ``plots/*.png``, and replaces the block
between the result markers of ``benchmarks/README.md``.
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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the server runs (service/main.py); before torch allocates

import numpy as np
import torch

from benchmarks import cost as cost_mod
from benchmarks import quality as q

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- results:begin (written by benchmarks/run.py) -->", "<!-- results:end -->"
PARTS = ("quality", "cost", "ablations")
METHOD_NAMES = {
    "single": "Single",
    "deep_ensemble": "Deep Ensemble",
    "mc_dropout": "MC Dropout",
    "taylor": "Taylor-pruned single",
    "circavg": "CircAvg-pruned single",
    "hydra_taylor": "Hydra (Taylor)",
    "hydra_circ": "Hydra (Circ)",
    "member": "one pruned member",
    "hydra": "Hydra fused",
    "hydra_unfused": "Hydra unfused",
}
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
    path.write_text(json.dumps(_jsonable(doc), indent=1))
    return doc


# ----------------------------------------------------------------------------- tables
def _pct(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _cell(vals: Sequence[float], scale: float = 100.0, digits: int = 1) -> str:
    m, s = q.mean_std(vals)
    if not math.isfinite(m):
        return "–"
    if len([v for v in vals if v is not None]) > 1:
        return f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}"
    return f"{scale * m:.{digits}f}"


def _group(rows: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """Rows grouped by method (and MC Dropout samples), in the paper's order."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = METHOD_NAMES.get(r["method"], r["method"])
        if r["method"] == "mc_dropout":
            label += f" ({r['samples']} samples)"
        groups.setdefault(label, []).append(r)
    order = {m: i for i, m in enumerate(q.METHODS)}
    return sorted(groups.items(), key=lambda kv: (order.get(kv[1][0]["method"], 99), kv[1][0].get("samples", 0)))


def _sections(
    rows: Sequence[dict], field: str, values: Iterable[str], runs: dict
) -> Iterator[tuple[str, list[dict], dict]]:
    """``(value, its rows, its run metadata)`` for each of ``values``, in that order, that some row has as ``field``.

    Values without rows get no table (a part may not have been run for every setting / layout yet).
    """
    for value in values:
        rs = [r for r in rows if r[field] == value]
        if rs:
            yield value, rs, runs.get(value, {})


def quality_tables(rows: Sequence[dict], runs: dict) -> list[str]:
    out = []
    for setting, rs, meta in _sections(rows, "setting", q.SETTINGS, runs):
        sets = {n: v["kind"] for n, v in rs[0]["ood"].items()}
        out += [
            f"#### Quality, {setting} setting ({meta.get('mode', '?')} mode)",
            "",
            f"Sizes: {json.dumps(meta.get('sizes', {}))}; OOD sets: "
            + ", ".join(f"{n} ({k})" for n, k in sets.items())
            + ". Percent; NLL in nats; mean ± std over seeds where there are several (n = seeds). "
            "OOD: MSP score, OOD positive, near / far = mean over the sets of that kind.",
            "",
            "| method | n | Acc ↑ | NLL ↓ | Brier ↓ | ECE ↓ | aECE ↓ | near AUROC ↑ | near FPR95 ↓ "
            "| near AUPR-in ↑ | far AUROC ↑ | far FPR95 ↓ | far AUPR-in ↑ | MI ID | MI OOD | DI ID | DI OOD |",
            "|" + "---|" * 17,
        ]
        for label, g in _group(rs):
            cells = [
                label,
                str(len(g)),
                _cell([r["acc"] for r in g]),
                _cell([r["nll"] for r in g], 1, 3),
                _cell([r["brier"] for r in g], 1, 3),
                _cell([r["ece"] for r in g]),
                _cell([r["aece"] for r in g]),
            ]
            for kind in ("near", "far"):
                for m in ("auroc", "fpr95", "aupr_in"):
                    cells.append(_cell([q.by_kind(r, kind, m) for r in g]))
            cells += [
                _cell([r["mi_id"] for r in g], 1, 4),
                _cell([r["mi_ood"] for r in g], 1, 4),
                _cell([r["disagreement_id"] for r in g]),
                _cell([r["disagreement_ood"] for r in g]),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out += [""] + per_set_table(rs) + [""] + target_lines(rs) + [""]
    return out


def per_set_table(rows: Sequence[dict]) -> list[str]:
    """AUROC per OOD set (mean over seeds)."""
    sets = list(rows[0]["ood"])
    out = ["| method | " + " | ".join(f"{s} AUROC" for s in sets) + " |", "|" + "---|" * (len(sets) + 1)]
    for label, g in _group(rows):
        out.append(f"| {label} | " + " | ".join(_cell([r["ood"][s]["auroc"] for r in g]) for s in sets) + " |")
    return out


def _avg_auroc(r: dict) -> float:
    return float(np.mean([v["auroc"] for v in r["ood"].values()]))


def target_lines(rows: Sequence[dict]) -> list[str]:
    """The issue's quality targets, checked on these rows (AUROC averaged over all OOD sets)."""

    def mean_of(method: str, f) -> float:
        return q.mean_std([f(r) for r in rows if r["method"] == method])[0]

    single_auroc, de_auroc = mean_of("single", _avg_auroc), mean_of("deep_ensemble", _avg_auroc)
    single_ece = mean_of("single", lambda r: r["ece"])
    out = ["| target | Hydra (Taylor) | Hydra (Circ) | reference |", "|---|---|---|---|"]
    for name, test, ref in (
        ("OOD AUROC ≥ Single", lambda a, e: a >= single_auroc, f"Single {_pct(single_auroc)}"),
        ("OOD AUROC ≥ Deep Ensemble − 1 pt", lambda a, e: a >= de_auroc - 0.01, f"Deep Ensemble {_pct(de_auroc)}"),
        ("ECE ≤ Single", lambda a, e: e <= single_ece, f"Single ECE {_pct(single_ece)}"),
    ):
        cells = []
        for m in ("hydra_taylor", "hydra_circ"):
            a, e = mean_of(m, _avg_auroc), mean_of(m, lambda r: r["ece"])
            if not math.isfinite(a):
                cells.append("–")
                continue
            val = f"AUROC {_pct(a)}" if "AUROC" in name else f"ECE {_pct(e)}"
            cells.append(f"{val}: {'met' if test(a, e) else '**not met**'}")
        out.append(f"| {name} | {cells[0]} | {cells[1]} | {ref} |")
    return out


def cost_tables(rows: Sequence[dict], runs: dict) -> list[str]:
    out = []
    ratio = {
        (r["layout"], r["device"], r["backend"], r["precision"], r["batch"], r["method"]): r
        for r in cost_mod.ratios(rows, "single")
    }
    to_de = {
        (r["layout"], r["device"], r["backend"], r["precision"], r["batch"], r["method"]): r
        for r in cost_mod.ratios(rows, "deep_ensemble")
    }
    for layout, rs, meta in _sections(rows, "layout", cost_mod.LAYOUTS, runs):
        first = {r["method"]: r for r in rs}
        out += [
            f"#### Cost, {layout} ({rs[0]['members']} members, {rs[0]['keep']} heads kept per layer; "
            f"{rs[0].get('device_name', '')}; {rs[0]['repeats']} interleaved repeats; "
            f"{meta.get('mode', '?')} mode)",
            "",
            "| method | params (M) | GMAC / input | params / Single | MACs / Single |",
            "|---|---|---|---|---|",
        ]
        for m in cost_mod.METHODS:
            if m in first:
                r, s1 = first[m], first["single"]
                out.append(
                    f"| {METHOD_NAMES.get(m, m)} | {r['params'] / 1e6:.1f} | {r['macs'] / 1e9:.3f} | "
                    f"{r['params'] / s1['params']:.2f} | {r['macs'] / s1['macs']:.2f} |"
                )
        out += [
            "",
            "Latency, ms (min / median); ratios min / median, within one backend; Hydra's GFLOPS and its "
            "share of the machine's matmul peak measured in the same run (when recorded).",
            "",
            "| device | backend | precision | batch | "
            + " | ".join(METHOD_NAMES.get(m, m) for m in cost_mod.METHODS)
            + " | Hydra / Single | Hydra / Deep Ensemble | Hydra GFLOPS (peak share) |",
            "|" + "---|" * (4 + len(cost_mod.METHODS) + 3),
        ]
        keys = sorted(
            {(r["device"], r.get("backend", "eager"), r["precision"], r["batch"]) for r in rs},
            key=lambda k: (k[0], cost_mod.BACKENDS.index(k[1]), k[2], k[3]),
        )
        for dev, be, prec, b in keys:
            cells = [dev, be, prec, str(b)]
            cell = {
                x["method"]: x
                for x in rs
                if (x["device"], x.get("backend", "eager"), x["precision"], x["batch"]) == (dev, be, prec, b)
            }
            for m in cost_mod.METHODS:
                r = cell.get(m)
                cells.append("–" if r is None else f"{r['latency_ms_min']:.1f} / {r['latency_ms_median']:.1f}")
            for table in (ratio, to_de):
                r = table.get((layout, dev, be, prec, b, "hydra"))
                cells.append("–" if r is None else f"{r['ratio_min']:.2f} / {r['ratio_median']:.2f}")
            h = cell.get("hydra", {})
            cells.append(f"{h['gflops']:.0f} ({100 * h['peak_fraction']:.0f} %)" if "peak_fraction" in h else "–")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def ablation_tables(rows: Sequence[dict], runs: dict) -> list[str]:
    out = []
    for setting, rs, meta in _sections(rows, "setting", q.SETTINGS, runs):
        out += [
            f"#### Ablations, {setting} setting ({rs[0]['method']}, Hydra seed 0, {meta.get('mode', '?')} mode)",
            "",
            "| ablation | value | Acc | ECE | near AUROC | far AUROC | near FPR95 | far FPR95 | MI ID | MI OOD "
            "| DI ID | DI OOD | params (M) |",
            "|" + "---|" * 13,
        ]
        for r in rs:
            cells = [
                r["ablation"],
                str(r["value"]),
                _pct(r["acc"]),
                _pct(r["ece"]),
                _pct(q.by_kind(r, "near", "auroc")),
                _pct(q.by_kind(r, "far", "auroc")),
                _pct(q.by_kind(r, "near", "fpr95")),
                _pct(q.by_kind(r, "far", "fpr95")),
                f"{r['mi_id']:.4f}",
                f"{r['mi_ood']:.4f}",
                _pct(r["disagreement_id"]),
                _pct(r["disagreement_ood"]),
                f"{r['params'] / 1e6:.2f}",
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


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
    """PNG plots of the summary; returns their paths relative to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    (out / "plots").mkdir(parents=True, exist_ok=True)
    quality = summary.get("quality", [])
    settings = [s for s in q.SETTINGS if any(r["setting"] == s for r in quality)]
    if settings:
        fig, axes = plt.subplots(len(settings), 3, figsize=(15, 3.8 * len(settings)), squeeze=False)
        for i, s in enumerate(settings):
            groups = _group([r for r in quality if r["setting"] == s])
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
        made.append(_save_figure(fig, out, "quality.png"))
    cost = summary.get("cost", [])
    layouts = [lay for lay in cost_mod.LAYOUTS if any(r["layout"] == lay for r in cost)]
    if layouts:
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
                            if r["layout"] == lay
                            and r["method"] == m
                            and (r["device"], r["precision"], r["batch"]) == key
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
        made.append(_save_figure(fig, out, "cost.png"))
    abl = summary.get("ablations", [])
    a_settings = [s for s in q.SETTINGS if any(r["setting"] == s for r in abl)]
    if a_settings:
        fig, axes = plt.subplots(len(a_settings), 3, figsize=(14, 3.5 * len(a_settings)), squeeze=False)
        for i, s in enumerate(a_settings):
            for j, name in enumerate(("members", "heads_kept", "diversity")):
                rs = [r for r in abl if r["setting"] == s and r["ablation"] == name]
                ax = axes[i][j]
                x = np.arange(len(rs))
                ax.plot(x, [100 * _avg_auroc(r) for r in rs], "o-", label="OOD AUROC (mean of sets)")
                ax.plot(x, [100 * r["acc"] for r in rs], "s-", label="Acc")
                ax2 = ax.twinx()
                ax2.bar(x, [r["mi_ood"] for r in rs], alpha=0.25, color="C2", label="MI OOD")
                ax.set_xticks(x, [str(r["value"]) for r in rs])
                ax.set_title(f"{s}: {name}")
            axes[i][0].legend(fontsize=8, loc="lower right")
        made.append(_save_figure(fig, out, "ablations.png"))
    return made


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
    (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=1))
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


def main(argv: Sequence[str] | None = None) -> dict:
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = "python -m benchmarks.run " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    mode = "fast" if args.fast else "full"
    t_all = time.perf_counter()

    if "cost" in args.only:
        if args.cost_threads:
            torch.set_num_threads(args.cost_threads)
        layouts = [x for x in args.layouts or cost_mod.LAYOUTS if x not in (args.import_fusion or [])]
        batches = args.batches or ([1, 4] if args.fast else [1, 4, 32])
        devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        repeats = args.repeats or (3 if args.fast else 10)
        meta = {
            "mode": mode,
            "batches": batches,
            "devices": devices,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.is_available(),
            "command": command,
        }
        for layout in layouts:
            t0 = time.perf_counter()
            rows = cost_mod.run_layout(
                layout,
                batches,
                args.precisions,
                devices,
                repeats,
                progress=lambda s: log.info("%s", s),
                backends=args.backends,
            )
            write_part(out, "cost", rows, "layout", {layout}, meta)  # after each layout: a long run keeps its part
            log.info("cost %s done in %.0f s", layout, time.perf_counter() - t0)

    for layout in args.import_fusion or []:
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

    torch.set_num_threads(args.threads)
    for part in ("quality", "ablations"):
        if part not in args.only:
            continue
        for setting in args.settings:
            t0 = time.perf_counter()
            spec = q.setting_spec(setting, args.fast)
            ctx = q.prepare(spec, args.cache, progress=not args.quiet)
            if part == "quality":
                rows = q.run_setting(ctx, hydra_seeds=tuple(range(args.hydra_seeds)), methods=args.methods)
            else:
                rows = q.run_ablations(ctx, args.ablation_strategy)
            meta = {
                "mode": mode,
                "sizes": spec.sizes,
                "spec": _jsonable(vars(spec)),
                "command": command,
                "seconds": round(time.perf_counter() - t0, 1),
                "threads": torch.get_num_threads(),
            }
            # written after every setting, so that a long run leaves its finished settings behind
            write_part(out, part, rows, "setting", {setting}, meta)
            log.info("%s %s done in %.0f s", part, setting, time.perf_counter() - t0)
    summary = write_outputs(out, None if args.no_readme else args.readme, command)
    log.info("all done in %.0f s; results in %s", time.perf_counter() - t_all, out)
    return summary


if __name__ == "__main__":
    main()
