"""The in-distribution sections of report.md: every method at one temperature (or a ``T`` column), then every
method at its own temperature fitted on ID validation data."""

from __future__ import annotations

from offline.report.markdown_tables import Cell, cell, method_table
from offline.report.values import latency_cell, num, param_count, pct, sig4

_T_COLUMN: tuple[str, Cell] = ("T", cell(sig4, "temperature"))
# accuracy and calibration: the columns both tables show
_CALIBRATION_COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("Acc %", cell(pct, "acc")),
    ("NLL", cell(num, "nll")),
    ("Brier", cell(num, "brier")),
    ("ECE %", cell(pct, "ece")),
    ("aECE %", cell(pct, "aece")),
)
_ID_COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("Params", cell(param_count, "params")),
    *_CALIBRATION_COLUMNS,
    ("AURC %", cell(pct, "aurc")),
    ("MSP", cell(num, "msp_id")),
    ("Entropy", cell(num, "entropy_id")),
    ("MI", cell(num, "mi_id")),
    ("Disagr. %", cell(pct, "disagreement_id")),
    ("Lat. b1 ms", lambda r: latency_cell(r, "batch1")),
    ("Lat. b8 ms", lambda r: latency_cell(r, "batch8")),
)


def id_section(rows: list[dict]) -> list[str]:
    """The in-distribution table: one line per method, at the temperature the heading (or a ``T`` column) gives."""
    temps = {r.get("temperature") for r in rows}
    columns, at = _ID_COLUMNS, ""
    if len(temps) == 1 and None not in temps:
        at = f", at T = {sig4(temps.pop())}"
    elif temps != {None}:  # rows at different temperatures: say which, per row
        columns, at = (_T_COLUMN, *_ID_COLUMNS), ", each method at the temperature T"
    md = [f"## In-distribution (test set{at})", ""]
    md += [
        "Percentages for Acc, ECE, aECE, AURC and disagreement; NLL and entropies in nats; Brier of the mean "
        "prediction (0–2). AURC: area under the risk-coverage curve, answering the most confident first (MSP of "
        "the mean prediction; lower is better). Latency: median (min) ms per call, eager fp32.",
        "",
    ]
    return md + method_table(columns, ((r["method"], r) for r in rows))


_TS_COLUMNS: tuple[tuple[str, Cell], ...] = (_T_COLUMN, *_CALIBRATION_COLUMNS, ("AURC %", cell(pct, "aurc")))


def calibrated_section(rows: list[dict]) -> list[str]:
    """Every method that has ``calibrated``: its test metrics at its own temperature fitted on ID validation data."""
    entries = [(r["method"], r["calibrated"]) for r in rows if r.get("calibrated")]
    if not entries:
        return []
    md = ["", "## In-distribution (test set), each method at its own fitted temperature", ""]
    md += [
        "T: the method's temperature, fitted (NLL) on the ID validation set and applied to its logits before the "
        "softmax; calibration compared like with like, each method at its best temperature (AURC too: a "
        "temperature can reorder the inputs' confidences).",
        "",
    ]
    return md + method_table(_TS_COLUMNS, entries)
