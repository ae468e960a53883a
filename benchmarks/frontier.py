"""Where Hydra stands among efficient ensembles: the baselines' rows and the shared trunk's frontier, over seeds.

    .venv/bin/python -m benchmarks.frontier            # tables and plot from the builds, then the cost side by side
    .venv/bin/python -m benchmarks.frontier --no-cost  # the tables from the builds only

The builds are ``benchmarks/recipe.py``'s (``--variants baselines trunk-half trunk-3q --seeds 0 1 2``, one
config per run; see ``benchmarks/README.md``), read from its work folder: the ``baselines`` variant is the config
without a shared trunk (``hydra.shared_blocks`` 0) with ``base.baselines`` (LoRA-Ensembles, BatchEnsemble,
last-layer Laplace: :mod:`offline.pipelines.baselines`) beside Single and Hydra; ``trunk-half`` / ``trunk-3q`` have
``hydra.shared_blocks`` = L/2 and 3L/4 (rounded down); ``shipped`` is the config as it ships (3L/4 since the
default rule below chose it). Every quality figure is the build's own, on its test data: accuracy, NLL, Brier and ECE at
T = 1 and at the method's own temperature (fitted on ID validation), AURC, MSP AUROC and the AUROC of the build's
served score (chosen on OOD validation sets, its statistics fitted for each method alike) on near and far OOD
sets. Hydra against each baseline: the verdict of ``benchmarks/recipe.py`` over paired seeds (a difference within
the spread of the per-seed differences is a tie).

Cost, measured here side by side in one process on random weights of the same architectures (latency does not
depend on the weights): multiply-adds per input against Single's (``torch.utils.flop_counter``), and milliseconds
per batch of 1 and 32 in eager PyTorch (min and median of the repeats), with Hydra also as served (its artifact's
TorchScript export). Writes ``benchmarks/results/frontier/<setting>.{md,json}``,
``benchmarks/results/plots/pareto_<setting>.png`` (served-score OOD AUROC against the multiply-add ratio), and the
shipped recipe's figures into ``benchmarks/results/summary.json`` (``shipped``) and ``tables.md`` (first section).

**The default rule** (``docs/build.md``): each setting ships the cheapest Hydra row (fewest multiply-adds) that ties
or wins against the k = 0 Hydra on accuracy, served OOD AUROC, AURC and NLL at its own temperature over the paired
seeds; each table ends with the rule's verdicts and what the chosen row gives up (its losses on the other figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import result_json
from benchmarks.bench_fusion import cpu_name
from benchmarks.frontier_tables import SETTINGS, markdown, plot, rows_kept, zero_shot_markdown
from offline.report.latency import measure_latency

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".cache" / "recipe"
OUT = ROOT / "benchmarks" / "results" / "frontier"
PLOTS = ROOT / "benchmarks" / "results" / "plots"
SEEDS = (0, 1, 2)
BASELINES = ("lora_ensemble", "batch_ensemble", "laplace")
# (table row, build variants it may come from (the first built of each seed), report method). Single is the same
# model in every variant of a seed (one cached base); Hydra with k = 0 comes with or without the baselines' rows
# beside it (they run after it, on a forked random state)
ROWS = (
    ("Single", ("baselines", "shipped", "k0", "trunk-3q", "trunk-half"), "single"),
    ("Single + Laplace (last layer)", ("baselines",), "laplace"),
    ("LoRA-Ensemble", ("baselines",), "lora_ensemble"),
    ("BatchEnsemble", ("baselines",), "batch_ensemble"),
    ("Hydra, k = 0", ("baselines", "k0"), "hydra"),
    ("Hydra, trunk k = L/2", ("trunk-half",), "hydra"),
    ("Hydra, trunk k = 3L/4", ("trunk-3q", "shipped"), "hydra"),
)
# the rows' names in results written before the default became the trunk at 3L/4
RENAMED = {"Hydra (k = 0, shipped)": "Hydra, k = 0"}
REFERENCE = "Hydra, k = 0"  # what the default rule holds each candidate against (the paper's fused model)
SHIPPED = "Hydra, trunk k = 3L/4"  # the row offline/configs/{image,text}-fast.yaml ship (hydra.shared_blocks: 4)


# the zero-shot table (the paper's Table 3): (table row, build variant, report method); each also in the user's words
ZERO_SHOT_ROWS = (
    ("Single", ("zs-vision", "zs-circuits", "zs-circuits-light"), "single"),
    ("Single + TS", ("zs-vision", "zs-circuits", "zs-circuits-light"), "single_ts"),
    ("Hydra, vision tower (Taylor, shipped)", ("zs-vision",), "hydra"),
    ("Hydra, both towers (circuits)", ("zs-circuits",), "hydra"),
    ("Hydra, both towers (circuits, 3 heads)", ("zs-circuits-light",), "hydra"),
)


def build_dir(setting: str, variant: str, seed: int) -> Path:
    return WORK / SETTINGS[setting] / (variant if seed == 0 else f"{variant}@seed{seed}")


def _auroc(row: dict[str, Any], score: str, kinds: dict[str, str], kind: str | None) -> float | None:
    det = row.get("ood_scores", {}).get(score)
    if not det:
        return None
    if kind is None:
        return det["avg"].get("auroc")
    vals = [v["auroc"] for name, v in det["ood"].items() if kinds.get(name) == kind]
    return sum(vals) / len(vals) if vals else None


def _report_row(out: Path, method: str) -> tuple[dict[str, Any], dict[str, str], str] | None:
    """``(the method's row of the build's report, the OOD sets' kinds, the served score)``; None when the build or the
    row is missing. The row carries the method's figures under shift as ``_shift`` when the build has them."""
    report, manifest = out / "report.json", out / "manifest.json"
    if not report.is_file() or not manifest.is_file():
        return None
    doc = json.loads(report.read_text())
    row = next((r for r in doc["rows"] if r["method"] == method), None)
    served = json.loads(manifest.read_text())["uncertainty"]["ood_score"]
    shifted = ((doc.get("extra") or {}).get("shift") or {}).get("methods", {}).get(method)
    if row is not None and shifted:
        row = {**row, "_shift": shifted["summary"]}
    return None if row is None else (row, doc["ood_kinds"], served)


def figures(out: Path, method: str) -> dict[str, Any] | None:
    """One method's figures in one build (None when the build or the row is missing)."""
    found = _report_row(out, method)
    if found is None:
        return None
    r, kinds, served = found
    cal = r.get("calibrated", {})
    return {
        "acc": r["acc"],
        "nll": r["nll"],
        "brier": r["brier"],
        "ece": r["ece"],
        "nll_ts": cal.get("nll"),
        "ece_ts": cal.get("ece"),
        "aurc": r["aurc"],
        "auroc_msp": _auroc(r, "msp", kinds, None),
        "served_score": served,
        "auroc_served": _auroc(r, served, kinds, None),
        "auroc_served_near": _auroc(r, served, kinds, "near"),
        "auroc_served_far": _auroc(r, served, kinds, "far"),
        "params": r["params"],
        "build_latency_ms": r.get("latency_ms"),
        # under shift (the build's corrupted copies of ID test inputs): the mean over corruptions and severities,
        # and per severity; each metric at the method's own temperature
        **({"shift": r["_shift"]} if "_shift" in r else {}),
    }


def zero_shot_figures(out: Path, method: str) -> dict[str, Any] | None:
    """One zero-shot row's figures in one build: accuracy, ECE, NLL, Brier and the MSP AUROC on near and far sets."""
    found = _report_row(out, method)
    if found is None:
        return None
    r, kinds, _ = found

    def auroc(kind: str) -> float | None:
        vals = [v["auroc"] for name, v in r["ood"].items() if kinds.get(name) == kind]
        return sum(vals) / len(vals) if vals else None

    return {
        "acc": r["acc"],
        "ece": r["ece"],
        "nll": r["nll"],
        "brier": r["brier"],
        "auroc_msp": r["ood_avg"]["auroc"],
        "auroc_msp_near": auroc("near"),
        "auroc_msp_far": auroc("far"),
        "temperature": r["temperature"],
    }


def committed(setting: str) -> dict[str, list[dict[str, Any]]]:
    """The rows of the committed results (``benchmarks/results/frontier/<setting>.json``), per table row and seed."""
    path = OUT / f"{setting}.json"
    rows = json.loads(path.read_text()).get("rows", {}) if path.is_file() else {}
    return {RENAMED.get(k, k): v for k, v in rows.items()}


def collect(setting: str, keep: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Per table row, its figures in each seed's build that has it. ``keep``: a (row, seed) whose build is not in
    the work folder keeps its figures from the committed results, marked ``"kept": true`` (they are that build's
    own figures, from an earlier run of this benchmark), so that a benchmark run can add builds to the tables
    without rebuilding all of them."""
    before = committed(setting) if keep else {}
    out: dict[str, list[dict[str, Any]]] = {}

    def add(name: str, seed: int, f: dict[str, Any] | None) -> None:
        if f is not None:
            out.setdefault(name, []).append({**f, "seed": seed})
            return
        old = next((o for o in before.get(name, []) if o["seed"] == seed), None)
        if old is not None:
            out.setdefault(name, []).append({**old, "kept": True})

    if setting == "zeroshot":
        for words in ("", "@words"):
            for label, variants, method in ZERO_SHOT_ROWS:
                for seed in SEEDS:
                    found = (zero_shot_figures(build_dir(setting, v, seed), method + words) for v in variants)
                    add(
                        label + (" (user's words)" if words else ""),
                        seed,
                        next((f for f in found if f is not None), None),
                    )
        return out
    for label, variants, method in ROWS:
        for seed in SEEDS:
            found = (figures(build_dir(setting, v, seed), method) for v in variants)
            add(label, seed, next((f for f in found if f is not None), None))
    return out


# ----------------------------------------------------------------------------- cost, side by side
Runner = Callable[[dict[str, torch.Tensor]], Any]


def _built(setting: str, variants: tuple[str, ...]) -> Path | None:
    """The first build of these variants, seed by seed (the cost depends on the architecture, not on the weights);
    None when none is in the work folder."""
    folders = (build_dir(setting, v, seed) for seed in SEEDS for v in variants)
    return next((f for f in folders if (f / "manifest.json").is_file()), None)


def _first_build(setting: str) -> Path | None:
    """A build of the shipped config (with or without the baselines), for its labels."""
    return _built(setting, ("baselines", "shipped"))


def _base_and_batches(cfg: Any, classes: int) -> tuple[torch.nn.Module, Callable[[int], dict[str, torch.Tensor]]]:
    """The shipped config's base architecture (random weights for a ViT, the packaged MiniLM for text) and a maker of
    input batches of a given size."""
    if cfg.family == "vit":
        from offline.models.loaders import load_timm

        arch = dict(cfg.base.arch)
        arch.pop("pretrained_cfg_overlay", None)
        base = load_timm(cfg.base.source.split(":", 1)[1], None, classes, **arch).eval()
        size, chans = arch.get("img_size", 224), arch.get("in_chans", 3)
        return base, lambda b: {"pixel_values": torch.randn(b, chans, size, size)}
    from offline.models.loaders import load_minilm_classifier

    base, _ = load_minilm_classifier(classes)
    T = cfg.base.max_length
    return base, lambda b: {"input_ids": torch.randint(1000, 2000, (b, T)), "attention_mask": torch.ones(b, T).long()}


def _runners(setting: str, cfg: Any) -> tuple[dict[str, Runner], dict[str, Runner], Callable[[int], Any]]:
    """Every row's model as ``batch -> output`` (eager), Hydra's also as served (TorchScript), and the batch maker."""
    from offline.pipelines.baselines import _forward, _repeat, batch_ensembled, lora_model, lora_runner
    from service.core.registry import load_model

    M = cfg.hydra.members
    first = _first_build(setting)
    assert first is not None, "cost() needs a build of the shipped config"
    manifest = json.loads((first / "manifest.json").read_text())
    torch.manual_seed(0)
    base, batch = _base_and_batches(cfg, len(manifest["labels"]))
    fwd = _forward(cfg.family)
    lora, names = lora_model(base, cfg.family, M, 0)
    lora_run = lora_runner(lora.eval(), names, cfg.family)
    be = batch_ensembled(base, M, 0).eval()
    runs: dict[str, Runner] = {
        "Single": lambda b: fwd(base, b),
        "Single + Laplace (last layer)": lambda b: fwd(base, b),  # + 10 draws of a C-way Gaussian: nothing next to it
        "LoRA-Ensemble": lambda b: lora_run(_repeat(b, M)),
        "BatchEnsemble": lambda b: fwd(be, _repeat(b, M)),
    }
    served: dict[str, Runner] = {}
    for label, variants, _ in ROWS[4:]:
        folder = _built(setting, variants)
        if folder is None:
            continue
        m = json.loads((folder / "manifest.json").read_text())
        model = load_model(folder / m["model"]["weights"], m["model"]["config"])
        runs[label] = lambda b, model=model: model(**b)
        if "torchscript" in m.get("exports", {}):
            traced = torch.jit.load(str(folder / m["exports"]["torchscript"]["file"])).eval()
            order = m["model"]["inputs"]
            served[label] = lambda b, traced=traced, order=order: traced(*(b[k] for k in order))
    return runs, served, batch


def cost(setting: str, reps: int = 7) -> dict[str, dict[str, Any]]:
    """Multiply-adds per input (ratio to Single) and ms per batch of 1 and 32 of every row's model, built on random
    weights of the shipped architectures, in one process; the rows' methods interleaved, batch by batch."""
    from benchmarks.cost import count_macs
    from offline.config import load_config
    from offline.pipelines.classifier_build import heads_of_base

    cfg = load_config(ROOT / "offline" / "configs" / f"{SETTINGS[setting]}.yaml")
    runs, served, batch = _runners(setting, cfg)
    one, many = batch(1), batch(32)
    macs_single = count_macs(lambda: runs["Single"](one))
    out: dict[str, dict[str, Any]] = {
        label: {"macs_ratio": round(count_macs(lambda run=run: run(one)) / macs_single, 3)}
        for label, run in runs.items()
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):  # interleaved: every model once per round, so that a slow spell hits them all
        for label, run in runs.items():
            timed = [("", run)] + ([("served_", served[label])] if label in served else [])
            for prefix, fn in timed:
                for name, b in (("batch1", one), ("batch32", many)):
                    times.setdefault((label, prefix + name), []).append(
                        measure_latency(lambda fn=fn, b=b: fn(b), reps=1)["min_ms"]
                    )
    for (label, key), ts in times.items():
        out[label][key] = {"min_ms": round(min(ts), 2), "median_ms": round(statistics.median(ts), 2)}
    depth = len(heads_of_base(cfg) or [])
    out["_setup"] = {"depth": depth, "members": cfg.hydra.members, "reps": reps, "threads": torch.get_num_threads()}
    return out


SUMMARY = ROOT / "benchmarks" / "results" / "summary.json"
TABLES = ROOT / "benchmarks" / "results" / "tables.md"
BEGIN, END = "<!-- shipped:begin (written by benchmarks/frontier.py) -->", "<!-- shipped:end -->"


def publish(done: dict[str, str], docs: dict[str, Any]) -> None:
    """The shipped recipe's figures into ``summary.json`` (its ``shipped`` block: per setting, each row's mean and
    standard deviation over the seeds) and ``tables.md`` (between the shipped markers, first): the quality benchmark's
    own tables below them compare its own member recipe, not the one the configs ship."""
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.is_file() else {}
    block: dict[str, Any] = {"command": "python -m benchmarks.frontier", "settings": {}}
    for setting, doc in docs.items():
        rows = {}
        for label, fs in doc["rows"].items():
            keys = [k for k in fs[0] if isinstance(fs[0][k], (int, float)) and k != "seed"]
            rows[label] = {
                "seeds": [f["seed"] for f in fs],
                **{
                    k: {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0}
                    for k in keys
                    if (v := [f[k] for f in fs if f.get(k) is not None])
                },
            }
        block["settings"][SETTINGS[setting]] = {"rows": rows, "cost": doc.get("cost")}
    kept = summary.get("shipped", {}).get("settings", {})
    block["settings"] = {**kept, **block["settings"]}  # a setting not rerun keeps its published figures
    summary["shipped"] = block
    result_json.write(SUMMARY, summary)
    text = TABLES.read_text() if TABLES.is_file() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + text[text.index(END) + len(END) :].lstrip("\n")
    section = [BEGIN, "", "### The shipped member recipe (`offline/configs/*-fast.yaml`, 3 seeds)", ""]
    section += ["The tables after this section are the quality benchmark's own recipe (`benchmarks/quality.py`)."]
    for md in done.values():
        section += ["", md.replace("# ", "#### ", 1)]
    TABLES.write_text("\n".join(section) + "\n" + END + "\n\n" + text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--no-cost", action="store_true", help="the tables from the builds only (no timing)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--no-publish", action="store_true", help="leave summary.json and tables.md as they are")
    ap.add_argument(
        "--builds-only",
        dest="keep",
        action="store_false",
        help="only the builds in the work folder (by default a seed without one keeps its committed figures)",
    )
    args = ap.parse_args(argv)
    here = f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, {platform.machine()}"
    OUT.mkdir(parents=True, exist_ok=True)
    done: dict[str, str] = {}
    docs: dict[str, Any] = {}
    for setting in args.settings:
        rows = collect(setting, args.keep)
        machine = here
        if rows and all(f.get("kept") for fs in rows.values() for f in fs):  # no build here: the figures' machine
            machine = json.loads((OUT / f"{setting}.json").read_text()).get("machine", here)
        if not rows:
            print(f"[frontier] {setting}: no builds under {WORK / SETTINGS[setting]}")
            continue
        if setting == "zeroshot":
            result_json.write(OUT / "zeroshot.json", {"machine": machine, "rows": rows})
            (OUT / "zeroshot.md").write_text(zero_shot_markdown(rows, machine))
            print((OUT / "zeroshot.md").read_text())
            done[setting], docs[setting] = zero_shot_markdown(rows, machine), {"rows": rows}
            continue
        costs = None if args.no_cost or _first_build(setting) is None else cost(setting, args.reps)
        if costs is None and args.keep:  # the committed cost, as it was measured then
            old = json.loads((OUT / f"{setting}.json").read_text()).get("cost") if rows_kept(rows) else None
            old = {RENAMED.get(k, k): v for k, v in old.items()} if old else None
            costs = {**old, "_setup": {**old.get("_setup", {}), "kept": True}} if old else None
        doc = {"setting": SETTINGS[setting], "machine": machine, "rows": rows, "cost": costs}
        result_json.write(OUT / f"{setting}.json", doc)
        page = markdown(setting, rows, costs, machine, (REFERENCE, SHIPPED))
        (OUT / f"{setting}.md").write_text(page)
        if costs:
            plot(setting, rows, costs, PLOTS / f"pareto_{setting}.png")
        print((OUT / f"{setting}.md").read_text())
        done[setting], docs[setting] = page, doc
    if done and not args.no_publish:
        publish(done, docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
