"""The frontier's tables and plot (:mod:`benchmarks.frontier`): each row's figures as mean ± std over its seeds,
each Hydra row against each other row (the verdict of :func:`benchmarks.recipe.verdict` over paired seeds), every
row under shift, the cost table, and the served-score AUROC against the multiply-add ratio."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.recipe import verdict

# the frontier's settings: its name for each, and the shipped config it builds
SETTINGS = {"image": "image-fast", "text": "text-fast", "zeroshot": "zeroshot-fast"}


def _ms(values: list[float | None], pct: bool = True, digits: int = 1) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "–"
    scale = 100 if pct else 1
    m = statistics.mean(v) * scale
    sd = statistics.stdev(v) * scale if len(v) > 1 else 0.0
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


# how each figure is shown: (in percent, decimals)
FORMAT = {"acc": (True, 1), "ece": (True, 1), "ece_ts": (True, 1), "aurc": (False, 4)}
FORMAT |= {k: (False, 3) for k in ("nll", "nll_ts", "brier")}
FORMAT |= {
    k: (True, 1) for k in ("auroc_msp", "auroc_served_near", "auroc_served_far", "auroc_msp_near", "auroc_msp_far")
}
QUALITY = [("acc %", "acc"), ("NLL T=1", "nll"), ("NLL own T", "nll_ts"), ("Brier", "brier"), ("ECE % T=1", "ece")]
QUALITY += [("ECE % own T", "ece_ts"), ("AURC", "aurc"), ("MSP AUROC %", "auroc_msp")]
QUALITY += [("served AUROC % near", "auroc_served_near"), ("served AUROC % far", "auroc_served_far")]
# Hydra against a baseline: (figure, key, lower is better)
VERSUS = (("served OOD AUROC", "auroc_served", False), ("MSP AUROC", "auroc_msp", False))
VERSUS += (("accuracy", "acc", False), ("ECE, own T", "ece_ts", True), ("NLL, own T", "nll_ts", True))
VERSUS += (("AURC", "aurc", True),)
# the default rule's figures: a candidate ships only if it ties or wins against the reference on each
RULE = ("served OOD AUROC", "accuracy", "AURC", "NLL, own T")
# the zero-shot table's columns: each method at its own row's temperature (Hydra at the served one)
ZERO_SHOT_COLUMNS = [("acc %", "acc"), ("ECE %", "ece"), ("NLL", "nll"), ("Brier", "brier")]
ZERO_SHOT_COLUMNS += [("AUROC % near", "auroc_msp_near"), ("AUROC % far", "auroc_msp_far")]


KEPT_NOTE = (
    "Seeds marked * are kept from the committed results: their builds' own figures, from an earlier run of this "
    "benchmark whose builds are not in the work folder."
)


def rows_kept(rows: dict[str, list[dict[str, Any]]]) -> bool:
    return any(f.get("kept") for fs in rows.values() for f in fs)


def _cells(fs: list[dict[str, Any]], columns: list[tuple[str, str]]) -> list[str]:
    """One table row's cells: the seeds (* for one kept from the committed results), then each column's mean ± std
    over them."""
    seeds = ", ".join(f"{f['seed']}{'*' if f.get('kept') else ''}" for f in fs)
    return [seeds] + [_ms([f[k] for f in fs], *FORMAT[k]) for _, k in columns]


def zero_shot_markdown(rows: dict[str, list[dict[str, Any]]], machine: str) -> str:
    """The zero-shot table, on the build's labels and on the user's words, and Hydra against Single per row."""
    lines = [
        "# zeroshot-fast: Hydra against the single zero-shot model",
        "",
        "Builds of `offline/configs/zeroshot-fast.yaml` (`python -m benchmarks.recipe --variants zs-vision "
        "zs-circuits zs-circuits-light --seeds 0 1 2`): the LiT-tuned base model (Single; Single + TS at its own "
        "temperature fitted on ID validation) and Hydra's members pruned from it without any training: the shipped "
        "Taylor members of the vision tower, and joint greedy circuits (CircAvg) over both towers, at the shipped "
        "budget of 6 heads and at 3. Hydra at its served temperature; AUROC "
        'with MSP, near and far OOD sets. Rows "(user\'s words)": the same models and images, the prompts of a '
        "user's own words for the same six classes (`benchmarks/recipe.py`, `FASHION_WORDS`). Mean ± std over the "
        f"seeds. Machine: {machine}.",
        "",
        "| method | seeds | " + " | ".join(c for c, _ in ZERO_SHOT_COLUMNS) + " |",
        "|---|---|" + "---|" * len(ZERO_SHOT_COLUMNS),
    ]
    for label, fs in rows.items():
        cells = [label, *_cells(fs, ZERO_SHOT_COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    if rows_kept(rows):
        lines += ["", KEPT_NOTE]
    lines += ["", "Hydra against Single over paired seeds (win / tie / loss, mean difference):", ""]
    lines += ["| Hydra | against | ECE | NLL | AUROC near | AUROC far |", "|---|---|---|---|---|---|"]
    for words in ("", " (user's words)"):
        for hydra in (r for r in rows if r.startswith("Hydra") and r.endswith(words) and (words or "words" not in r)):
            for single in (f"Single{words}", f"Single + TS{words}"):
                if single not in rows:
                    continue
                pairs = [(h, s) for h in rows[hydra] for s in rows[single] if h["seed"] == s["seed"]]
                cells = [hydra, single]
                for key, lower in (("ece", True), ("nll", True), ("auroc_msp_near", False), ("auroc_msp_far", False)):
                    hv, sv = [h[key] for h, _ in pairs], [s[key] for _, s in pairs]
                    scale = 1 if key == "nll" else 100
                    diff = (statistics.mean(hv) - statistics.mean(sv)) * scale if pairs else 0.0
                    cells.append(f"{verdict(hv, sv, lower)} ({diff:+.2f})" if pairs else "–")
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(
    setting: str,
    rows: dict[str, list[dict[str, Any]]],
    costs: dict[str, Any] | None,
    machine: str,
    rule: tuple[str, str] | None = None,
) -> str:
    """A setting's page; ``rule``: ``(reference row, shipped row)`` of the default rule (:func:`rule_lines`)."""
    served = next((r[0]["served_score"] for r in rows.values() if r), "?")
    lines = [
        f"# {SETTINGS[setting]}: Hydra among efficient ensembles",
        "",
        f"Builds of `offline/configs/{SETTINGS[setting]}.yaml` (`python -m benchmarks.recipe --variants baselines "
        "trunk-half trunk-3q --seeds 0 1 2 --shift-inputs 200`), mean ± std over the seeds each row lists; figures "
        f"on test data, scores and thresholds fixed on validation data. Served score: `{served}`. Machine: {machine}.",
        "",
        "| method | seeds | " + " | ".join(c for c, _ in QUALITY) + " | parameters |",
        "|---|---|" + "---|" * (len(QUALITY) + 1),
    ]
    for label, fs in rows.items():
        cells = [label, *_cells(fs, QUALITY)]
        cells.append(f"{fs[0]['params'] / 1e6:.2f} M")
        lines.append("| " + " | ".join(cells) + " |")
    if rows_kept(rows):
        lines += ["", KEPT_NOTE]
    lines += versus_lines(rows)
    lines += shift_lines(rows)
    lines += cost_lines(costs)
    lines += rule_lines(rows, costs, *rule) if rule else []
    return "\n".join(lines) + "\n"


