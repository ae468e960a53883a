"""The build report: latency measurement, ``report.json``, a readable ``report.md`` and PNG plots.

``write_report`` takes one row per method (``single``, ``member_0``.., ``hydra``,
``ensemble_unfused``, zero-shot builds also ``single_ts``), each the output of
``offline.metrics.evaluate_predictions`` plus ``method``, ``params`` and
``latency_ms``, and the member probabilities behind them for the plots.

Like is compared with like: the main ID table says the temperature its rows are
at (all at ``T = 1``, or a ``T`` column), and a second table shows every method at
its *own* temperature fitted on ID validation data (``row["calibrated"]``). For
OOD detection, ``row["ood_scores"]`` gives each method's AUROC / FPR95 with every
OOD score, so ``single`` + a score (what the features give) sits next to
``hydra`` + the same score (what the ensemble adds); ``extra`` says how the served
score was chosen on the OOD validation sets and how its flag does on test data.
All of these inputs are optional: a report without them renders as before.

Plots use matplotlib's ``Figure`` directly (Agg canvas), so no global backend is touched.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .metrics import calibration_bins, ece, uncertainty

__all__ = ["measure_latency", "write_report", "summary_of", "HEADLINE"]

# the numbers of each method that go into the manifest's `metrics` field
HEADLINE = ("acc", "nll", "brier", "ece", "aece", "mi_id", "mi_ood", "disagreement_id", "disagreement_ood")
OOD_KEYS = ("auroc", "fpr95", "aupr_in", "aupr_out")
PLOT_FILES = ("reliability.png", "ood_hist_msp.png", "ood_hist_mi.png", "member_accuracy.png")
SERVED_PLOT = "ood_hist_served.png"  # only when ``plots["served"]`` is given
# ``extra`` keys with a section of their own (not repeated in the build facts)
SECTION_KEYS = ("ood_candidates", "ood_selected", "ood_forced", "served_flag", "no_ood_data", "guarantees_report",
                "per_class")
# the order of OOD score columns; scores not listed follow in the order they appear
SCORE_ORDER = ("msp", "max_logit", "energy", "entropy", "mutual_information", "mahalanobis",
               "relative_mahalanobis", "mahalanobis_mi", "mahalanobis_energy", "mahalanobis_layers")  # fmt: skip
MI_FLOOR = 1e-6  # mutual information below it is drawn at it on the log axis


def measure_latency(fn: Callable[[], Any], warmup: int = 2, reps: int = 5) -> dict:
    """Wall-clock time of ``fn()`` under ``torch.inference_mode``: ``{"min_ms", "median_ms", "reps"}``.

    ``warmup`` untimed calls first (allocator, oneDNN kernel selection), then ``reps`` timed ones.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"min_ms": round(min(times), 3), "median_ms": round(statistics.median(times), 3), "reps": reps}


