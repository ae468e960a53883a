"""The report's PNG plots: reliability, ID vs OOD histograms, the served score, member accuracy, the confusion
matrix, the drift alarm and risk vs coverage.

Plots use matplotlib's ``Figure`` directly (Agg canvas), so no global backend is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from offline.method.ensemble_metrics import calibration_bins, ece, uncertainty
from offline.report.values import finite, pct

PLOT_FILES = ("reliability.png", "ood_hist_msp.png", "ood_hist_mi.png", "member_accuracy.png")
SERVED_PLOT = "ood_hist_served.png"  # only when ``plots["served"]`` is given
MI_FLOOR = 1e-6  # mutual information below it is drawn at it on the log axis


def figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches at 110 dpi, laid out by matplotlib's constrained layout."""
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _reliability_panel(ax: Any, b: dict[str, np.ndarray], title: str) -> None:
    """Accuracy per confidence bin, the gap to the bin's mean confidence hatched, against the diagonal."""
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
        label="gap to mean confidence",
    )
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax.set(
        xlim=(0, 1),
        ylim=(0, 1),
        xlabel="confidence (MSP of the mean prediction)",
        ylabel="accuracy (fraction correct)",
        title=title,
    )
    ax.legend(loc="upper left", fontsize=8)


def _bin_count_panel(ax: Any, b: dict[str, np.ndarray]) -> None:
    """The number of inputs per confidence bin (log scale: the top bins hold most inputs), annotated."""
    edges = np.linspace(0, 1, len(b["count"]) + 1)
    centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
    filled = b["count"] > 0
    bars = ax.bar(centers[filled], b["count"][filled], width=width, color="tab:gray", edgecolor="black", linewidth=0.5)
    ax.bar_label(bars, labels=[str(int(c)) for c in b["count"][filled]], fontsize=6, padding=1)
    ax.set_yscale("log")
    top = max(int(b["count"].max()), 1)
    ax.set(
        xlim=(0, 1),
        ylim=(0.7, top * 3),
        xlabel="confidence (MSP of the mean prediction)",
        ylabel="inputs per bin (log)",
        title=f"inputs per confidence bin (n = {int(b['count'].sum())})",
    )


def plot_reliability(path: Path, labels: np.ndarray, methods: dict[str, np.ndarray]) -> None:
    """One column per method: accuracy per 15 equal-width confidence bins against the diagonal, the bin counts
    under it."""
    fig = figure(4.4 * len(methods), 6.4)
    axes = fig.subplots(2, len(methods), squeeze=False, gridspec_kw={"height_ratios": [3, 1.3]})
    for i, (name, probs) in enumerate(methods.items()):
        b = calibration_bins(probs, labels)
        _reliability_panel(axes[0, i], b, f"{name}: ECE {100 * ece(probs, labels):.2f}%")
        _bin_count_panel(axes[1, i], b)
    fig.suptitle("Reliability diagram (ID test set, 15 equal-width bins)")
    fig.savefig(path)


def _share_hist(ax: Any, values: dict[str, np.ndarray], bins: np.ndarray) -> None:
    """One histogram per entry of ``values`` (label -> scores), each summing to 1 (share of its inputs)."""
    for i, (name, v) in enumerate(values.items()):
        ax.hist(
            v,
            bins=bins,
            weights=np.full(len(v), 1 / max(len(v), 1)),
            histtype="stepfilled" if i == 0 else "step",
            alpha=0.35 if i == 0 else 1.0,
            linewidth=1.5,
            label=name,
        )


def _hist_values(field: str, values: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray, str]:
    """The values to draw, the bins and the x label of one uncertainty field: MSP on [0, 1]; mutual information
    on log-spaced bins, clipped below at :data:`MI_FLOOR` (MI spans decades, and is 0 for a single model)."""
    if field == "msp":
        return values, np.linspace(0.0, 1.0, 41), "maximum softmax probability"
    clipped = {k: np.maximum(v, MI_FLOOR) for k, v in values.items()}
    lo = min(float(v.min()) for v in clipped.values())
    hi = max(float(max(v.max() for v in clipped.values())), 10 * lo)
    label = f"mutual information (nats, log scale; values < {MI_FLOOR:g} drawn at {MI_FLOOR:g})"
    return clipped, np.geomspace(lo * 0.98, hi * 1.02, 41), label


