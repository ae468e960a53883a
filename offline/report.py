"""The build report: latency measurement, ``report.json``, a readable ``report.md`` and PNG plots.

``write_report`` takes one row per method (``single``, ``member_0``.., ``hydra``,
``ensemble_unfused``), each the output of ``offline.metrics.evaluate_predictions``
plus ``method``, ``params`` and ``latency_ms``, and the member probabilities
behind them for the plots. Plots use matplotlib's ``Figure`` directly (Agg
canvas), so no global backend is touched.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .metrics import calibration_bins, ece, uncertainty

__all__ = ["measure_latency", "write_report", "summary_of", "HEADLINE"]

# the numbers of each method that go into the manifest's `metrics` field
HEADLINE = ("acc", "nll", "brier", "ece", "aece", "mi_id", "mi_ood", "disagreement_id", "disagreement_ood")
OOD_KEYS = ("auroc", "fpr95", "aupr_in", "aupr_out")
PLOT_FILES = ("reliability.png", "ood_hist_msp.png", "ood_hist_mi.png", "member_accuracy.png")


def measure_latency(fn: Callable[[], Any], warmup: int = 2, reps: int = 5) -> dict:
    """Wall-clock time of ``fn()`` under ``torch.inference_mode``: ``{"min_ms", "median_ms", "reps"}``.

    ``warmup`` untimed calls first (allocator, oneDNN kernel selection), then ``reps`` timed ones.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"min_ms": round(min(times), 3), "median_ms": round(statistics.median(times), 3), "reps": reps}