# ----------------------------------------------------------------------------- json
def _jsonable(x: Any) -> Any:
    """Plain JSON values: numpy scalars/arrays to Python, NaN/inf to None (strict JSON has no NaN)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    return x


def summary_of(rows: list[dict]) -> dict[str, dict]:
    """Headline numbers per method (for the manifest): ID metrics, OOD averages over sets, params, median latency,
    and, where the row has ``calibrated``, ECE / NLL at the method's own fitted temperature (``ece_ts``, ``nll_ts``,
    ``temperature_ts``)."""
    out: dict[str, dict] = {}
    for r in rows:
        s = {k: r[k] for k in HEADLINE if k in r}
        s.update({k: v for k, v in r.get("ood_avg", {}).items() if k in OOD_KEYS})
        if "params" in r:
            s["params"] = int(r["params"])
        lat = r.get("latency_ms", {})
        s["latency_ms"] = {b: v["median_ms"] for b, v in lat.items() if isinstance(v, Mapping) and "median_ms" in v}
        s.update({f"{k}_ts": v for k, v in (r.get("calibrated") or {}).items() if k in ("ece", "nll", "temperature")})
        out[r["method"]] = _jsonable(s)
    return out


# ----------------------------------------------------------------------------- markdown
def _pct(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.2f}"


def _num(x: Any, digits: int = 4) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _params(n: Any) -> str:
    return "–" if n is None else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{int(n):,}"


def _lat(r: dict, key: str) -> str:
    v = r.get("latency_ms", {}).get(key)
    return "–" if not v else f"{v['median_ms']:.1f} ({v['min_ms']:.1f})"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


_Cell = Callable[[Mapping[str, Any]], str]  # one table cell from a row (or from one OOD set's entry of a row)


def _cell(fmt: Callable[[Any], str], key: str, required: bool = False) -> _Cell:
    """``fmt`` of ``key``: a missing key shows as "–", or raises KeyError when ``required``."""
    return (lambda r: fmt(r[key])) if required else (lambda r: fmt(r.get(key)))


def _method_table(columns: Sequence[tuple[str, _Cell]], entries: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """A table with a "Method" column, then one column per ``(header, cell)``, one line per ``(method, entry)``."""
    return _table(["Method", *(h for h, _ in columns)], [[m, *(cell(e) for _, cell in columns)] for m, e in entries])


_ID_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    ("Params", _cell(_params, "params")),
    ("Acc %", _cell(_pct, "acc")),
    ("NLL", _cell(_num, "nll")),
    ("Brier", _cell(_num, "brier")),
    ("ECE %", _cell(_pct, "ece")),
    ("aECE %", _cell(_pct, "aece")),
    ("MSP", _cell(_num, "msp_id")),
    ("Entropy", _cell(_num, "entropy_id")),
    ("MI", _cell(_num, "mi_id")),
    ("Disagr. %", _cell(_pct, "disagreement_id")),
    ("Lat. b1 ms", lambda r: _lat(r, "batch1")),
    ("Lat. b8 ms", lambda r: _lat(r, "batch8")),
)
_OOD_HEADERS = ("AUROC %", "FPR95 %", "AUPR-In %", "AUPR-Out %")  # the headers of OOD_KEYS, in the same order
# one OOD set: the detection metrics are always there (a missing one is a bug), MI / disagreement may not be
_OOD_SET_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    *((h, _cell(_pct, k, required=True)) for h, k in zip(_OOD_HEADERS, OOD_KEYS, strict=True)),
    ("MI", _cell(_num, "mi")),
    ("Disagr. %", _cell(_pct, "disagreement")),
)
_OOD_AVG_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    *((h, lambda r, k=k: _pct(r.get("ood_avg", {}).get(k))) for h, k in zip(_OOD_HEADERS, OOD_KEYS, strict=True)),
    ("MI ID", _cell(_num, "mi_id")),
    ("MI OOD", _cell(_num, "mi_ood")),
    ("Disagr. ID %", _cell(_pct, "disagreement_id")),
    ("Disagr. OOD %", _cell(_pct, "disagreement_ood")),
)


def _sig4(x: Any) -> str:
    """A temperature or an OOD threshold (in its score's own units): up to 4 significant digits ("1", "1.237")."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _id_section(rows: list[dict]) -> list[str]:
    """The in-distribution table: one line per method, at the temperature the heading (or a ``T`` column) gives."""
    temps = {r.get("temperature") for r in rows}
    columns, at = _ID_COLUMNS, ""
    if len(temps) == 1 and None not in temps:
        at = f", at T = {_sig4(temps.pop())}"
    elif temps != {None}:  # rows at different temperatures: say which, per row
        columns, at = (("T", _cell(_sig4, "temperature")), *_ID_COLUMNS), ", each method at the temperature T"
    md = [f"## In-distribution (test set{at})", ""]
    md += [
        "Percentages for Acc, ECE, aECE and disagreement; NLL and entropies in nats; Brier of the mean "
        "prediction (0–2). Latency: median (min) ms per call, eager fp32.",
        "",
    ]
    return md + _method_table(columns, ((r["method"], r) for r in rows))


_TS_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    ("T", _cell(_sig4, "temperature")),
    ("Acc %", _cell(_pct, "acc")),
    ("NLL", _cell(_num, "nll")),
    ("Brier", _cell(_num, "brier")),
    ("ECE %", _cell(_pct, "ece")),
    ("aECE %", _cell(_pct, "aece")),
)


def _calibrated_section(rows: list[dict]) -> list[str]:
    """Every method that has ``calibrated``: its test metrics at its own temperature fitted on ID validation data."""
    entries = [(r["method"], r["calibrated"]) for r in rows if r.get("calibrated")]
    if not entries:
        return []
    md = ["", "## In-distribution (test set), each method at its own fitted temperature", ""]
    md += [
        "T: the method's temperature, fitted (NLL) on the ID validation set and applied to its logits before the "
        "softmax; calibration compared like with like, each method at its best temperature.",
        "",
    ]
    return md + _method_table(_TS_COLUMNS, entries)


def _ood_section(rows: list[dict], ood_kinds: dict[str, str], score: str) -> list[str]:
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
        md += _method_table(_OOD_SET_COLUMNS, entries) + [""]
    if sets:
        md += ["### Average over OOD sets", ""]
        md += _method_table(_OOD_AVG_COLUMNS, ((r["method"], r) for r in rows)) + [""]
    return md


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(x)


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
        top = best([v for v in vals if _finite(v)], default=None)
        body.append([r["method"], *(f"**{_pct(v)}**" if top is not None and v == top else _pct(v) for v in vals)])
    return _table(["Method", *(f"{n} (served)" if n == served else n for n in names)], body)


