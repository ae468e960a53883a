"""The text of report.md: the sections in their order, then the build facts and the plots."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from offline.report.by_class import per_class_section
from offline.report.guarantee_tables import guarantees_section
from offline.report.id_tables import calibrated_section, id_section
from offline.report.ood_tables import ood_section, scores_section, selection_section, served_flag_section
from offline.report.shift_tables import shift_section
from offline.report.values import fact_text

# ``extra`` keys with a section of their own (not repeated in the build facts)
SECTION_KEYS = (
    "ood_candidates",
    "ood_selected",
    "ood_forced",
    "served_flag",
    "no_ood_data",
    "guarantees_report",
    "per_class",
    "shift",
)


def _build_section(extra: dict, plots: list[str]) -> list[str]:
    """Build facts as a (nested) list (less what has a section of its own), then the plots, if any."""
    md = ["## Build", ""]
    for k, v in extra.items():
        if k in SECTION_KEYS:
            continue
        if isinstance(v, Mapping):
            md += [f"- **{k}**:"] + [f"  - {kk}: {fact_text(vv)}" for kk, vv in v.items()]
        else:
            md += [f"- **{k}**: {fact_text(v)}"]
    if plots:
        md += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return md


def markdown(rows: list[dict], ood_kinds: dict[str, str], title: str, extra: dict, plots: list[str]) -> str:
    """The text of ``report.md``: title, ID tables, OOD tables, score selection, served flag, build facts, plots."""
    score = next((r.get("ood_score") for r in rows if r.get("ood_score")), extra.get("ood_score", "msp"))
    served = extra.get("ood_selected") or (extra.get("served_flag") or {}).get("score")
    md = [f"# {title}", ""] + id_section(rows) + calibrated_section(rows)
    if extra.get("no_ood_data"):
        md += ["", "## OOD detection", "", "This build had no OOD data: no OOD detection results.", ""]
    else:
        md += ood_section(rows, ood_kinds, score) + scores_section(rows, ood_kinds, served)
    md += per_class_section(extra) + shift_section(extra)
    md += selection_section(extra) + served_flag_section(extra, ood_kinds) + guarantees_section(extra)
    md += _build_section(extra, plots)
    return "\n".join(md) + "\n"