def plot_ood_hist(
    path: Path,
    method: str,
    field: str,
    probs_id: np.ndarray,
    probs_ood: dict[str, np.ndarray],
    ood_kinds: dict[str, str],
    threshold: float | None,
) -> None:
    """Histograms (share of each set's inputs per bin) of one uncertainty field on the ID test set and each OOD set."""
    raw = {"ID": uncertainty(probs_id)[field]}
    for name, p in probs_ood.items():
        raw[f"{name} ({ood_kinds.get(name, 'ood')})"] = uncertainty(p)[field]
    values, bins, label = _hist_values(field, {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in raw.items()})
    fig = figure(6.4, 4.0)
    ax = fig.subplots()
    _share_hist(ax, {f"{k}, n={len(v)}": v for k, v in values.items()}, bins)
    if field != "msp":
        ax.set_xscale("log")
    if threshold is not None:
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold:.3g}")
    name = {"msp": "maximum softmax probability", "mutual_information": "mutual information"}[field]
    ax.set(xlabel=label, ylabel="share of inputs", title=f"{method}: {name}, ID vs OOD (test sets)")
    ax.legend(fontsize=8)
    fig.savefig(path)


def _served_labels(served: Mapping[str, Any], ood_kinds: dict[str, str], flag: Mapping[str, Any]) -> dict[str, str]:
    """Legend labels of the served-score histogram: set, kind, size and, from ``served_flag``, the share flagged."""

    def flagged(x: Any) -> str:
        return f", {pct(x)}% flagged" if finite(x) else ""

    labels = {"ID": f"ID test, n={len(served['id'])}{flagged(flag.get('id_test_flag_rate'))}"}
    for n, v in served.get("ood", {}).items():
        labels[n] = f"{n} ({ood_kinds.get(n, 'ood')}), n={len(v)}{flagged((flag.get('recall') or {}).get(n))}"
    return labels


def plot_served_hist(path: Path, served: Mapping[str, Any], ood_kinds: dict[str, str], flag: Mapping[str, Any]) -> None:
    """Histograms of the served OOD score on the ID test set and each OOD test set, its threshold as a line.

    The x range is the 0.5–99.5th percentile of all the values (and the threshold); values past it are drawn in the
    edge bins, so a long tail (Mahalanobis distances on far OOD) does not squash the rest.
    """
    raw = {"ID": served["id"], **served.get("ood", {})}
    raw = {k: (a := np.asarray(v, dtype=np.float64).reshape(-1))[np.isfinite(a)] for k, v in raw.items()}
    thr = float(served["threshold"])
    pooled = np.concatenate([*raw.values(), [thr]])
    lo, hi = np.percentile(pooled, [0.5, 99.5])
    lo, hi = min(float(lo), thr), max(float(hi), thr)
    hi = hi if hi > lo else lo + 1.0
    labels = _served_labels(served, ood_kinds, flag)
    fig = figure(6.8, 4.2)
    ax = fig.subplots()
    _share_hist(ax, {labels[k]: np.clip(v, lo, hi) for k, v in raw.items()}, np.linspace(lo, hi, 41))
    ax.axvline(thr, color="black", linestyle="--", linewidth=1.2, label=f"threshold {thr:.4g}")
    ax.set(
        xlabel=f"{served['score']} (OOD score; 0.5% tails drawn in the edge bins)",
        ylabel="share of inputs",
        title=f"Served OOD score {served['score']}: ID test vs OOD test sets",
    )
    ax.legend(fontsize=8)
    fig.savefig(path)


def _method_color(name: str) -> tuple[str, str]:
    """The bar colour of a method and the legend entry it stands for."""
    if name.startswith("member_"):
        return "tab:gray", "member"
    return {"hydra": ("tab:green", "hydra (fused)"), "single": ("tab:orange", "single")}.get(name, ("tab:blue", name))