# ----------------------------------------------------------------------------- json
def _jsonable(x: Any) -> Any:
    """Plain JSON values: numpy scalars/arrays to Python, NaN/inf to None (strict JSON has no NaN)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    return x


def summary_of(rows: list[dict]) -> dict[str, dict]:
    """Headline numbers per method (for the manifest): ID metrics, OOD averages over sets, params, median latency."""
    out: dict[str, dict] = {}
    for r in rows:
        s = {k: r[k] for k in HEADLINE if k in r}
        s.update({k: v for k, v in r.get("ood_avg", {}).items() if k in OOD_KEYS})
        if "params" in r:
            s["params"] = int(r["params"])
        lat = r.get("latency_ms", {})
        s["latency_ms"] = {b: v["median_ms"] for b, v in lat.items() if isinstance(v, Mapping) and "median_ms" in v}
        out[r["method"]] = _jsonable(s)
    return out


# ----------------------------------------------------------------------------- markdown
def _pct(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.2f}"


def _num(x: Any, digits: int = 4) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _params(n: Any) -> str:
    return "–" if n is None else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{int(n):,}"


def _lat(r: dict, key: str) -> str:
    v = r.get("latency_ms", {}).get(key)
    return "–" if not v else f"{v['median_ms']:.1f} ({v['min_ms']:.1f})"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


_Cell = Callable[[Mapping[str, Any]], str]  # one table cell from a row (or from one OOD set's entry of a row)


def _cell(fmt: Callable[[Any], str], key: str, required: bool = False) -> _Cell:
    """``fmt`` of ``key``: a missing key shows as "–", or raises KeyError when ``required``."""
    return (lambda r: fmt(r[key])) if required else (lambda r: fmt(r.get(key)))


def _method_table(columns: Sequence[tuple[str, _Cell]], entries: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """A table with a "Method" column, then one column per ``(header, cell)``, one line per ``(method, entry)``."""
    return _table(["Method", *(h for h, _ in columns)], [[m, *(cell(e) for _, cell in columns)] for m, e in entries])


_ID_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    ("Params", _cell(_params, "params")),
    ("Acc %", _cell(_pct, "acc")),
    ("NLL", _cell(_num, "nll")),
    ("Brier", _cell(_num, "brier")),
    ("ECE %", _cell(_pct, "ece")),
    ("aECE %", _cell(_pct, "aece")),
    ("MSP", _cell(_num, "msp_id")),
    ("Entropy", _cell(_num, "entropy_id")),
    ("MI", _cell(_num, "mi_id")),
    ("Disagr. %", _cell(_pct, "disagreement_id")),
    ("Lat. b1 ms", lambda r: _lat(r, "batch1")),
    ("Lat. b8 ms", lambda r: _lat(r, "batch8")),
)
_OOD_HEADERS = ("AUROC %", "FPR95 %", "AUPR-In %", "AUPR-Out %")  # the headers of OOD_KEYS, in the same order
# one OOD set: the detection metrics are always there (a missing one is a bug), MI / disagreement may not be
_OOD_SET_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    *((h, _cell(_pct, k, required=True)) for h, k in zip(_OOD_HEADERS, OOD_KEYS, strict=True)),
    ("MI", _cell(_num, "mi")),
    ("Disagr. %", _cell(_pct, "disagreement")),
)
_OOD_AVG_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    *((h, lambda r, k=k: _pct(r.get("ood_avg", {}).get(k))) for h, k in zip(_OOD_HEADERS, OOD_KEYS, strict=True)),
    ("MI ID", _cell(_num, "mi_id")),
    ("MI OOD", _cell(_num, "mi_ood")),
    ("Disagr. ID %", _cell(_pct, "disagreement_id")),
    ("Disagr. OOD %", _cell(_pct, "disagreement_ood")),
)


def _id_section(rows: list[dict]) -> list[str]:
    """The in-distribution table: one line per method."""
    md = ["## In-distribution (test set)", ""]
    md += [
        "Percentages for Acc, ECE, aECE and disagreement; NLL and entropies in nats; Brier of the mean "
        "prediction (0–2). Latency: median (min) ms per call, eager fp32.",
        "",
    ]
    return md + _method_table(_ID_COLUMNS, ((r["method"], r) for r in rows))


def _ood_section(rows: list[dict], ood_kinds: dict[str, str], score: str) -> list[str]:
    """One OOD table per set (methods that were evaluated on it), then the average over sets."""
    sets = list(dict.fromkeys(n for r in rows for n in r.get("ood", {})))
    md = ["", f"## OOD detection (score: `{score}`)", ""]
    md += [
        "OOD is the positive class. FPR95: fraction of ID inputs flagged when 95% of the OOD inputs are "
        "(OpenOOD v1.5). AUPR-In: ID positive; AUPR-Out: OOD positive. MI (nats) and disagreement are "
        "means over the set's inputs.",
        "",
    ]
    for name in sets:
        md += [f"### {name} ({ood_kinds.get(name, 'ood')})", ""]
        entries = ((r["method"], o) for r in rows if (o := r.get("ood", {}).get(name)))
        md += _method_table(_OOD_SET_COLUMNS, entries) + [""]
    if sets:
        md += ["### Average over OOD sets", ""]
        md += _method_table(_OOD_AVG_COLUMNS, ((r["method"], r) for r in rows)) + [""]
    return md


def _build_section(extra: dict, plots: list[str]) -> list[str]:
    """Build facts as a (nested) list, then the plots, if any."""
    md = ["## Build", ""]
    for k, v in extra.items():
        if isinstance(v, Mapping):
            md += [f"- **{k}**:"] + [f"  - {kk}: {_fmt(vv)}" for kk, vv in v.items()]
        else:
            md += [f"- **{k}**: {_fmt(v)}"]
    if plots:
        md += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return md


def _markdown(rows: list[dict], ood_kinds: dict[str, str], title: str, extra: dict, plots: list[str]) -> str:
    """The text of ``report.md``: title, ID table, OOD tables, build facts and plots."""
    score = next((r.get("ood_score") for r in rows if r.get("ood_score")), extra.get("ood_score", "msp"))
    md = [f"# {title}", ""] + _id_section(rows) + _ood_section(rows, ood_kinds, score) + _build_section(extra, plots)
    return "\n".join(md) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(_jsonable(v))


# ----------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _plot_reliability(path: Path, labels: np.ndarray, methods: dict[str, np.ndarray]) -> None:
    """One panel per method: accuracy per 15 equal-width confidence bins against the diagonal."""
    fig = _figure(4.2 * len(methods), 4.2)
    axes = fig.subplots(1, len(methods), squeeze=False)[0]
    for ax, (name, probs) in zip(axes, methods.items(), strict=True):
        b = calibration_bins(probs, labels)
        edges = np.linspace(0, 1, len(b["count"]) + 1)
        centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
        filled = b["count"] > 0
        ax.bar(
            centers[filled],
            b["accuracy"][filled],
            width=width,
            color="tab:blue",
            edgecolor="black",
            linewidth=0.5,
            label="accuracy",
        )
        gap_lo = np.minimum(b["accuracy"], b["confidence"])[filled]
        gap = np.abs(b["accuracy"] - b["confidence"])[filled]
        # the gap between accuracy and mean confidence, hatched so it stays visible over the accuracy bar
        ax.bar(
            centers[filled],
            gap,
            bottom=gap_lo,
            width=width,
            facecolor="none",
            edgecolor="tab:red",
            hatch="///",
            linewidth=0.8,
            label="gap to confidence",
        )
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
        ax.set(
            xlim=(0, 1),
            ylim=(0, 1),
            xlabel="confidence (MSP)",
            ylabel="accuracy",
            title=f"{name}: ECE {100 * ece(probs, labels):.2f}%",
        )
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("Reliability diagram (ID test set)")
    fig.savefig(path)


def _plot_ood_hist(
    path: Path,
    method: str,
    field: str,
    probs_id: np.ndarray,
    probs_ood: dict[str, np.ndarray],
    ood_kinds: dict[str, str],
    threshold: float | None,
) -> None:
    """Histograms (density) of one uncertainty field on the ID test set and each OOD set."""
    values = {"ID": uncertainty(probs_id)[field]}
    for name, p in probs_ood.items():
        values[f"{name} ({ood_kinds.get(name, 'ood')})"] = uncertainty(p)[field]
    hi = 1.0 if field == "msp" else max(float(max(v.max() for v in values.values())), 1e-6)
    lo = 0.0
    bins = np.linspace(lo, hi * (1 if field == "msp" else 1.02), 41)
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    for i, (name, v) in enumerate(values.items()):
        ax.hist(
            v,
            bins=bins,
            density=True,
            histtype="stepfilled" if i == 0 else "step",
            alpha=0.35 if i == 0 else 1.0,
            linewidth=1.5,
            label=f"{name}, n={len(v)}",
        )
    if threshold is not None:
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold:.3g}")
    label = {"msp": "maximum softmax probability", "mutual_information": "mutual information (nats)"}[field]
    ax.set(xlabel=label, ylabel="density", title=f"{method}: {label}, ID vs OOD")
    ax.legend(fontsize=8)
    fig.savefig(path)


def _plot_member_accuracy(path: Path, rows: list[dict]) -> None:
    """Test accuracy of every method: members, the fused ensemble, the unfused ensemble and the single model."""
    names = [r["method"] for r in rows]
    acc = [100 * r["acc"] for r in rows]
    colors = [
        "tab:gray"
        if n.startswith("member_")
        else "tab:green"
        if n == "hydra"
        else "tab:orange"
        if n == "single"
        else "tab:blue"
        for n in names
    ]
    fig = _figure(max(5.0, 1.0 * len(names) + 1.5), 4.0)
    ax = fig.subplots()
    bars = ax.bar(names, acc, color=colors, edgecolor="black", linewidth=0.5)
    ax.bar_label(bars, labels=[f"{a:.1f}" for a in acc], fontsize=8)
    if "single" in names:
        ax.axhline(acc[names.index("single")], color="tab:orange", linestyle="--", linewidth=1, label="single")
        ax.legend(fontsize=8, loc="lower right")
    lo = max(0.0, min(acc) - 10)
    ax.set(ylim=(lo, min(100.0, max(acc) + 5)), ylabel="accuracy (%)", title="Members vs ensembles: test accuracy")
    ax.tick_params(axis="x", labelrotation=20)
    fig.savefig(path)


def _write_plots(out: Path, rows: list[dict], ood_kinds: dict[str, str], plots: dict, extra: dict) -> list[str]:
    labels = np.asarray(plots["labels"])
    pdir = out / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    written = []
    rel = {m: plots[m]["member_probs_id"] for m in ("single", "hydra") if m in plots}
    if rel:
        _plot_reliability(pdir / "reliability.png", labels, rel)
        written.append("plots/reliability.png")
    method = next((m for m in ("hydra", "ensemble_unfused", "single") if m in plots), None)
    if method is not None:
        kinds = plots.get("ood_kinds", ood_kinds)
        p = plots[method]
        score = extra.get("ood_score")
        thr = extra.get("ood_threshold")
        for field, fname in (("msp", "ood_hist_msp.png"), ("mutual_information", "ood_hist_mi.png")):
            t = thr if method == "hydra" and score == field and thr is not None else None
            _plot_ood_hist(pdir / fname, method, field, p["member_probs_id"], p.get("member_probs_ood", {}), kinds, t)
            written.append(f"plots/{fname}")
    if rows and all("acc" in r for r in rows):
        _plot_member_accuracy(pdir / "member_accuracy.png", rows)
        written.append("plots/member_accuracy.png")
    return written


# ----------------------------------------------------------------------------- entry point
def write_report(out: Path, rows: list[dict], ood_kinds: dict[str, str], plots: dict, title: str, extra: dict) -> dict:
    """Write ``out/report.json``, ``out/report.md`` and ``out/plots/*.png``; return the manifest summary.

    Args:
        out: artifact directory.
        rows: per method, ``evaluate_predictions(...)`` plus ``method``, ``params`` and
            ``latency_ms: {"batch1": measure_latency(...), "batch8": ...}``.
        ood_kinds: OOD set name -> kind (``near``, ``far``, ...).
        plots: ``{"labels": (N,), "ood_kinds": {...}, <method>: {"member_probs_id": (N, M, C),
            "member_probs_ood": {name: (N', M, C)}}}``.
        title: report heading.
        extra: build facts shown in the report (temperature, threshold, timings, ...).

    Returns per method the headline numbers (:func:`summary_of`).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = _write_plots(out, rows, ood_kinds, plots, extra)
    doc = {"title": title, "ood_kinds": ood_kinds, "rows": rows, "extra": extra, "plots": written}
    (out / "report.json").write_text(json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(_markdown(rows, ood_kinds, title, extra, written))
    return summary_of(rows)