def compare(rows: dict[str, list[dict[str, Any]]], mine: str, theirs: str) -> dict[str, tuple[str, float] | None]:
    """Row ``mine`` against row ``theirs`` over their paired seeds, per figure of :data:`VERSUS`: ``(verdict, mean
    difference in the table's unit)``, None where no seed has both."""
    pairs = [(h, o) for h in rows[mine] for o in rows[theirs] if h["seed"] == o["seed"]]
    out: dict[str, tuple[str, float] | None] = {}
    for name, key, lower in VERSUS:
        ok = [(h[key], o[key]) for h, o in pairs if h.get(key) is not None and o.get(key) is not None]
        if not ok:
            out[name] = None
            continue
        hv, ov = zip(*ok, strict=True)
        scale = 100 if key != "nll_ts" else 1
        out[name] = (verdict(list(hv), list(ov), lower), (statistics.mean(hv) - statistics.mean(ov)) * scale)
    return out


def versus_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each Hydra row against each other row over paired seeds: the verdict and Hydra's mean difference."""
    lines: list[str] = []
    versus = [(h, o) for h in rows if h.startswith("Hydra") for o in rows if o != h]  # each Hydra row, each other
    lines += [
        "",
        "Each Hydra row against each other row over paired seeds (win / tie / loss, Hydra's mean difference):",
    ]
    lines += ["", "| Hydra | against | " + " | ".join(v for v, *_ in VERSUS) + " |", "|---|---|" + "---|" * len(VERSUS)]
    for mine, theirs in versus:
        cells = [mine, theirs]
        for v in compare(rows, mine, theirs).values():
            cells.append("–" if v is None else f"{v[0]} ({v[1]:+.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def rule_lines(
    rows: dict[str, list[dict[str, Any]]], costs: dict[str, Any] | None, reference: str, shipped: str
) -> list[str]:
    """The default rule (module :mod:`benchmarks.frontier`): each Hydra row, cheapest first, against ``reference`` on
    :data:`RULE`; the first that ties or wins on each is the one to ship; what each gives up (its losses on the other
    figures)."""
    if reference not in rows or not costs:
        return []
    hydra = [r for r in rows if r.startswith("Hydra") and r in costs]
    hydra.sort(key=lambda r: costs[r]["macs_ratio"])
    lines = [
        "",
        f"The default rule: the cheapest Hydra row that ties or wins against {reference} on "
        + ", ".join(RULE)
        + " over the paired seeds:",
        "",
        "| Hydra row | multiply-adds / Single | " + " | ".join(RULE) + " | passes | gives up |",
        "|---|---|" + "---|" * (len(RULE) + 2),
    ]
    chosen = None
    for label in hydra:
        if label == reference:
            v: dict[str, tuple[str, float] | None] = {}
            passes = True
        else:
            v = compare(rows, label, reference)
            passes = all(v[n] is not None and not v[n][0].startswith("loss") for n in RULE)  # type: ignore[index]
        chosen = chosen or (label if passes else None)
        cells = [f"{v[n][0]} ({v[n][1]:+.2f})" if v.get(n) else "–" for n in RULE]
        given = [f"{n} {x[0]} ({x[1]:+.2f})" for n, x in v.items() if n not in RULE and x and x[0].startswith("loss")]
        lines.append(
            f"| {label} | {costs[label]['macs_ratio']:.2f} | "
            + " | ".join(cells)
            + f" | {'yes' if passes else 'no'} | {', '.join(given) or '–'} |"
        )
    ships = "the row the configs ship" if chosen == shipped else f"the configs ship {shipped}"
    return [*lines, "", f"Chosen by the rule: **{chosen}** ({ships})."]