def _served_sets_table(rows: list[dict], ood_kinds: dict[str, str], served: str | None) -> list[str]:
    """AUROC and FPR95 of every method on every OOD test set with the served score."""
    entries = [(r["method"], sc[served]) for r in rows if served in (sc := r.get("ood_scores") or {})]
    if not entries:
        return []
    sets = list(dict.fromkeys(n for _, e in entries for n in e.get("ood", {})))
    metrics = (("AUROC %", "auroc"), ("FPR95 %", "fpr95"))
    columns: list[tuple[str, _Cell]] = [
        (f"{n} ({ood_kinds.get(n, 'ood')}) {h}", lambda e, n=n, k=k: _pct(e.get("ood", {}).get(n, {}).get(k)))
        for n in sets
        for h, k in metrics
    ]
    columns += [(f"Mean {h}", lambda e, k=k: _pct(e.get("avg", {}).get(k))) for h, k in metrics]
    return [f"### Served score `{served}` per OOD test set", ""] + _method_table(columns, entries) + [""]


def _scores_section(rows: list[dict], ood_kinds: dict[str, str], served: str | None) -> list[str]:
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
    flagged = _pct(cands.get(selected, {}).get("id_val_flag_rate"))
    return (
        f"Each candidate's threshold keeps the configured share of ID validation inputs unflagged (it flags "
        f"{flagged}% of them); recall: the share of an OOD validation set's inputs it flags. `{selected}` is served: "
        "the best mean recall over the OOD validation sets."
    )


def _selection_section(extra: Mapping[str, Any]) -> list[str]:
    """One line per candidate OOD score: threshold, ID validation flag rate, recall per OOD validation set."""
    if not (cands := extra.get("ood_candidates")):
        return []
    selected = extra.get("ood_selected")
    sets = list(dict.fromkeys(n for c in cands.values() for n in c.get("val_recall") or {}))
    header = ["Score", "Served", "Threshold", "ID val flagged %", *(f"{n} recall %" for n in sets), "Mean recall %"]
    body = [
        [f"**{name}**" if name == selected else name, "yes" if name == selected else "", _sig4(c.get("threshold")),
         _pct(c.get("id_val_flag_rate")), *(_pct((c.get("val_recall") or {}).get(n)) for n in sets),
         _pct(c.get("val_mean_recall"))]
        for name, c in cands.items()
    ]  # fmt: skip
    md = ["## OOD score selection (validation sets)", ""]
    return md + [_selection_sentence(cands, selected, bool(extra.get("ood_forced"))), ""] + _table(header, body) + [""]


def _served_flag_section(extra: Mapping[str, Any], ood_kinds: dict[str, str]) -> list[str]:
    """The served score at its threshold on the ID test set (false alarms) and each OOD test set (recall)."""
    if not (flag := extra.get("served_flag")):
        return []
    recall = flag.get("recall") or {}
    body = [["ID test", "id", _pct(flag.get("id_test_flag_rate"))]]
    body += [[n, ood_kinds.get(n, "ood"), _pct(v)] for n, v in recall.items()]
    if len(recall) > 1:
        vals = [v for v in recall.values() if _finite(v)]
        body.append(["mean over OOD sets", "", _pct(sum(vals) / len(vals) if vals else None)])
    if _finite(flag.get("foreign")):
        body.append(["foreign images (every kind)", "far", _pct(flag["foreign"])])
    md = ["## The served flag on test data", ""]
    md += [
        f"Score `{flag.get('score')}` at threshold {_sig4(flag.get('threshold'))}, both fixed on validation data. "
        "Flagged: the share of a test set's inputs the flag marks OOD (on ID test: false alarms; on an OOD set: "
        "recall).",
        "",
    ]
    md += _table(["Test set", "Kind", "Flagged %"], body) + [""]
    if by_kind := flag.get("foreign_by_kind"):
        md += ["### Foreign images, by kind", "",
               "The repository's foreign-image set (`offline/foreign.py`: noise, blank frames, gradients, patterns, "
               "textures, photographs, graphics, scans), generated by code and used for no fit or choice.", ""]
        md += _table(["Kind", "Flagged %"], [[k, _pct(v)] for k, v in by_kind.items()]) + [""]
    return md


