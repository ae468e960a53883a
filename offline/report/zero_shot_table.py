"""A zero-shot build's numbers, printed from its ``report.json``: ``python -m offline.report.zero_shot_table
ARTIFACT``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

TABLE_METHODS = ("single", "single_ts", "hydra", "ensemble_unfused")


def metrics_table(artifact: str | Path, methods: Sequence[str] = TABLE_METHODS) -> str:
    """Zero-shot accuracy, ECE, NLL and per-OOD-set AUROC / FPR95 (%) of ``methods`` from ``report.json``."""
    doc = json.loads((Path(artifact) / "report.json").read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    sets = list(doc.get("ood_kinds", {}))
    head = ["method", "acc %", "ECE %", "NLL"] + [f"{s} {k}" for s in [*sets, "avg"] for k in ("AUROC", "FPR95")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}"

    for m in methods:
        if m not in rows:
            continue
        r = rows[m]
        ood = [r["ood"].get(s, {}) for s in sets] + [r.get("ood_avg", {})]
        cells = [m, pct(r["acc"]), pct(r["ece"]), f"{r['nll']:.4f}"]
        cells += [pct(o.get(k)) for o in ood for k in ("auroc", "fpr95")]
        lines.append("| " + " | ".join(cells) + " |")
    kinds = ", ".join(f"{s}: {k}" for s, k in doc.get("ood_kinds", {}).items())
    return "\n".join([f"{doc['title']} (OOD sets: {kinds}; score {doc['extra'].get('ood_score')})", *lines])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m offline.report.zero_shot_table ARTIFACT``: print the zero-shot metrics table of a built
    artifact."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("artifact", help="artifact directory holding report.json")
    args = ap.parse_args(argv)
    print(metrics_table(args.artifact))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
