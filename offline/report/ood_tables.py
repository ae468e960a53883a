"""The OOD sections of report.md: detection per OOD set and on average, AUROC / FPR95 by score, how the served
score was selected on the validation sets, and how its flag does on the test sets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from offline.report.markdown_tables import Cell, cell, method_table, table
from offline.report.summary import OOD_KEYS
from offline.report.values import finite, num, pct, sig4
from service.core.scores import REPORT_ORDER

# the order of OOD score columns; scores not listed follow in the order they appear
SCORE_ORDER = REPORT_ORDER  # the registry's report order (service.core.scores)
_OOD_HEADERS = ("AUROC %", "FPR95 %", "AUPR-In %", "AUPR-Out %")  # the headers of OOD_KEYS, in the same order
# one OOD set: the detection metrics are always there (a missing one is a bug), MI / disagreement may not be
_OOD_SET_COLUMNS: tuple[tuple[str, Cell], ...] = (
    *((h, cell(pct, k, required=True)) for h, k in zip(_OOD_HEADERS, OOD_KEYS, strict=True)),
    ("MI", cell(num, "mi")),
    ("Disagr. %", cell(pct, "disagreement")),
)
_OOD_AVG_COLUMNS: tuple[tuple[str, Cell], ...] = (
    *((h, lambda r, k=k: pct(r.get("ood_avg", {}).get(k))) for h, k in zip(_OOD_HEADERS, OOD_KEYS, strict=True)),
    ("MI ID", cell(num, "mi_id")),
    ("MI OOD", cell(num, "mi_ood")),
    ("Disagr. ID %", cell(pct, "disagreement_id")),
    ("Disagr. OOD %", cell(pct, "disagreement_ood")),
)


def ood_section(rows: list[dict], ood_kinds: dict[str, str], score: str) -> list[str]:
    """One OOD table per set (methods that were evaluated on it), then the average over sets."""
    sets = list(dict.fromkeys(n for r in rows for n in r.get("ood", {})))
    md = ["", f"## OOD detection (score: `{score}`)", ""]
    md += [
        "OOD is the positive class. FPR95: fraction of ID inputs flagged when 95% of the OOD inputs are "
        "(OpenOOD v1.5). AUPR-In: ID positive; AUPR-Out: OOD positive. MI (nats) and disagreement are "
        "means over the set's inputs.",
        "",
    ]
    for name in sets:
        md += [f"### {name} ({ood_kinds.get(name, 'ood')})", ""]
        entries = ((r["method"], o) for r in rows if (o := r.get("ood", {}).get(name)))
        md += method_table(_OOD_SET_COLUMNS, entries) + [""]
    if sets:
        md += ["### Average over OOD sets", ""]
        md += method_table(_OOD_AVG_COLUMNS, ((r["method"], r) for r in rows)) + [""]
    return md


def _score_names(rows: list[dict]) -> list[str]:
    """The OOD scores any row has, in :data:`SCORE_ORDER` (others after, as they appear)."""
    names = list(dict.fromkeys(n for r in rows for n in r.get("ood_scores") or {}))
    return sorted(names, key=lambda n: SCORE_ORDER.index(n) if n in SCORE_ORDER else len(SCORE_ORDER))


def _score_table(rows: list[dict], names: list[str], key: str, served: str | None, best: Callable) -> list[str]:
    """One line per method with ``ood_scores``: the mean ``key`` over OOD sets per score, the method's best bold."""
    body = []
    for r in rows:
        if not (scores := r.get("ood_scores")):
            continue
        vals = [scores[n].get("avg", {}).get(key) if n in scores else None for n in names]
        top = best([v for v in vals if finite(v)], default=None)
        body.append([r["method"], *(f"**{pct(v)}**" if top is not None and v == top else pct(v) for v in vals)])
    return table(["Method", *(f"{n} (served)" if n == served else n for n in names)], body)


def _served_sets_table(rows: list[dict], ood_kinds: dict[str, str], served: str | None) -> list[str]:
    """AUROC and FPR95 of every method on every OOD test set with the served score."""
    entries = [(r["method"], sc[served]) for r in rows if served in (sc := r.get("ood_scores") or {})]
    if not entries:
        return []
    sets = list(dict.fromkeys(n for _, e in entries for n in e.get("ood", {})))
    metrics = (("AUROC %", "auroc"), ("FPR95 %", "fpr95"))
    columns: list[tuple[str, Cell]] = [
        (f"{n} ({ood_kinds.get(n, 'ood')}) {h}", lambda e, n=n, k=k: pct(e.get("ood", {}).get(n, {}).get(k)))
        for n in sets
        for h, k in metrics
    ]
    columns += [(f"Mean {h}", lambda e, k=k: pct(e.get("avg", {}).get(k))) for h, k in metrics]
    return [f"### Served score `{served}` per OOD test set", ""] + method_table(columns, entries) + [""]