def _guarantees_section(extra: Mapping[str, Any]) -> list[str]:
    """What the calibration split certifies, measured on ID test and the OOD test sets, per method."""
    if not (g := extra.get("guarantees_report")):
        return []
    methods = g["methods"]
    alphas = [str(a) for a in g["alphas"]]
    hydra = methods.get("hydra", {})
    md = ["## Guarantees (calibration split)", ""]
    md += [f"Fitted on the calibration split alone ({hydra.get('calibration_size', '–')} ID inputs nothing else of "
           f"the build touched), each method at its own temperature with its own statistics of the served score "
           f"(`{g['metric']}`), measured on ID test. Sets: `{g['method']}` scores; the smallest alpha the split "
           f"allows is {_num(hydra.get('min_alpha'), 5)} (per class, Mondrian: "
           f"{', '.join(_num(a, 4) for a in hydra.get('min_alpha_per_class', []))}). Expected: coverage at least "
           "1 - alpha (within the test set's sampling error), false alarms at most alpha, realised risk at most "
           "the target with probability 1 - delta.", ""]
    md += ["### Prediction sets: coverage % / mean size (ID test)", ""]
    body = [[m] + [f"{_pct(r['coverage'][a]['coverage'])} / {r['coverage'][a]['mean_size']:.2f}" for a in alphas]
            for m, r in methods.items()]  # fmt: skip
    md += _table(["Method"] + [f"alpha {a}" for a in alphas], body) + [""]
    md += ["Smallest class coverage % (marginal sets; Mondrian sets for Hydra in the last row):", ""]
    body = [[m] + [_pct(r["coverage"][a]["min_class"]) for a in alphas] for m, r in methods.items()]
    if "mondrian" in hydra:
        body.append(["hydra (Mondrian)"] + [f"{_pct(hydra['mondrian'][a]['min_class'])} / "
                                            f"{hydra['mondrian'][a]['mean_size']:.2f}" for a in alphas])  # fmt: skip
    md += _table(["Method"] + [f"alpha {a}" for a in alphas], body) + [""]
    md += ["### OOD p-values: false alarms on ID test % (flag = p-value <= alpha)", ""]
    body = [[m] + [_pct(r["p_values"][a]["false_alarm"]) for a in alphas] for m, r in methods.items()]
    md += _table(["Method"] + [f"alpha {a}" for a in alphas], body) + [""]
    if hydra.get("p_values"):
        sets = list(hydra["p_values"][alphas[0]]["recall"])
        md += ["Hydra's recall % on each OOD test set:", ""]
        body = [[n] + [_pct(hydra["p_values"][a]["recall"][n]) for a in alphas] for n in sets]
        md += _table(["OOD test set"] + [f"alpha {a}" for a in alphas], body) + [""]
    md += ["### Answers with a risk bound: realised risk % among accepted / accept rate % (ID test)", ""]
    risks = [str(r["risk"]) for r in next(iter(methods.values()))["selective"]]
    body = []
    for m, r in methods.items():
        cells = []
        for t in r["selective"]:
            cells.append("not certified" if not t["certified"] else
                         f"{_pct(t['test_risk'])} / {_pct(t['test_accept_rate'])}")  # fmt: skip
        body.append([m, *cells])
    md += _table(["Method"] + [f"risk {x}" for x in risks], body) + [""]
    if drift := hydra.get("drift"):
        md += ["### Drift alarm (simulated streams of Hydra's served scores)", ""]
        md += [f"{drift['null_alarms']} of {drift['null_streams']} ID streams of {drift['null_stream_inputs']:,} "
               f"inputs (resampled from ID test and validation) raised the alarm (delta = {drift['delta']}). A stream "
               f"of {drift['switch_at']:,} ID test inputs that switches to an OOD test set:", ""]
        body = [[n, "yes" if r["false_alarm"] else "no", "–" if r["delay"] is None else str(r["delay"])]
                for n, r in drift["runs"].items()]  # fmt: skip
        md += _table(["Switch to", "Alarm before the switch", "Inputs after the switch until the alarm"], body)
        md += [""]
    return md


