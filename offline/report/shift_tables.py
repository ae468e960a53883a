"""The shift section of report.md: every method on corrupted copies of ID test inputs (the ``shift`` block of
:func:`offline.stages.shift_eval.shift_report`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offline.report.markdown_tables import cell, method_table
from offline.report.values import num, pct

# the section's columns: key in a summary row -> header; rates and errors in %, NLL, Brier and AURC as numbers
SHIFT_COLUMNS = {
    "acc": "Acc %",
    "ece": "ECE %",
    "nll": "NLL",
    "brier": "Brier",
    "aurc": "AURC",
    "accept_rate": "Accepted %",
    "accepted_error": "Error among accepted %",
}
NUMBERS = ("nll", "brier", "aurc")


def shift_section(doc: Mapping[str, Any]) -> list[str]:
    """Per method its figures averaged over every corruption and severity, then by severity (averaged over the
    corruptions); the figures per corruption are in report.json (``extra.shift``)."""
    shift = doc.get("shift") or {}
    methods = shift.get("methods") or {}
    if not methods:
        return []
    first = next(iter(methods.values()))
    copies = list(first["sets"])
    kinds = list(dict.fromkeys(c.rsplit("@", 1)[0] for c in copies))
    severities = [k for k in first["summary"] if k != "mean"]
    present = {k for m in methods.values() for k in m["summary"]["mean"]}
    cols = [(h, cell(num if k in NUMBERS else pct, k)) for k, h in SHIFT_COLUMNS.items() if k in present]
    risk = shift.get("risk")
    md = [
        "",
        "## Shifted inputs (corrupted ID test copies)",
        "",
        f"{len(copies) // max(len(severities), 1)} corruptions ({', '.join(kinds)}) at severities "
        f"{', '.join(severities)}; each method at its own temperature fitted on ID validation."
        + (f" Accepted: the method's own risk rule at the {pct(risk)} % target." if risk is not None else ""),
        "",
        "Mean over every corruption and severity:",
        "",
    ]
    md += method_table(cols, ((name, m["summary"]["mean"]) for name, m in methods.items()))
    for s in severities:
        md += ["", f"Severity {s} (mean over the corruptions):", ""]
        md += method_table(cols, ((name, m["summary"][s]) for name, m in methods.items()))
    return md