def scores_section(rows: list[dict], ood_kinds: dict[str, str], served: str | None) -> list[str]:
    """Mean AUROC and FPR95 over the OOD test sets per method and score, then the served score per set."""
    names = _score_names(rows)
    if not names:
        return []
    md = ["## OOD AUROC by score", ""]
    md += [
        "Mean AUROC (%) over the OOD test sets, per method (rows) and OOD score (columns); each method's best in "
        "bold, – where a method lacks the score. `single` with a score shows what the features give, `hydra` with "
        "the same score what the ensemble adds.",
        "",
    ]
    md += _score_table(rows, names, "auroc", served, max) + ["", "### Mean FPR95 by score (lower is better)", ""]
    return md + _score_table(rows, names, "fpr95", served, min) + [""] + _served_sets_table(rows, ood_kinds, served)


def _selection_sentence(cands: Mapping[str, Any], selected: str | None, forced: bool) -> str:
    """How the served score was chosen."""
    if selected is None:
        return "The build named no served score."
    if forced:
        return (
            f"`{selected}` is served because the build config forces it; any other candidates are shown for comparison."
        )
    flagged = pct(cands.get(selected, {}).get("id_val_flag_rate"))
    return (
        f"Each candidate's threshold keeps the configured share of ID validation inputs unflagged (it flags "
        f"{flagged}% of them); recall: the share of an OOD validation set's inputs it flags. `{selected}` is served: "
        "the best mean recall over the OOD validation sets."
    )


def selection_section(extra: Mapping[str, Any]) -> list[str]:
    """One line per candidate OOD score: threshold, ID validation flag rate, recall per OOD validation set."""
    if not (cands := extra.get("ood_candidates")):
        return []
    selected = extra.get("ood_selected")
    sets = list(dict.fromkeys(n for c in cands.values() for n in c.get("val_recall") or {}))
    header = ["Score", "Served", "Threshold", "ID val flagged %", *(f"{n} recall %" for n in sets), "Mean recall %"]
    body = [
        [
            f"**{name}**" if name == selected else name,
            "yes" if name == selected else "",
            sig4(c.get("threshold")),
            pct(c.get("id_val_flag_rate")),
            *(pct((c.get("val_recall") or {}).get(n)) for n in sets),
            pct(c.get("val_mean_recall")),
        ]
        for name, c in cands.items()
    ]
    md = ["## OOD score selection (validation sets)", ""]
    return md + [_selection_sentence(cands, selected, bool(extra.get("ood_forced"))), ""] + table(header, body) + [""]


def served_flag_section(extra: Mapping[str, Any], ood_kinds: dict[str, str]) -> list[str]:
    """The served score at its threshold on the ID test set (false alarms) and each OOD test set (recall)."""
    if not (flag := extra.get("served_flag")):
        return []
    recall = flag.get("recall") or {}
    body = [["ID test", "id", pct(flag.get("id_test_flag_rate"))]]
    body += [[n, ood_kinds.get(n, "ood"), pct(v)] for n, v in recall.items()]
    if len(recall) > 1:
        vals = [v for v in recall.values() if finite(v)]
        body.append(["mean over OOD sets", "", pct(sum(vals) / len(vals) if vals else None)])
    if finite(flag.get("foreign")):
        body.append(["foreign images (every kind)", "far", pct(flag["foreign"])])
    md = ["## The served flag on test data", ""]
    md += [
        f"Score `{flag.get('score')}` at threshold {sig4(flag.get('threshold'))}, both fixed on validation data. "
        "Flagged: the share of a test set's inputs the flag marks OOD (on ID test: false alarms; on an OOD set: "
        "recall).",
        "",
    ]
    md += table(["Test set", "Kind", "Flagged %"], body) + [""]
    if by_kind := flag.get("foreign_by_kind"):
        md += [
            "### Foreign images, by kind",
            "",
            "The repository's foreign-image set (`offline/data/foreign.py`: noise, blank frames, gradients, patterns, "
            "textures, photographs, graphics, scans), generated by code and used for no fit or choice.",
            "",
        ]
        md += table(["Kind", "Flagged %"], [[k, pct(v)] for k, v in by_kind.items()]) + [""]
    return md
