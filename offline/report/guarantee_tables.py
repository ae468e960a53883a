"""The guarantees section of report.md: what the calibration split certifies (prediction sets, OOD p-values,
answers with a risk bound, the drift alarm), measured on the test sets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offline.report.markdown_tables import table
from offline.report.values import num, pct


def guarantees_section(extra: Mapping[str, Any]) -> list[str]:
    """What the calibration split certifies, measured on ID test and the OOD test sets, per method."""
    if not (g := extra.get("guarantees_report")):
        return []
    methods = g["methods"]
    alphas = [str(a) for a in g["alphas"]]
    hydra = methods.get("hydra", {})
    md = ["## Guarantees (calibration split)", ""] + _intro(g, hydra)
    md += _sets_tables(methods, alphas) + _p_value_tables(methods, alphas) + _selective_table(methods)
    if drift := hydra.get("drift"):
        md += _drift_table(drift)
    return md


def _intro(g: Mapping[str, Any], hydra: Mapping[str, Any]) -> list[str]:
    """How the guarantees were fitted and what to expect of them."""
    d = g.get("set_delta")
    sets = (
        f"coverage at least 1 - alpha with probability {1 - d:g} over the calibration draw (training-conditional "
        f"sets, delta {d:g})"
        if d
        else "coverage at least 1 - alpha on average over the calibration draw (marginal sets)"
    )
    return [
        f"Fitted on the calibration split alone ({hydra.get('calibration_size', '–')} ID inputs nothing else of "
        f"the build touched), each method at its own temperature with its own statistics of the served score "
        f"(`{g['metric']}`), measured on ID test. Sets: `{g['method']}` scores; the smallest alpha the split "
        f"allows is {num(hydra.get('min_alpha'), 5)} (per class, Mondrian: "
        f"{', '.join(num(a, 4) for a in hydra.get('min_alpha_per_class', []))}). Expected: {sets}, within the "
        "test set's sampling error; false alarms at most alpha; realised risk at most the target with "
        "probability 1 - delta.",
        "",
    ]


def _alpha_header(alphas: list[str], first: str = "Method") -> list[str]:
    return [first] + [f"alpha {a}" for a in alphas]


def _sets_tables(methods: Mapping[str, Any], alphas: list[str]) -> list[str]:
    """Prediction sets: coverage and mean size per method and alpha, then the smallest class coverage."""
    hydra = methods.get("hydra", {})
    md = ["### Prediction sets: coverage % / mean size (ID test)", ""]
    body = [
        [m] + [f"{pct(r['coverage'][a]['coverage'])} / {r['coverage'][a]['mean_size']:.2f}" for a in alphas]
        for m, r in methods.items()
    ]
    md += table(_alpha_header(alphas), body) + [""]
    md += ["Smallest class coverage % (marginal sets; Mondrian sets for Hydra in the last row):", ""]
    body = [[m] + [pct(r["coverage"][a]["min_class"]) for a in alphas] for m, r in methods.items()]
    if "mondrian" in hydra:
        body.append(
            ["hydra (Mondrian)"]
            + [f"{pct(hydra['mondrian'][a]['min_class'])} / {hydra['mondrian'][a]['mean_size']:.2f}" for a in alphas]
        )
    return md + table(_alpha_header(alphas), body) + [""]


def _p_value_tables(methods: Mapping[str, Any], alphas: list[str]) -> list[str]:
    """OOD p-values: false alarms on ID test per method and alpha, then Hydra's recall on each OOD test set."""
    hydra = methods.get("hydra", {})
    md = ["### OOD p-values: false alarms on ID test % (flag = p-value <= alpha)", ""]
    body = [[m] + [pct(r["p_values"][a]["false_alarm"]) for a in alphas] for m, r in methods.items()]
    md += table(_alpha_header(alphas), body) + [""]
    if hydra.get("p_values"):
        sets = list(hydra["p_values"][alphas[0]]["recall"])
        md += ["Hydra's recall % on each OOD test set:", ""]
        body = [[n] + [pct(hydra["p_values"][a]["recall"][n]) for a in alphas] for n in sets]
        md += table(_alpha_header(alphas, "OOD test set"), body) + [""]
    return md


def _selective_table(methods: Mapping[str, Any]) -> list[str]:
    """Answers with a risk bound: realised risk and accept rate per method and target risk."""
    md = ["### Answers with a risk bound: realised risk % among accepted / accept rate % (ID test)", ""]
    risks = [str(r["risk"]) for r in next(iter(methods.values()))["selective"]]
    body = []
    for m, r in methods.items():
        cells = []
        for t in r["selective"]:
            cells.append(
                "not certified" if not t["certified"] else f"{pct(t['test_risk'])} / {pct(t['test_accept_rate'])}"
            )
        body.append([m, *cells])
    return md + table(["Method"] + [f"risk {x}" for x in risks], body) + [""]


def _drift_table(drift: Mapping[str, Any]) -> list[str]:
    """The drift alarm on simulated streams: false alarms on ID streams; per OOD test set, the delay after a sustained
    switch to a share of its inputs, the clearing after the return, and the bursts that fired it."""
    n, share = drift["streams"], f"{100 * drift['foreign_share']:.0f} %"
    bound = f"{100 * drift['null_bound']:.3g} %"
    md = ["### Drift alarm (simulated streams of Hydra's served scores)", ""]
    md += [
        f"The alarm goes on when its statistic reaches A = {drift['arl']:,.0f} and clears by itself once the traffic "
        f'is back to normal (docs/api.md, "Guarantees"). {drift["null_alarms"]} of {drift["null_streams"]} ID '
        f"streams of {drift['null_stream_inputs']:,} inputs (resampled from ID test and validation) raised it; the "
        f"guarantee bounds the share by delta + {drift['null_stream_inputs']:,} / A = {bound}. "
        f"Per OOD test set, {n} streams of {drift['switch_at']:,} ID test inputs switch to {share} of the set's "
        f"inputs for {drift['switch_inputs']:,} inputs, then return to ID test; {n} more have a burst of "
        f"{drift['burst']} of the set's inputs inside ID traffic:",
        "",
    ]
    body = [
        [
            name,
            str(r["false_alarms"]),
            f"{r['fired']} of {n}",
            _median_max(r["delay_median"], r["delay_max"]),
            f"{r['cleared']} of {r['on_at_return']}",
            _median_max(r["clear_median"], r["clear_max"]),
            f"{r['burst_fired']} of {n}",
        ]
        for name, r in drift["runs"].items()
    ]
    header = [
        "Switch to",
        "Alarms before the switch",
        "Fired during the switch",
        "Inputs until the alarm (median / largest)",
        "Cleared after the return (of those on at it)",
        "Inputs until clear (median / largest)",
        f"Bursts of {drift['burst']} that fired it",
    ]
    return md + table(header, body) + [""]


def _median_max(median: float | None, largest: int | None) -> str:
    return "–" if median is None or largest is None else f"{median:.0f} / {largest}"
