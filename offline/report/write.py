"""The report's entry point: ``write_report`` writes report.json, report.md and the plots of one build."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from offline.report.by_class import per_class
from offline.report.markdown import markdown
from offline.report.plots import (
    SERVED_PLOT,
    plot_confusion,
    plot_drift,
    plot_member_accuracy,
    plot_ood_hist,
    plot_reliability,
    plot_risk_coverage,
    plot_served_hist,
)
from offline.report.summary import summary_of
from offline.report.values import jsonable


def _write_plots(out: Path, rows: list[dict], ood_kinds: dict[str, str], plots: dict, extra: dict) -> list[str]:
    labels = np.asarray(plots["labels"])
    pdir = out / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    written = []
    rel = {m: plots[m]["member_probs_id"] for m in ("single", "hydra") if m in plots}
    if rel:
        plot_reliability(pdir / "reliability.png", labels, rel)
        written.append("plots/reliability.png")
    method = next((m for m in ("hydra", "ensemble_unfused", "single") if m in plots), None)
    if method is not None:
        kinds = plots.get("ood_kinds", ood_kinds)
        p = plots[method]
        score = extra.get("ood_score")
        thr = extra.get("ood_threshold")
        for field, fname in (("msp", "ood_hist_msp.png"), ("mutual_information", "ood_hist_mi.png")):
            t = thr if method == "hydra" and score == field and thr is not None else None
            plot_ood_hist(pdir / fname, method, field, p["member_probs_id"], p.get("member_probs_ood", {}), kinds, t)
            written.append(f"plots/{fname}")
    if rows and all("acc" in r for r in rows):
        plot_member_accuracy(pdir / "member_accuracy.png", rows)
        written.append("plots/member_accuracy.png")
    if pc := extra.get("per_class"):
        shown = "hydra" if "hydra" in pc else next(iter(pc))
        plot_confusion(pdir / "confusion.png", shown, pc[shown])
        written.append("plots/confusion.png")
    if served := plots.get("served"):
        flag = extra.get("served_flag") or {}
        flag = flag if flag.get("score") == served["score"] else {}
        plot_served_hist(pdir / SERVED_PLOT, served, plots.get("ood_kinds", ood_kinds), flag)
        written.append(f"plots/{SERVED_PLOT}")
    hydra = ((extra.get("guarantees_report") or {}).get("methods") or {}).get("hydra") or {}
    if hydra.get("drift"):
        plot_drift(pdir / "drift.png", hydra["drift"])
        written.append("plots/drift.png")
    if hydra.get("risk_coverage"):
        plot_risk_coverage(pdir / "risk_coverage.png", hydra["risk_coverage"], hydra["selective"])
        written.append("plots/risk_coverage.png")
    return written


def write_report(out: Path, rows: list[dict], ood_kinds: dict[str, str], plots: dict, title: str, extra: dict) -> dict:
    """Write ``out/report.json``, ``out/report.md`` and ``out/plots/*.png``; return the manifest summary.

    Args:
        out: artifact directory.
        rows: per method, ``evaluate_predictions(...)`` plus ``method``, ``params`` and
            ``latency_ms: {"batch1": measure_latency(...), "batch8": ...}``. Optional per row:

            - ``temperature``: the temperature its metrics were computed at (the ID table's heading says it
              when all rows share one, else a ``T`` column does);
            - ``calibrated: {"temperature", "acc", "nll", "brier", "ece", "aece"}``: the method at its own
              temperature fitted on ID validation data (a second ID table);
            - ``ood_scores: {score: {"ood": {set: {"auroc", "fpr95"}}, "avg": {"auroc", "fpr95"}}}``: its OOD
              detection with each score it has (tables of mean AUROC / FPR95 by score, and the served score
              per set).
        ood_kinds: OOD set name -> kind (``near``, ``far``, ...).
        plots: ``{"labels": (N,), "ood_kinds": {...}, <method>: {"member_probs_id": (N, M, C),
            "member_probs_ood": {name: (N', M, C)}}}``; optionally ``"served": {"score", "threshold",
            "id": (N,), "ood": {name: (N',)}}``, the served OOD score on the ID and OOD test sets
            (``plots/ood_hist_served.png``).
        title: report heading.
        extra: build facts shown in the report (temperature, threshold, timings, ...). Optional keys with a
            section of their own (:data:`SECTION_KEYS`, not repeated in the build facts):

            - ``ood_candidates: {score: {"threshold", "id_val_flag_rate", "val_recall": {ood_val_set: float},
              "val_mean_recall"}}``, ``ood_selected`` (the served score's name) and ``ood_forced`` (true when
              the config forced the score rather than selecting it): the score selection on validation sets;
            - ``served_flag: {"score", "threshold", "id_test_flag_rate", "recall": {ood_test_set: float}}``:
              the served flag on test data;
            - ``no_ood_data``: true when the build had no OOD data (one line instead of the OOD tables).

            Rates and recalls are fractions (shown in %).

    Returns per method the headline numbers (:func:`summary_of`).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = plots.get("class_names")
    if names:  # per method, on the ID test set, by name
        extra = {
            **extra,
            "per_class": {
                r["method"]: per_class(plots["labels"], plots[r["method"]]["member_probs_id"], names)
                for r in rows
                if r["method"] in plots
            },
        }
    written = _write_plots(out, rows, ood_kinds, plots, extra)
    doc = {"title": title, "ood_kinds": ood_kinds, "rows": rows, "extra": extra, "plots": written}
    (out / "report.json").write_text(json.dumps(jsonable(doc), indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(markdown(rows, ood_kinds, title, extra, written))
    return summary_of(rows)
