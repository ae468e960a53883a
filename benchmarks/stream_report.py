"""The report of ``benchmarks/stream.py``: ``stream.md`` and ``plots/stream.png`` from its results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

__all__ = ["markdown", "plot"]


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def markdown(doc: dict[str, Any]) -> str:
    """The text of ``stream.md``: per model its streams, then the labelled streams, the false suspensions, the
    replicas, and the checks."""
    machine = (
        f"{doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs. One input per request, in order, a fresh "
        "server per stream, `HYDRA_DRIFT_POLICY=abstain`; shifted streams begin with `prefix` clean inputs and are "
        "counted from the shift's first input (Lorden's bound: `log A / KL` of the stream's binned p-values, the "
        'least mean delay of any detector with this false-alarm rate). "certified rule": '
        "what the rule accepts on the same answers without the alarm (the server before the policy). p: exact "
        'one-sided binomial p-value of "the error among accepted answers is above the risk target".'
    )
    lines = [*harness.page_head("Streams through a running server", doc, machine), ""]
    for m, info in doc["models"].items():
        lines += _model_lines(doc, m, info)
    for key, section in (("labelled", _labelled_lines), ("cached_false_suspensions", _cached_lines)):
        lines += [*section(doc), ""] if doc.get(key) else []
    lines += [*_replica_lines(doc), ""] if doc.get("replicas") else []
    lines += ["## Checks", ""] + [f"- {'PASS' if v else 'FAIL'} {k}" for k, v in doc["checks"].items()]
    return "\n".join(lines) + "\n"


def _model_lines(doc: dict[str, Any], m: str, info: dict[str, Any]) -> list[str]:
    lines = [
        f"## {info['name']} ({m}, risk target {_pct(info['risk'])} %)",
        "",
        "| stream | accuracy % | accepted % | error among accepted % [95 %] | p | certified rule: accepted % "
        "/ error % | first suspended input | Lorden's bound | accepts suspended | wrong accepts before the alarm: "
        "recalled | recalled: after the shift | flagged % | estimate gap (points) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in [x for x in doc["clean"] + doc["shifted"] if x["modality"] == m]:
        s, f = r["served"], r["certified_rule_without_alarm"]
        ci = "" if s["interval"] is None else f" [{_pct(s['interval'][0])}, {_pct(s['interval'][1])}]"
        name = "clean" if r["corruption"] is None else f"{r['corruption']} @{r['severity']}"
        name += f", {r['workers']} workers" if r.get("workers", 1) > 1 else ""
        lines.append(
            f"| {name} | {_pct(r['accuracy'])} | {_pct(s['accept_rate'])} | {_pct(s['accepted_error'])}{ci} | "
            f"{s['p_above_risk']:.3g} | {_pct(f['accept_rate'])} / {_pct(f['accepted_error'])} | "
            f"{r['first_suspended_input'] or '–'} | {r.get('lorden_bound') or '–'} | {r['accepts_suspended']} | "
            f"{_recall_cell(r)} | {_precision_cell(r)} | {_pct(r['flagged'])} | {100 * r['estimate_gap']:+.1f} |"
        )
    return [*lines, ""]


def _recall_cell(r: dict[str, Any]) -> str:
    if r.get("wrong_accepts_before_alarm") is None or r["corruption"] is None:
        return "–"
    return f"{r['wrong_accepts_recalled']} / {r['wrong_accepts_before_alarm']}"


def _precision_cell(r: dict[str, Any]) -> str:
    if not r.get("recalled") or r.get("recall_precision") is None:
        return "–"
    return f"{round(r['recall_precision'] * r['recalled'])} / {r['recalled']}"


def _section(title: str, *text: str) -> list[str]:
    """A report section: its heading, a blank line, then ``text``, one line each."""
    return [f"## {title}", "", *text]


def _labelled_lines(doc: dict[str, Any]) -> list[str]:
    lines = _section(
        "Labelled streams (adaptive requests, each label sent back before the next request)",
        "| model | stream | inputs | accuracy % | online rule: accepted % / error % [95 %] | certified rule "
        "without alarm: accepted % / error % | hindsight threshold after the alarm: accepted % | labels until the "
        "online rule accepts half of it |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    )
    for r in doc["labelled"]:
        s, f = r["served"], r["certified_rule_without_alarm"]
        ci = "" if s["interval"] is None else f" [{_pct(s['interval'][0])}, {_pct(s['interval'][1])}]"
        lines.append(
            f"| {doc['models'][r['modality']]['name']} | {r['corruption']} @{r['severity']} | {r['inputs']} | "
            f"{_pct(r['accuracy'])} | {_pct(s['accept_rate'])} / {_pct(s['accepted_error'])}{ci} | "
            f"{_pct(f['accept_rate'])} / {_pct(f['accepted_error'])} | {_pct(r.get('hindsight_share'))} | "
            f"{r.get('labels_to_half') or '–'} |"
        )
    return lines


def _cached_lines(doc: dict[str, Any]) -> list[str]:
    def line(name: str, c: dict[str, Any]) -> str:
        return (
            f"- {name}: {c['streams']} streams of {c['inputs']:,} inputs: {c['streams_with_a_suspension']} with a "
            f"suspension (bound {c['bound_streams']:.0f}: `m / A`, A = {c['arl']:,.0f}), "
            f"{100 * c['answers_suspended']:.3f} % of answers suspended"
        )

    rows = doc["cached_false_suspensions"].items()
    return ["## False suspensions on cached in-distribution outputs", "", *(line(n, c) for n, c in rows)]


def _replica_lines(doc: dict[str, Any]) -> list[str]:
    lines = _section(
        "Each replica's own alarm, or one shared by the fleet (simulated on cached outputs)",
        "R replicas behind a random load balancer; a shift to 30 % of an OOD set's inputs reaching every "
        "replica or only one. Fleet inputs from the shift to the first suspended answer to shifted traffic "
        "(median), whether answers to unshifted replicas were suspended, and the runs with a false suspension "
        "on 10,000 in-distribution inputs per replica.",
        "",
        "| model | R | shift reaches | own alarm: first suspension | shared: first suspension | unshifted "
        "suspended (own / shared) |",
        "|---|---:|---|---:|---:|---:|",
    )
    for name, rows in doc["replicas"].items():
        for r in [x for x in rows if "shift_reaches" in x]:
            good = "–"
            if "unshifted_replicas_suspended_own" in r:
                own, shared = r["unshifted_replicas_suspended_own"], r["unshifted_replicas_suspended_shared"]
                good = f"{100 * own:.0f} % / {100 * shared:.0f} %"
            lines.append(
                f"| {name} | {r['replicas']} | {r['shift_reaches']} | {r['own_first_suspension_median']} | "
                f"{r['shared_first_suspension_median']} | {good} |"
            )
    lines += ["", "| model | R | false suspensions, own (per replica) | shared (per fleet) | bound own / shared |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for name, rows in doc["replicas"].items():
        for r in [x for x in rows if "false_suspension_runs_shared" in x]:
            lines.append(
                f"| {name} | {r['replicas']} | {100 * r['false_suspension_runs_own_per_replica']:.1f} % | "
                f"{100 * r['false_suspension_runs_shared']:.1f} % | {100 * r['bound_own_per_replica']:.0f} % / "
                f"{100 * r['bound_shared']:.0f} % |"
            )
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    """Error among accepted answers against accuracy, one point per stream, its size growing with the answers
    accepted: the certified rule without the alarm (open) and the answers served (filled), per model; the risk
    target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(doc["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        rows = [r for r in doc["clean"] + doc["shifted"] if r["modality"] == m]
        for key, style, label in (
            ("certified_rule_without_alarm", dict(facecolors="none", edgecolors="tab:red"), "certified rule, no alarm"),
            ("served", dict(color="tab:blue", alpha=0.7), "served (alarm policy abstain)"),
        ):
            pts = [r for r in rows if r[key]["accepted_error"] is not None]
            if pts:
                ax.scatter(
                    [r["accuracy"] for r in pts],
                    [r[key]["accepted_error"] for r in pts],
                    s=[6 + 2.5 * r[key]["accepted"] ** 0.5 for r in pts],  # area grows with the answers accepted
                    label=label,
                    **style,
                )
        ax.axhline(doc["models"][m]["risk"], color="grey", ls="--", lw=1, label="risk target")
        ax.set_xlabel("stream accuracy")
        ax.set_ylabel("error among accepted answers")
        ax.set_title(f"{doc['models'][m]['name']}: {len(rows)} streams")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
