"""The markdown tables of ``benchmarks/run.py``'s results (``results/tables.md`` and the README block): quality
per setting with the quality targets, cost per layout, ablations per setting."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from benchmarks import cost as cost_mod
from benchmarks import quality as q

METHOD_NAMES = {
    "single": "Single",
    "deep_ensemble": "Deep Ensemble",
    "mc_dropout": "MC Dropout",
    "taylor": "Taylor-pruned single",
    "circavg": "CircAvg-pruned single",
    "hydra_taylor": "Hydra (Taylor)",
    "hydra_circ": "Hydra (Circ)",
    "member": "one pruned member",
    "hydra": "Hydra fused",
    "hydra_unfused": "Hydra unfused",
}


def _pct(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _cell(vals: Sequence[float], scale: float = 100.0, digits: int = 1) -> str:
    m, s = q.mean_std(vals)
    if not math.isfinite(m):
        return "–"
    if len([v for v in vals if v is not None]) > 1:
        return f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}"
    return f"{scale * m:.{digits}f}"


def group(rows: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """Rows grouped by method (and MC Dropout samples), in the paper's order."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = METHOD_NAMES.get(r["method"], r["method"])
        if r["method"] == "mc_dropout":
            label += f" ({r['samples']} samples)"
        groups.setdefault(label, []).append(r)
    order = {m: i for i, m in enumerate(q.METHODS)}
    return sorted(groups.items(), key=lambda kv: (order.get(kv[1][0]["method"], 99), kv[1][0].get("samples", 0)))


def _sections(
    rows: Sequence[dict], field: str, values: Iterable[str], runs: dict
) -> Iterator[tuple[str, list[dict], dict]]:
    """``(value, its rows, its run metadata)`` for each of ``values``, in that order, that some row has as ``field``.

    Values without rows get no table (a part may not have been run for every setting / layout yet).
    """
    for value in values:
        rs = [r for r in rows if r[field] == value]
        if rs:
            yield value, rs, runs.get(value, {})


