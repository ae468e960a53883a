"""The shift section of report.md: every method on corrupted copies of ID test inputs (the ``shift`` block of
:func:`offline.stages.shift.shift_report`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .tables import cell, method_table
from .values import num, pct

# the section's columns: (header, key in a summary row, format)
SHIFT_COLUMNS = (
    ("Acc %", "acc", pct),
    ("ECE %", "ece", pct),
    ("NLL", "nll", num),
    ("AURC", "aurc", num),
    ("Accepted %", "accept_rate", pct),
    ("Error among accepted %", "accepted_error", pct),
)


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
    cols = [
        (h, cell(fmt, key))
        for h, key, fmt in SHIFT_COLUMNS
        if any(key in m["summary"]["mean"] for m in methods.values())
    ]
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