def per_class(labels: np.ndarray, member_probs: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
    """Accuracy per class and the confusion matrix of the ensemble prediction ``mean_m member_probs (N, M, C)``
    against ``labels (N,)``, keyed by the class ``names`` (in logit order): ``{"accuracy": {name: fraction},
    "support": {name: count}, "confusion": [[count]] (rows: true class, columns: predicted)}``."""
    pred = np.asarray(member_probs).mean(axis=1).argmax(axis=-1)  # (N,)
    y = np.asarray(labels)
    c = len(names)
    conf = np.zeros((c, c), dtype=np.int64)
    np.add.at(conf, (y, pred), 1)
    support = conf.sum(axis=1)
    acc = {n: (float(conf[i, i] / support[i]) if support[i] else None) for i, n in enumerate(names)}
    return {"accuracy": acc, "support": {n: int(support[i]) for i, n in enumerate(names)},
            "confusion": conf.tolist()}  # fmt: skip


def _per_class_section(doc: Mapping[str, Any]) -> list[str]:
    """Accuracy per class for every method, then Hydra's (else the first method's) confusion matrix, by the data's
    own class names."""
    pc = doc.get("per_class") or {}
    if not pc:
        return []
    names = list(next(iter(pc.values()))["accuracy"])
    methods = list(pc)
    md = ["", "## Per class (ID test, by the data's class names)", "",
          "Accuracy % of each method's prediction on the test images of each class (n: test images of it).", ""]
    body = [[n, str(pc[methods[0]]["support"][n])] + [_pct(pc[m]["accuracy"][n]) for m in methods] for n in names]
    md += _table(["class", "n", *methods], body)
    shown = "hydra" if "hydra" in pc else methods[0]
    md += ["", f"### Confusion matrix ({shown}; rows: true class, columns: predicted)", ""]
    conf = pc[shown]["confusion"]
    md += _table(["true \\ predicted", *names], [[n, *(str(v) for v in conf[i])] for i, n in enumerate(names)])
    return md + [""]


def _build_section(extra: dict, plots: list[str]) -> list[str]:
    """Build facts as a (nested) list (less what has a section of its own), then the plots, if any."""
    md = ["## Build", ""]
    for k, v in extra.items():
        if k in SECTION_KEYS:
            continue
        if isinstance(v, Mapping):
            md += [f"- **{k}**:"] + [f"  - {kk}: {_fmt(vv)}" for kk, vv in v.items()]
        else:
            md += [f"- **{k}**: {_fmt(v)}"]
    if plots:
        md += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return md


def _markdown(rows: list[dict], ood_kinds: dict[str, str], title: str, extra: dict, plots: list[str]) -> str:
    """The text of ``report.md``: title, ID tables, OOD tables, score selection, served flag, build facts, plots."""
    score = next((r.get("ood_score") for r in rows if r.get("ood_score")), extra.get("ood_score", "msp"))
    served = extra.get("ood_selected") or (extra.get("served_flag") or {}).get("score")
    md = [f"# {title}", ""] + _id_section(rows) + _calibrated_section(rows)
    if extra.get("no_ood_data"):
        md += ["", "## OOD detection", "", "This build had no OOD data: no OOD detection results.", ""]
    else:
        md += _ood_section(rows, ood_kinds, score) + _scores_section(rows, ood_kinds, served)
    md += _per_class_section(extra)
    md += _selection_section(extra) + _served_flag_section(extra, ood_kinds) + _guarantees_section(extra)
    md += _build_section(extra, plots)
    return "\n".join(md) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(_jsonable(v))


# ----------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _reliability_panel(ax: Any, b: dict[str, np.ndarray], title: str) -> None:
    """Accuracy per confidence bin, the gap to the bin's mean confidence hatched, against the diagonal."""
    edges = np.linspace(0, 1, len(b["count"]) + 1)
    centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
    filled = b["count"] > 0
    ax.bar(centers[filled], b["accuracy"][filled], width=width, color="tab:blue", edgecolor="black", linewidth=0.5,
           label="accuracy")  # fmt: skip
    gap_lo = np.minimum(b["accuracy"], b["confidence"])[filled]
    gap = np.abs(b["accuracy"] - b["confidence"])[filled]
    # the gap between accuracy and mean confidence, hatched so it stays visible over the accuracy bar
    ax.bar(centers[filled], gap, bottom=gap_lo, width=width, facecolor="none", edgecolor="tab:red", hatch="///",
           linewidth=0.8, label="gap to mean confidence")  # fmt: skip
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (MSP of the mean prediction)",
           ylabel="accuracy (fraction correct)", title=title)  # fmt: skip
    ax.legend(loc="upper left", fontsize=8)


def _bin_count_panel(ax: Any, b: dict[str, np.ndarray]) -> None:
    """The number of inputs per confidence bin (log scale: the top bins hold most inputs), annotated."""
    edges = np.linspace(0, 1, len(b["count"]) + 1)
    centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
    filled = b["count"] > 0
    bars = ax.bar(centers[filled], b["count"][filled], width=width, color="tab:gray", edgecolor="black",
                  linewidth=0.5)  # fmt: skip
    ax.bar_label(bars, labels=[str(int(c)) for c in b["count"][filled]], fontsize=6, padding=1)
    ax.set_yscale("log")
    top = max(int(b["count"].max()), 1)
    ax.set(xlim=(0, 1), ylim=(0.7, top * 3), xlabel="confidence (MSP of the mean prediction)",
           ylabel="inputs per bin (log)", title=f"inputs per confidence bin (n = {int(b['count'].sum())})")  # fmt: skip


def _plot_reliability(path: Path, labels: np.ndarray, methods: dict[str, np.ndarray]) -> None:
    """One column per method: accuracy per 15 equal-width confidence bins against the diagonal, the bin counts
    under it."""
    fig = _figure(4.4 * len(methods), 6.4)
    axes = fig.subplots(2, len(methods), squeeze=False, gridspec_kw={"height_ratios": [3, 1.3]})
    for i, (name, probs) in enumerate(methods.items()):
        b = calibration_bins(probs, labels)
        _reliability_panel(axes[0, i], b, f"{name}: ECE {100 * ece(probs, labels):.2f}%")
        _bin_count_panel(axes[1, i], b)
    fig.suptitle("Reliability diagram (ID test set, 15 equal-width bins)")
    fig.savefig(path)