def quality_tables(rows: Sequence[dict], runs: dict) -> list[str]:
    out = []
    for setting, rs, meta in _sections(rows, "setting", q.SETTINGS, runs):
        sets = {n: v["kind"] for n, v in rs[0]["ood"].items()}
        out += [
            f"#### Quality, {setting} setting ({meta.get('mode', '?')} mode)",
            "",
            f"Sizes: {json.dumps(meta.get('sizes', {}))}; OOD sets: "
            + ", ".join(f"{n} ({k})" for n, k in sets.items())
            + ". Percent; NLL in nats; mean ± std over seeds where there are several (n = seeds). "
            "OOD: MSP score, OOD positive, near / far = mean over the sets of that kind.",
            "",
            "| method | n | Acc ↑ | NLL ↓ | Brier ↓ | ECE ↓ | aECE ↓ | near AUROC ↑ | near FPR95 ↓ "
            "| near AUPR-in ↑ | far AUROC ↑ | far FPR95 ↓ | far AUPR-in ↑ | MI ID | MI OOD | DI ID | DI OOD |",
            "|" + "---|" * 17,
        ]
        for label, g in group(rs):
            cells = [
                label,
                str(len(g)),
                _cell([r["acc"] for r in g]),
                _cell([r["nll"] for r in g], 1, 3),
                _cell([r["brier"] for r in g], 1, 3),
                _cell([r["ece"] for r in g]),
                _cell([r["aece"] for r in g]),
            ]
            for kind in ("near", "far"):
                for m in ("auroc", "fpr95", "aupr_in"):
                    cells.append(_cell([q.by_kind(r, kind, m) for r in g]))
            cells += [
                _cell([r["mi_id"] for r in g], 1, 4),
                _cell([r["mi_ood"] for r in g], 1, 4),
                _cell([r["disagreement_id"] for r in g]),
                _cell([r["disagreement_ood"] for r in g]),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out += [""] + per_set_table(rs) + [""] + target_lines(rs) + [""]
    return out


def per_set_table(rows: Sequence[dict]) -> list[str]:
    """AUROC per OOD set (mean over seeds)."""
    sets = list(rows[0]["ood"])
    out = ["| method | " + " | ".join(f"{s} AUROC" for s in sets) + " |", "|" + "---|" * (len(sets) + 1)]
    for label, g in group(rows):
        out.append(f"| {label} | " + " | ".join(_cell([r["ood"][s]["auroc"] for r in g]) for s in sets) + " |")
    return out


def avg_auroc(r: dict) -> float:
    return float(np.mean([v["auroc"] for v in r["ood"].values()]))


def target_lines(rows: Sequence[dict]) -> list[str]:
    """The issue's quality targets, checked on these rows (AUROC averaged over all OOD sets)."""

    def mean_of(method: str, f) -> float:
        return q.mean_std([f(r) for r in rows if r["method"] == method])[0]

    single_auroc, de_auroc = mean_of("single", avg_auroc), mean_of("deep_ensemble", avg_auroc)
    single_ece = mean_of("single", lambda r: r["ece"])
    out = ["| target | Hydra (Taylor) | Hydra (Circ) | reference |", "|---|---|---|---|"]
    for name, test, ref in (
        ("OOD AUROC ≥ Single", lambda a, e: a >= single_auroc, f"Single {_pct(single_auroc)}"),
        ("OOD AUROC ≥ Deep Ensemble − 1 pt", lambda a, e: a >= de_auroc - 0.01, f"Deep Ensemble {_pct(de_auroc)}"),
        ("ECE ≤ Single", lambda a, e: e <= single_ece, f"Single ECE {_pct(single_ece)}"),
    ):
        cells = []
        for m in ("hydra_taylor", "hydra_circ"):
            a, e = mean_of(m, avg_auroc), mean_of(m, lambda r: r["ece"])
            if not math.isfinite(a):
                cells.append("–")
                continue
            val = f"AUROC {_pct(a)}" if "AUROC" in name else f"ECE {_pct(e)}"
            cells.append(f"{val}: {'met' if test(a, e) else '**not met**'}")
        out.append(f"| {name} | {cells[0]} | {cells[1]} | {ref} |")
    return out


def cost_tables(rows: Sequence[dict], runs: dict) -> list[str]:
    out = []
    ratio = {
        (r["layout"], r["device"], r["backend"], r["precision"], r["batch"], r["method"]): r
        for r in cost_mod.ratios(rows, "single")
    }
    to_de = {
        (r["layout"], r["device"], r["backend"], r["precision"], r["batch"], r["method"]): r
        for r in cost_mod.ratios(rows, "deep_ensemble")
    }
    for layout, rs, meta in _sections(rows, "layout", cost_mod.LAYOUTS, runs):
        first = {r["method"]: r for r in rs}
        out += [
            f"#### Cost, {layout} ({rs[0]['members']} members, {rs[0]['keep']} heads kept per layer; "
            f"{rs[0].get('device_name', '')}; {rs[0]['repeats']} interleaved repeats; "
            f"{meta.get('mode', '?')} mode)",
            "",
            "| method | params (M) | GMAC / input | params / Single | MACs / Single |",
            "|---|---|---|---|---|",
        ]
        for m in cost_mod.METHODS:
            if m in first:
                r, s1 = first[m], first["single"]
                out.append(
                    f"| {METHOD_NAMES.get(m, m)} | {r['params'] / 1e6:.1f} | {r['macs'] / 1e9:.3f} | "
                    f"{r['params'] / s1['params']:.2f} | {r['macs'] / s1['macs']:.2f} |"
                )
        out += [
            "",
            "Latency, ms (min / median); ratios min / median, within one backend; Hydra's GFLOPS and its "
            "share of the machine's matmul peak measured in the same run (when recorded).",
            "",
            "| device | backend | precision | batch | "
            + " | ".join(METHOD_NAMES.get(m, m) for m in cost_mod.METHODS)
            + " | Hydra / Single | Hydra / Deep Ensemble | Hydra GFLOPS (peak share) |",
            "|" + "---|" * (4 + len(cost_mod.METHODS) + 3),
        ]
        keys = sorted(
            {(r["device"], r.get("backend", "eager"), r["precision"], r["batch"]) for r in rs},
            key=lambda k: (k[0], cost_mod.BACKENDS.index(k[1]), k[2], k[3]),
        )
        for dev, be, prec, b in keys:
            cells = [dev, be, prec, str(b)]
            cell = {
                x["method"]: x
                for x in rs
                if (x["device"], x.get("backend", "eager"), x["precision"], x["batch"]) == (dev, be, prec, b)
            }
            for m in cost_mod.METHODS:
                r = cell.get(m)
                cells.append("–" if r is None else f"{r['latency_ms_min']:.1f} / {r['latency_ms_median']:.1f}")
            for table in (ratio, to_de):
                r = table.get((layout, dev, be, prec, b, "hydra"))
                cells.append("–" if r is None else f"{r['ratio_min']:.2f} / {r['ratio_median']:.2f}")
            h = cell.get("hydra", {})
            cells.append(f"{h['gflops']:.0f} ({100 * h['peak_fraction']:.0f} %)" if "peak_fraction" in h else "–")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def ablation_tables(rows: Sequence[dict], runs: dict) -> list[str]:
    out = []
    for setting, rs, meta in _sections(rows, "setting", q.SETTINGS, runs):
        out += [
            f"#### Ablations, {setting} setting ({rs[0]['method']}, Hydra seed 0, {meta.get('mode', '?')} mode)",
            "",
            "| ablation | value | Acc | ECE | near AUROC | far AUROC | near FPR95 | far FPR95 | MI ID | MI OOD "
            "| DI ID | DI OOD | params (M) |",
            "|" + "---|" * 13,
        ]
        for r in rs:
            cells = [
                r["ablation"],
                str(r["value"]),
                _pct(r["acc"]),
                _pct(r["ece"]),
                _pct(q.by_kind(r, "near", "auroc")),
                _pct(q.by_kind(r, "far", "auroc")),
                _pct(q.by_kind(r, "near", "fpr95")),
                _pct(q.by_kind(r, "far", "fpr95")),
                f"{r['mi_id']:.4f}",
                f"{r['mi_ood']:.4f}",
                _pct(r["disagreement_id"]),
                _pct(r["disagreement_ood"]),
                f"{r['params'] / 1e6:.2f}",
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out