def cost_lines(costs: dict[str, Any] | None) -> list[str]:
    """The cost table: multiply-adds against Single's and ms per batch, eager and as served."""
    if not costs:
        return []
    lines: list[str] = []
    setup = costs.get("_setup", {})
    lines += [
        "",
        (
            "Cost (kept from the committed results: measured in an earlier run of this benchmark), "
            if setup.get("kept")
            else "Cost, "
        )
        + f"side by side in one process ({setup.get('reps')} interleaved rounds, {setup.get('threads')} "
        f"threads; L = {setup.get('depth')} blocks, M = {setup.get('members')}): multiply-adds per input against "
        "Single's, and ms per batch (min / median) in eager PyTorch; Hydra also as served (TorchScript).",
        "",
        "| method | multiply-adds / Single | batch 1 ms | batch 32 ms | served batch 1 ms | served batch 32 ms |",
        "|---|---|---|---|---|---|",
    ]
    for label, c in costs.items():
        if label.startswith("_"):
            continue

        def t(key: str, c: dict[str, Any] = c) -> str:
            return f"{c[key]['min_ms']:.1f} / {c[key]['median_ms']:.1f}" if key in c else "–"

        lines.append(
            f"| {label} | {c['macs_ratio']:.2f} | {t('batch1')} | {t('batch32')} | {t('served_batch1')} "
            f"| {t('served_batch32')} |"
        )
    return lines