def _share_hist(ax: Any, values: dict[str, np.ndarray], bins: np.ndarray) -> None:
    """One histogram per entry of ``values`` (label -> scores), each summing to 1 (share of its inputs)."""
    for i, (name, v) in enumerate(values.items()):
        ax.hist(v, bins=bins, weights=np.full(len(v), 1 / max(len(v), 1)), histtype="stepfilled" if i == 0 else "step",
                alpha=0.35 if i == 0 else 1.0, linewidth=1.5, label=name)  # fmt: skip


def _hist_values(field: str, values: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray, str]:
    """The values to draw, the bins and the x label of one uncertainty field: MSP on [0, 1]; mutual information
    on log-spaced bins, clipped below at :data:`MI_FLOOR` (MI spans decades, and is 0 for a single model)."""
    if field == "msp":
        return values, np.linspace(0.0, 1.0, 41), "maximum softmax probability"
    clipped = {k: np.maximum(v, MI_FLOOR) for k, v in values.items()}
    lo = min(float(v.min()) for v in clipped.values())
    hi = max(float(max(v.max() for v in clipped.values())), 10 * lo)
    label = f"mutual information (nats, log scale; values < {MI_FLOOR:g} drawn at {MI_FLOOR:g})"
    return clipped, np.geomspace(lo * 0.98, hi * 1.02, 41), label


def _plot_ood_hist(
    path: Path,
    method: str,
    field: str,
    probs_id: np.ndarray,
    probs_ood: dict[str, np.ndarray],
    ood_kinds: dict[str, str],
    threshold: float | None,
) -> None:
    """Histograms (share of each set's inputs per bin) of one uncertainty field on the ID test set and each OOD set."""
    raw = {"ID": uncertainty(probs_id)[field]}
    for name, p in probs_ood.items():
        raw[f"{name} ({ood_kinds.get(name, 'ood')})"] = uncertainty(p)[field]
    values, bins, label = _hist_values(field, {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in raw.items()})
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    _share_hist(ax, {f"{k}, n={len(v)}": v for k, v in values.items()}, bins)
    if field != "msp":
        ax.set_xscale("log")
    if threshold is not None:
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold:.3g}")
    name = {"msp": "maximum softmax probability", "mutual_information": "mutual information"}[field]
    ax.set(xlabel=label, ylabel="share of inputs", title=f"{method}: {name}, ID vs OOD (test sets)")
    ax.legend(fontsize=8)
    fig.savefig(path)


def _served_labels(served: Mapping[str, Any], ood_kinds: dict[str, str], flag: Mapping[str, Any]) -> dict[str, str]:
    """Legend labels of the served-score histogram: set, kind, size and, from ``served_flag``, the share flagged."""

    def flagged(x: Any) -> str:
        return f", {_pct(x)}% flagged" if _finite(x) else ""

    labels = {"ID": f"ID test, n={len(served['id'])}{flagged(flag.get('id_test_flag_rate'))}"}
    for n, v in served.get("ood", {}).items():
        labels[n] = f"{n} ({ood_kinds.get(n, 'ood')}), n={len(v)}{flagged((flag.get('recall') or {}).get(n))}"
    return labels


def _plot_served_hist(
    path: Path, served: Mapping[str, Any], ood_kinds: dict[str, str], flag: Mapping[str, Any]
) -> None:
    """Histograms of the served OOD score on the ID test set and each OOD test set, its threshold as a line.

    The x range is the 0.5–99.5th percentile of all the values (and the threshold); values past it are drawn in the
    edge bins, so a long tail (Mahalanobis distances on far OOD) does not squash the rest.
    """
    raw = {"ID": served["id"], **served.get("ood", {})}
    raw = {k: (a := np.asarray(v, dtype=np.float64).reshape(-1))[np.isfinite(a)] for k, v in raw.items()}
    thr = float(served["threshold"])
    pooled = np.concatenate([*raw.values(), [thr]])
    lo, hi = np.percentile(pooled, [0.5, 99.5])
    lo, hi = min(float(lo), thr), max(float(hi), thr)
    hi = hi if hi > lo else lo + 1.0
    labels = _served_labels(served, ood_kinds, flag)
    fig = _figure(6.8, 4.2)
    ax = fig.subplots()
    _share_hist(ax, {labels[k]: np.clip(v, lo, hi) for k, v in raw.items()}, np.linspace(lo, hi, 41))
    ax.axvline(thr, color="black", linestyle="--", linewidth=1.2, label=f"threshold {thr:.4g}")
    ax.set(xlabel=f"{served['score']} (OOD score; 0.5% tails drawn in the edge bins)", ylabel="share of inputs",
           title=f"Served OOD score {served['score']}: ID test vs OOD test sets")  # fmt: skip
    ax.legend(fontsize=8)
    fig.savefig(path)