def plot_member_accuracy(path: Path, rows: list[dict]) -> None:
    """Test accuracy of every method: members, the fused ensemble, the unfused ensemble and the single model."""
    names = [r["method"] for r in rows]
    acc = [100 * r["acc"] for r in rows]
    colors = [_method_color(n) for n in names]
    fig = figure(max(5.0, 1.0 * len(names) + 1.5) + 2.0, 4.2)
    ax = fig.subplots()
    bars = ax.bar(names, acc, color=[c for c, _ in colors], edgecolor="black", linewidth=0.5)
    ax.bar_label(bars, labels=[f"{a:.1f}" for a in acc], fontsize=8)
    legend: dict[str, list[str]] = {}  # colour -> what it stands for (the other methods share one colour)
    for c, lab in dict.fromkeys(colors):  # distinct (colour, label) pairs, in order
        legend.setdefault(c, []).append(lab)
    handles: list[Any] = [Patch(facecolor=c, edgecolor="black", label=", ".join(labs)) for c, labs in legend.items()]
    if "single" in names:
        handles.append(
            ax.axhline(
                acc[names.index("single")],
                color="tab:orange",
                linestyle="--",
                linewidth=1,
                label="single (reference line)",
            )
        )
    lo = max(0.0, min(acc) - 10)
    ax.set(
        ylim=(lo, min(100.0, max(acc) + 5)),
        xlabel="method",
        ylabel="accuracy (%)",
        title="Members vs ensembles: ID test accuracy",
    )
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    ax.tick_params(axis="x", labelrotation=20)
    fig.savefig(path)


def plot_confusion(path: Path, method: str, pc: Mapping[str, Any]) -> None:
    """The confusion matrix of ``method`` on ID test (rows: true class, columns: predicted), counts in the cells."""
    names = list(pc["accuracy"])
    conf = np.asarray(pc["confusion"])
    fig = figure(1.0 + 0.7 * len(names), 0.8 + 0.6 * len(names))
    ax = fig.subplots()
    ax.imshow(conf, cmap="Blues")
    for (i, j), v in np.ndenumerate(conf):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color="white" if v > conf.max() / 2 else "black")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true class", title=f"{method}: confusion matrix (ID test)")
    fig.savefig(path)


def plot_drift(path: Path, drift: dict) -> None:
    """The drift statistic (log10) along each simulated stream, the switch and the alarm level."""
    fig = figure(7.0, 3.6)
    ax = fig.subplots()
    for name, r in drift["runs"].items():
        x = np.arange(1, len(r["trace_every_10"]) + 1) * 10
        ax.plot(
            x,
            r["trace_every_10"],
            lw=1.2,
            label=f"to {name}" + ("" if r["delay"] is None else f" (alarm +{r['delay']})"),
        )
    ax.axhline(drift["log10_threshold"], color="k", ls="--", lw=1, label="alarm level log10(1/delta)")
    ax.axvline(drift["switch_at"], color="grey", ls=":", lw=1, label="switch from ID test")
    ax.set_xlabel("inputs served")
    ax.set_ylabel("log10 drift statistic")
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path)


def plot_risk_coverage(path: Path, curve: dict, rules: list[dict]) -> None:
    """Risk among accepted vs accept rate on ID test, the certified rules marked with their targets."""
    fig = figure(5.5, 3.8)
    ax = fig.subplots()
    rate = np.asarray(curve["accept_rate"], dtype=float)
    risk = np.asarray([np.nan if v is None else v for v in curve["risk"]], dtype=float)
    ax.plot(rate, risk, lw=1.5, label="confidence threshold (OOD cut applied)")
    for r in rules:
        if r["certified"] and r["test_risk"] is not None:
            ax.scatter([r["test_accept_rate"]], [r["test_risk"]], zorder=3)
            ax.annotate(
                f"target {r['risk']}",
                (r["test_accept_rate"], r["test_risk"]),
                fontsize=7,
                xytext=(4, -8),
                textcoords="offset points",
            )
            ax.axhline(r["risk"], color="grey", lw=0.5, ls=":")
    ax.set_xlabel("accept rate (ID test)")
    ax.set_ylabel("risk among accepted")
    ax.legend(fontsize=7)
    fig.savefig(path)