# under shift: (column, metric, lower is better)
SHIFT = (("acc %", "acc", False), ("Brier", "brier", True), ("ECE %", "ece", True), ("NLL", "nll", True))


def _shift_value(f: dict[str, Any], key: str, severity: str = "mean") -> float | None:
    return ((f.get("shift") or {}).get(severity) or {}).get(key)


def shift_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every row under shift, over the seeds whose builds have a shift section: the mean over corruptions and
    severities, the accuracy and Brier per severity, and each Hydra row against each other row."""
    shifted = {label: [f for f in fs if f.get("shift")] for label, fs in rows.items()}
    shifted = {label: fs for label, fs in shifted.items() if fs}
    if not shifted:
        return []
    severities = [k for k in next(iter(shifted.values()))[0]["shift"] if k != "mean"]
    lines = [
        "",
        f"Under shift: the builds' corrupted copies of ID test inputs (`data.shift_inputs`) at severities "
        f"{', '.join(severities)}, each method at its own temperature; mean over the corruptions and severities, "
        "then accuracy and Brier per severity (mean over the corruptions). Seeds: the builds with a shift section.",
        "",
        "| method | seeds | "
        + " | ".join(c for c, *_ in SHIFT)
        + " | "
        + " | ".join(f"acc % / Brier @{s}" for s in severities)
        + " |",
        "|---|---|" + "---|" * (len(SHIFT) + len(severities)),
    ]
    for label, fs in shifted.items():
        cells = [label, ", ".join(str(f["seed"]) for f in fs)]
        cells += [_ms([_shift_value(f, k) for f in fs], *FORMAT[k]) for _, k, _ in SHIFT]
        for sev in severities:
            acc = _ms([_shift_value(f, "acc", sev) for f in fs], True, 1)
            cells.append(f"{acc} / {_ms([_shift_value(f, 'brier', sev) for f in fs], False, 3)}")
        lines.append("| " + " | ".join(cells) + " |")
    pairs = [(h, o) for h in shifted if h.startswith("Hydra") for o in shifted if o != h]
    if pairs:
        lines += ["", "Under shift, each Hydra row against each other row over paired seeds:", ""]
        lines += ["| Hydra | against | " + " | ".join(c for c, *_ in SHIFT) + " |", "|---|---|" + "---|" * len(SHIFT)]
    for mine, theirs in pairs:
        cells = [mine, theirs]
        for _, key, lower in SHIFT:
            ok = [
                (_shift_value(h, key), _shift_value(o, key))
                for h in shifted[mine]
                for o in shifted[theirs]
                if h["seed"] == o["seed"] and _shift_value(h, key) is not None and _shift_value(o, key) is not None
            ]
            if not ok:
                cells.append("–")
                continue
            hv, ov = zip(*ok, strict=True)
            diff = (statistics.mean(hv) - statistics.mean(ov)) * (1 if key in ("nll", "brier") else 100)
            cells.append(f"{verdict(list(hv), list(ov), lower)} ({diff:+.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(setting: str, rows: dict[str, list[dict[str, Any]]], costs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, fs in rows.items():
        if label not in costs:
            continue
        v = [f["auroc_served"] * 100 for f in fs if f["auroc_served"] is not None]
        if not v:
            continue
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        x = costs[label]["macs_ratio"]
        ax.errorbar([x], [statistics.mean(v)], yerr=[sd], fmt="o", capsize=3, label=label)
    served = next((r[0]["served_score"] for r in rows.values() if r), "?")
    ax.set_xlabel("multiply-adds per input / Single's")
    ax.set_ylabel(f"OOD AUROC % ({served}, mean over OOD sets)")
    ax.set_title(f"{SETTINGS[setting]}: OOD detection against cost (mean ± std, 3 seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