def _method_color(name: str) -> tuple[str, str]:
    """The bar colour of a method and the legend entry it stands for."""
    if name.startswith("member_"):
        return "tab:gray", "member"
    return {"hydra": ("tab:green", "hydra (fused)"), "single": ("tab:orange", "single")}.get(name, ("tab:blue", name))


def _plot_member_accuracy(path: Path, rows: list[dict]) -> None:
    """Test accuracy of every method: members, the fused ensemble, the unfused ensemble and the single model."""
    from matplotlib.patches import Patch

    names = [r["method"] for r in rows]
    acc = [100 * r["acc"] for r in rows]
    colors = [_method_color(n) for n in names]
    fig = _figure(max(5.0, 1.0 * len(names) + 1.5) + 2.0, 4.2)
    ax = fig.subplots()
    bars = ax.bar(names, acc, color=[c for c, _ in colors], edgecolor="black", linewidth=0.5)
    ax.bar_label(bars, labels=[f"{a:.1f}" for a in acc], fontsize=8)
    legend: dict[str, list[str]] = {}  # colour -> what it stands for (the other methods share one colour)
    for c, lab in dict.fromkeys(colors):  # distinct (colour, label) pairs, in order
        legend.setdefault(c, []).append(lab)
    handles: list[Any] = [Patch(facecolor=c, edgecolor="black", label=", ".join(labs)) for c, labs in legend.items()]
    if "single" in names:
        handles.append(ax.axhline(acc[names.index("single")], color="tab:orange", linestyle="--", linewidth=1,
                                  label="single (reference line)"))  # fmt: skip
    lo = max(0.0, min(acc) - 10)
    ax.set(ylim=(lo, min(100.0, max(acc) + 5)), xlabel="method", ylabel="accuracy (%)",
           title="Members vs ensembles: ID test accuracy")  # fmt: skip
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    ax.tick_params(axis="x", labelrotation=20)
    fig.savefig(path)


def _plot_confusion(path: Path, method: str, pc: Mapping[str, Any]) -> None:
    """The confusion matrix of ``method`` on ID test (rows: true class, columns: predicted), counts in the cells."""
    names = list(pc["accuracy"])
    conf = np.asarray(pc["confusion"])
    fig = _figure(1.0 + 0.7 * len(names), 0.8 + 0.6 * len(names))
    ax = fig.subplots()
    ax.imshow(conf, cmap="Blues")
    for (i, j), v in np.ndenumerate(conf):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=7,
                color="white" if v > conf.max() / 2 else "black")  # fmt: skip
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true class", title=f"{method}: confusion matrix (ID test)")
    fig.savefig(path)


def _write_plots(out: Path, rows: list[dict], ood_kinds: dict[str, str], plots: dict, extra: dict) -> list[str]:
    labels = np.asarray(plots["labels"])
    pdir = out / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    written = []
    rel = {m: plots[m]["member_probs_id"] for m in ("single", "hydra") if m in plots}
    if rel:
        _plot_reliability(pdir / "reliability.png", labels, rel)
        written.append("plots/reliability.png")
    method = next((m for m in ("hydra", "ensemble_unfused", "single") if m in plots), None)
    if method is not None:
        kinds = plots.get("ood_kinds", ood_kinds)
        p = plots[method]
        score = extra.get("ood_score")
        thr = extra.get("ood_threshold")
        for field, fname in (("msp", "ood_hist_msp.png"), ("mutual_information", "ood_hist_mi.png")):
            t = thr if method == "hydra" and score == field and thr is not None else None
            _plot_ood_hist(pdir / fname, method, field, p["member_probs_id"], p.get("member_probs_ood", {}), kinds, t)
            written.append(f"plots/{fname}")
    if rows and all("acc" in r for r in rows):
        _plot_member_accuracy(pdir / "member_accuracy.png", rows)
        written.append("plots/member_accuracy.png")
    if pc := extra.get("per_class"):
        shown = "hydra" if "hydra" in pc else next(iter(pc))
        _plot_confusion(pdir / "confusion.png", shown, pc[shown])
        written.append("plots/confusion.png")
    if served := plots.get("served"):
        flag = extra.get("served_flag") or {}
        flag = flag if flag.get("score") == served["score"] else {}
        _plot_served_hist(pdir / SERVED_PLOT, served, plots.get("ood_kinds", ood_kinds), flag)
        written.append(f"plots/{SERVED_PLOT}")
    hydra = ((extra.get("guarantees_report") or {}).get("methods") or {}).get("hydra") or {}
    if hydra.get("drift"):
        _plot_drift(pdir / "drift.png", hydra["drift"])
        written.append("plots/drift.png")
    if hydra.get("risk_coverage"):
        _plot_risk_coverage(pdir / "risk_coverage.png", hydra["risk_coverage"], hydra["selective"])
        written.append("plots/risk_coverage.png")
    return written


def _plot_drift(path: Path, drift: dict) -> None:
    """The drift statistic (log10) along each simulated stream, the switch and the alarm level."""
    fig = _figure(7.0, 3.6)
    ax = fig.subplots()
    for name, r in drift["runs"].items():
        x = np.arange(1, len(r["trace_every_10"]) + 1) * 10
        ax.plot(x, r["trace_every_10"], lw=1.2, label=f"to {name}" + ("" if r["delay"] is None
                                                                         else f" (alarm +{r['delay']})"))  # fmt: skip
    ax.axhline(drift["log10_threshold"], color="k", ls="--", lw=1, label="alarm level log10(1/delta)")
    ax.axvline(drift["switch_at"], color="grey", ls=":", lw=1, label="switch from ID test")
    ax.set_xlabel("inputs served")
    ax.set_ylabel("log10 drift statistic")
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path)


def _plot_risk_coverage(path: Path, curve: dict, rules: list[dict]) -> None:
    """Risk among accepted vs accept rate on ID test, the certified rules marked with their targets."""
    fig = _figure(5.5, 3.8)
    ax = fig.subplots()
    rate = np.asarray(curve["accept_rate"], dtype=float)
    risk = np.asarray([np.nan if v is None else v for v in curve["risk"]], dtype=float)
    ax.plot(rate, risk, lw=1.5, label="confidence threshold (OOD cut applied)")
    for r in rules:
        if r["certified"] and r["test_risk"] is not None:
            ax.scatter([r["test_accept_rate"]], [r["test_risk"]], zorder=3)
            ax.annotate(f"target {r['risk']}", (r["test_accept_rate"], r["test_risk"]), fontsize=7,
                        xytext=(4, -8), textcoords="offset points")  # fmt: skip
            ax.axhline(r["risk"], color="grey", lw=0.5, ls=":")
    ax.set_xlabel("accept rate (ID test)")
    ax.set_ylabel("risk among accepted")
    ax.legend(fontsize=7)
    fig.savefig(path)


# ----------------------------------------------------------------------------- entry point
def write_report(out: Path, rows: list[dict], ood_kinds: dict[str, str], plots: dict, title: str, extra: dict) -> dict:
    """Write ``out/report.json``, ``out/report.md`` and ``out/plots/*.png``; return the manifest summary.

    Args:
        out: artifact directory.
        rows: per method, ``evaluate_predictions(...)`` plus ``method``, ``params`` and
            ``latency_ms: {"batch1": measure_latency(...), "batch8": ...}``. Optional per row:

            - ``temperature``: the temperature its metrics were computed at (the ID table's heading says it
              when all rows share one, else a ``T`` column does);
            - ``calibrated: {"temperature", "acc", "nll", "brier", "ece", "aece"}``: the method at its own
              temperature fitted on ID validation data (a second ID table);
            - ``ood_scores: {score: {"ood": {set: {"auroc", "fpr95"}}, "avg": {"auroc", "fpr95"}}}``: its OOD
              detection with each score it has (tables of mean AUROC / FPR95 by score, and the served score
              per set).
        ood_kinds: OOD set name -> kind (``near``, ``far``, ...).
        plots: ``{"labels": (N,), "ood_kinds": {...}, <method>: {"member_probs_id": (N, M, C),
            "member_probs_ood": {name: (N', M, C)}}}``; optionally ``"served": {"score", "threshold",
            "id": (N,), "ood": {name: (N',)}}``, the served OOD score on the ID and OOD test sets
            (``plots/ood_hist_served.png``).
        title: report heading.
        extra: build facts shown in the report (temperature, threshold, timings, ...). Optional keys with a
            section of their own (:data:`SECTION_KEYS`, not repeated in the build facts):

            - ``ood_candidates: {score: {"threshold", "id_val_flag_rate", "val_recall": {ood_val_set: float},
              "val_mean_recall"}}``, ``ood_selected`` (the served score's name) and ``ood_forced`` (true when
              the config forced the score rather than selecting it): the score selection on validation sets;
            - ``served_flag: {"score", "threshold", "id_test_flag_rate", "recall": {ood_test_set: float}}``:
              the served flag on test data;
            - ``no_ood_data``: true when the build had no OOD data (one line instead of the OOD tables).

            Rates and recalls are fractions (shown in %).

    Returns per method the headline numbers (:func:`summary_of`).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = plots.get("class_names")
    if names:  # per method, on the ID test set, by name
        extra = {**extra, "per_class": {r["method"]: per_class(plots["labels"], plots[r["method"]]["member_probs_id"],
                                                               names) for r in rows if r["method"] in plots}}
    written = _write_plots(out, rows, ood_kinds, plots, extra)
    doc = {"title": title, "ood_kinds": ood_kinds, "rows": rows, "extra": extra, "plots": written}
    (out / "report.json").write_text(json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(_markdown(rows, ood_kinds, title, extra, written))
    return summary_of(rows)
