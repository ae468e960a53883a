"""The members' recipe ablated through real builds: which lever makes the members disagree where they should.

    .venv/bin/python -m benchmarks.recipe --config offline/configs/text-fast.yaml --out benchmarks/results/recipe/text
    .venv/bin/python -m benchmarks.recipe --config offline/configs/image-fast.yaml \\
        --out benchmarks/results/recipe/image --variants baseline bootstrap

Each variant is one ``offline/build.py`` build of the config with a few ``hydra.*`` overrides (the levers of
``docs/artifact.md``/``offline/config.py``: member data order or bootstrap, head re-initialisation, per-member
MLPs, more heads pruned, longer fine-tuning). Builds go to ``--work`` and are reused when their overrides and the
builder's source match (a run resumes); the base model is shared through ``base.cache_dir``. From each build's
``report.json`` the script collects what the promise is about, all computed by the build itself on its test data:

* diversity: Hydra's mean mutual information on OOD test inputs, and the members' agreement (mean pairwise
  Spearman rank correlation of their per-member Mahalanobis scores on OOD test inputs);
* detection: the served score (selected on OOD *validation* sets), its flag's recall on each OOD test set and
  its ID test flag rate; mean AUROC of Hydra with the served score vs Single and the best member with the same
  score (what the features give vs what the ensemble gives);
* calibration: ECE of Hydra and Single at T = 1 and each at its own fitted temperature.

Writes ``<out>/recipe.json`` (one row per variant, plus the machine) and ``<out>/recipe.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import result_json
from benchmarks.bench_fusion import cpu_name
from offline.build import build
from offline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
# variant name -> config overrides (dotted keys, as offline/build.py's flags). Every variant names each lever it
# relies on, so its meaning does not depend on the config's own defaults.
_OWN = {"hydra.member_data": "bootstrap", "hydra.reinit_head": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {"hydra.member_data": "same", "hydra.reinit_head": False},
    "order": {"hydra.member_data": "order", "hydra.reinit_head": False},
    "bootstrap": dict(_OWN),
    "bootstrap+reinit": {"hydra.member_data": "bootstrap", "hydra.reinit_head": True},
    "per-member-mlp": {**_OWN, "hydra.mlp": "per_member"},
    "longer": {**_OWN, "hydra.finetune_steps": "x3"},
    "more-pruned": {**_OWN, "hydra.prune_per_layer": "+1"},
    # the paper's post-pruning recipe where 2 cores allow: own data, fresh heads, label smoothing 0.1, 3x the steps
    "paper-recipe": {
        "hydra.member_data": "bootstrap",
        "hydra.reinit_head": True,
        "hydra.label_smoothing": 0.1,
        "hydra.finetune_steps": "x3",
    },
    # distillation from the unpruned base (Hinton et al.), from the base's head: alone, then with the diversity
    # that survives it (own bootstrap draws, a different temperature per member), then partial fine-tuning
    "kd": {"hydra.member_data": "same", "hydra.reinit_head": False, "hydra.distill": 0.5},
    "kd+diverse": {**_OWN, "hydra.distill": 0.5, "hydra.distill_temperatures": [1.0, 2.0, 4.0]},
    "kd+diverse+longer": {
        **_OWN,
        "hydra.distill": 0.5,
        "hydra.distill_temperatures": [1.0, 2.0, 4.0],
        "hydra.finetune_steps": "x3",
    },
    # kd+diverse without the preset's label smoothing (0.1 for the images): the smoothing is what keeps the members,
    # and so Hydra, underconfident at T = 1
    "kd+diverse+nols": {
        **_OWN,
        "hydra.distill": 0.5,
        "hydra.distill_temperatures": [1.0, 2.0, 4.0],
        "hydra.label_smoothing": 0.0,
    },
    "partial": {**_OWN, "hydra.finetune_blocks": 2},
    "partial+kd+diverse": {
        **_OWN,
        "hydra.finetune_blocks": 2,
        "hydra.distill": 0.5,
        "hydra.distill_temperatures": [1.0, 2.0, 4.0],
    },
    # the config as it ships, without a shared trunk (the paper's fused model), and with a shared trunk of half and
    # three quarters of its L blocks (rounded down; the fast configs ship 3L/4: docs/build.md, "The default rule")
    "shipped": {},
    "k0": {"hydra.shared_blocks": 0},
    # without a trunk, with the efficient-ensemble baselines' rows beside Hydra's (offline/pipelines/baselines.py)
    "baselines": {"base.baselines": ["lora_ensemble", "batch_ensemble", "laplace"], "hydra.shared_blocks": 0},
    "trunk-half": {"hydra.shared_blocks": "L/2"},
    # zero-shot (offline/configs/zeroshot-*.yaml): the shipped vision-tower Taylor members, and joint circuits over
    # both towers (the paper's zero-shot recipe), neither trained; each also scored with a user's own words
    "zs-vision": {"data.label_words": "fashion-words"},
    "zs-circuits": {"hydra.strategy": "circuit-avg", "data.label_words": "fashion-words"},
    # the same circuits at half the budget (3 heads removed per member instead of 6): members nearer the base model
    "zs-circuits-light": {"hydra.strategy": "circuit-avg", "hydra.prune_total": 3, "data.label_words": "fashion-words"},
    "trunk-3q": {"hydra.shared_blocks": "3L/4"},
}
TRUNK = {"L/2": (1, 2), "3L/4": (3, 4)}  # a share of the base model's blocks: numerator, denominator
# a user's own words for the six in-distribution Fashion-MNIST classes of the zero-shot settings, written without
# looking at any image
FASHION_WORDS = {
    "T-shirt/top": "tee",
    "Trouser": "pair of pants",
    "Pullover": "sweater",
    "Dress": "frock",
    "Coat": "jacket",
    "Shirt": "blouse",
}
NAMED = {"fashion-words": FASHION_WORDS}


def resolve(overrides: dict[str, Any], base: Any) -> dict[str, Any]:
    """Relative overrides made absolute against the config: ``x3`` multiplies, ``+1`` adds, ``L/2`` and ``3L/4``
    are shares of the base model's blocks (read from its config files)."""
    out = {}
    for key, value in overrides.items():
        current = getattr(getattr(base, key.split(".")[0]), key.split(".")[1])
        if isinstance(value, str) and value in NAMED:
            value = NAMED[value]
        elif isinstance(value, str) and value in TRUNK:
            from offline.pipelines.classifier_build import heads_of_base

            heads = heads_of_base(base)
            if heads is None:
                raise SystemExit(f"{key}={value}: the base model's blocks cannot be read from its config files")
            num, den = TRUNK[value]
            value = len(heads) * num // den
        elif isinstance(value, str) and value.startswith("x"):
            value = int(current * float(value[1:]))
        elif isinstance(value, str) and value.startswith("+"):
            value = int(current + int(value[1:]))
        out[key] = value
    return out


def run_variant(
    config: Path,
    name: str,
    work: Path,
    cache: Path,
    seed: int = 0,
    deep_ensemble: int = 0,
    shift_inputs: int = 0,
    device: str = "cpu",
) -> Path:
    """Build one variant into ``work/name`` (``name@seed<s>`` for another ``data.seed``: splits, base, members)
    unless a build with the same overrides is there already; ``deep_ensemble``: the size of the build's Deep
    Ensemble baseline (``base.deep_ensemble``, 0 = none); ``shift_inputs``: its shift section's inputs
    (``data.shift_inputs``, 0 = none); ``device``: ``build.device`` (``cuda`` trains in fp32 there too, so that its
    figures stay those of the fp32 recipe)."""
    base_cfg = load_config(config)
    over = {**resolve(VARIANTS[name], base_cfg), "base.cache_dir": str(cache), "name": f"{base_cfg.name}-{name}"}
    if deep_ensemble:
        over["base.deep_ensemble"] = deep_ensemble
    if shift_inputs:
        over["data.shift_inputs"] = shift_inputs
    if device != "cpu":
        over["build.device"] = device
        over["build.precision"] = "fp32"
    if seed:
        over["data.seed"] = seed
        name = f"{name}@seed{seed}"
    out = work / name
    stamp = work / f".{name}.json"
    over = {**over, "builder": builder_digest()}  # a build of other builder code is not reused
    if (out / "manifest.json").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == over:
        print(f"[recipe] {name}: reusing {out}", flush=True)
        return out
    print(f"[recipe] {name}: building {over}", flush=True)
    t0 = time.perf_counter()
    build(load_config(config, {k: v for k, v in over.items() if k != "builder"}), out)
    stamp.write_text(json.dumps(over))
    (work / f".{name}.seconds").write_text(f"{time.perf_counter() - t0:.1f}")
    return out


def builder_digest() -> str:
    """A digest of the builder's and the server's source (``offline/``, ``service/``): what a build depends on
    besides its config. (Base models cached in ``base.cache_dir`` are keyed by their config and training settings
    only: clear the folder after changing how a base trains.)"""
    h = hashlib.sha256()
    for path in sorted([*ROOT.glob("offline/**/*.py"), *ROOT.glob("service/**/*.py")]):
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _served_auroc(row: dict[str, Any], score: str) -> float | None:
    return row.get("ood_scores", {}).get(score, {}).get("avg", {}).get("auroc")


def summarize(name: str, out: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """One table row from a build's ``report.json`` and ``manifest.json``."""
    doc = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    extra = doc["extra"]
    served = extra.get("served_flag", {})
    score = served.get("score", extra.get("ood_score"))
    members = [r for k, r in rows.items() if k.startswith("member_")]
    member_auroc = [a for a in (_served_auroc(r, score) for r in members) if a is not None]
    hydra, single, de = rows["hydra"], rows["single"], rows.get("deep_ensemble")
    return {
        "variant": name,
        "overrides": overrides,
        "acc": hydra["acc"],
        "acc_single": single["acc"],
        "served_score": score,
        "id_test_flag_rate": served.get("id_test_flag_rate"),
        "recall": served.get("recall", {}),
        "ood_kinds": doc.get("ood_kinds", {}),
        "auroc_hydra": _served_auroc(hydra, score),
        "auroc_single": _served_auroc(single, score),
        "auroc_best_member": max(member_auroc) if member_auroc else None,
        "auroc_deep_ensemble": _served_auroc(de, score) if de else None,
        "ece_deep_ensemble_ts": de.get("calibrated", {}).get("ece") if de else None,
        "auroc_by_score": {s: v["avg"].get("auroc") for s, v in hydra.get("ood_scores", {}).items()},
        "mi_ood": hydra.get("mi_ood"),
        "member_rank_corr": extra.get("member_rank_correlation_ood", {}),
        "ece_hydra": hydra["ece"],
        "ece_single": single["ece"],
        "ece_hydra_ts": hydra.get("calibrated", {}).get("ece"),
        "ece_single_ts": single.get("calibrated", {}).get("ece"),
        **targets(doc),
        "build_s": float((out.parent / f".{name}.seconds").read_text())
        if (out.parent / f".{name}.seconds").is_file()
        else None,
    }


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    """What the ensemble must earn, Hydra's and Single's side by side (``<figure>_hydra`` / ``<figure>_single``): NLL
    at their own temperatures, AURC, OOD AUROC with MSP (also the Deep Ensemble's, where one is built), the conformal
    sets' mean size at alpha 0.05 and 0.1, the accept rate and the error among accepted answers of the risk rule at
    5 %, and, with a shift section, accuracy, Brier, ECE and AURC on the shifted copies averaged over the corruptions
    and severities."""
    rows = {r["method"]: r for r in doc["rows"]}
    extra = doc["extra"]
    guarantees = (extra.get("guarantees_report") or {}).get("methods") or {}
    de = rows.get("deep_ensemble")
    out: dict[str, Any] = {"auroc_msp_deep_ensemble": _served_auroc(de, "msp") if de else None}
    shift = (extra.get("shift") or {}).get("methods") or {}
    for method in ("hydra", "single"):
        row, g = rows[method], guarantees.get(method) or {}
        rule = next((r for r in g.get("selective", []) if abs(r["risk"] - 0.05) < 1e-9), {})
        mean_shift = (shift.get(method) or {}).get("summary", {}).get("mean", {})
        out |= {
            f"nll_ts_{method}": row.get("calibrated", {}).get("nll"),
            f"aurc_{method}": row.get("aurc"),
            f"auroc_msp_{method}": _served_auroc(row, "msp"),
            f"set_size_05_{method}": (g.get("coverage") or {}).get("0.05", {}).get("mean_size"),
            f"set_size_10_{method}": (g.get("coverage") or {}).get("0.1", {}).get("mean_size"),
            f"accept_05_{method}": rule.get("test_accept_rate"),
            f"accepted_error_05_{method}": rule.get("test_risk"),
            f"shift_acc_{method}": mean_shift.get("acc"),
            f"shift_brier_{method}": mean_shift.get("brier"),
            f"shift_ece_{method}": mean_shift.get("ece"),
            f"shift_aurc_{method}": mean_shift.get("aurc"),
        }
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def markdown(rows: list[dict[str, Any]], config: str, machine: str) -> str:
    """The results as two tables: detection and diversity, calibration."""
    sets = list(rows[0]["recall"]) if rows else []
    kinds = rows[0]["ood_kinds"] if rows else {}
    head = ["variant", "served score", "ID test flagged %"] + [f"recall {s} ({kinds.get(s, '?')}) %" for s in sets]
    head += ["AUROC Hydra", "Single", "best member", "Deep Ens.", "MI OOD", "member rank corr. (Mahalanobis)"]
    lines = [
        f"Config `{config}`; {machine}. Scores and thresholds fixed on validation data; figures on test data.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["variant"], r["served_score"], _pct(r["id_test_flag_rate"])]
        cells += [_pct(r["recall"].get(s)) for s in sets]
        corr = r["member_rank_corr"].get("mahalanobis")
        cells += [
            _pct(r["auroc_hydra"]),
            _pct(r["auroc_single"]),
            _pct(r["auroc_best_member"]),
            _pct(r.get("auroc_deep_ensemble")),
            "–" if r["mi_ood"] is None else f"{r['mi_ood']:.4f}",
            "–" if corr is None else f"{corr:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| variant | acc % | ECE Hydra T=1 | ECE Single T=1 | ECE Hydra own T | ECE Single own T "
        "| ECE Deep Ens. own T | build s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    calibration = ("acc", "ece_hydra", "ece_single", "ece_hydra_ts", "ece_single_ts", "ece_deep_ensemble_ts")
    for r in rows:
        build_s = "–" if r["build_s"] is None else f"{r['build_s']:.0f}"
        cells = [r["variant"], *(_pct(r.get(k)) for k in calibration), build_s]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path, help="a build config (offline/configs/*-fast.yaml)")
    ap.add_argument("--out", required=True, type=Path, help="folder for recipe.json and recipe.md")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "recipe", help="where the builds go (reused)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "bases", help="base.cache_dir for the builds")
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="data.seed of each build (splits, base model, members); several: a table over seeds too",
    )
    ap.add_argument(
        "--shift-inputs",
        type=int,
        default=0,
        help="data.shift_inputs of each build: the report's shift section on this many corrupted test inputs",
    )
    ap.add_argument(
        "--deep-ensemble",
        type=int,
        default=0,
        help="base.deep_ensemble of each build: a Deep Ensemble baseline of this many base models",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="build.device of each build (cuda: fp32 there too, so the figures are those of the fp32 recipe)",
    )
    args = ap.parse_args(argv)
    work = args.work / args.config.stem
    work.mkdir(parents=True, exist_ok=True)
    machine = f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, {platform.machine()}"
    if args.device == "cuda":
        import torch

        machine += f"; builds on {torch.cuda.get_device_name(0)}"
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    text = ""
    for name in args.variants:
        for seed in args.seeds:
            out = run_variant(
                args.config, name, work, args.cache, seed, args.deep_ensemble, args.shift_inputs, args.device
            )
            rows.append({**summarize(out.name, out, VARIANTS[name]), "seed": seed, "recipe": name})
            # written after every build: a long run that stops keeps the rows it has
            doc = {"config": str(args.config), "machine": machine, "seeds": args.seeds, "rows": rows}
            several = len({r["seed"] for r in rows}) > 1
            text = markdown(rows, str(args.config), machine) + (over_seeds(rows) if several else "")
            result_json.write(args.out / "recipe.json", doc)
            (args.out / "recipe.md").write_text(text)
    print(text)
    return 0


def _mean_std(values: list[float | None]) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "–"
    m = sum(v) / len(v)
    sd = (sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0
    return f"{100 * m:.1f} ± {100 * sd:.1f}"


def over_seeds(rows: list[dict[str, Any]]) -> str:
    """Mean ± standard deviation over the seeds of each recipe: the served flag and the AUROCs."""
    sets = list(rows[0]["recall"])
    head = ["recipe", "seeds", "ID test flagged %"] + [f"recall {s} %" for s in sets]
    head += ["AUROC Hydra", "Single", "best member", "Deep Ens.", "MSP AUROC Hydra", "MSP Deep Ens."]
    lines = ["", "Over seeds (mean ± std):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        rs = [r for r in rows if r["recipe"] == recipe]
        cells = [recipe, ", ".join(str(r["seed"]) for r in rs), _mean_std([r["id_test_flag_rate"] for r in rs])]
        cells += [_mean_std([r["recall"].get(s) for r in rs]) for s in sets]
        cells += [
            _mean_std([r.get(k) for r in rs])
            for k in (
                "auroc_hydra",
                "auroc_single",
                "auroc_best_member",
                "auroc_deep_ensemble",
                "auroc_msp_hydra",
                "auroc_msp_deep_ensemble",
            )
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + targets_over_seeds(rows)


# (figure, key stem, lower is better): Hydra against Single, each over the seeds
TARGETS = (
    ("accuracy %", "acc", False),
    ("NLL, own T", "nll_ts", True),
    ("ECE %, own T", "ece_ts", True),
    ("ECE %, T = 1", "ece", True),
    ("AURC", "aurc", True),
    ("set size, alpha 0.05", "set_size_05", True),
    ("set size, alpha 0.1", "set_size_10", True),
    ("accepted % at risk 5 %", "accept_05", False),
    ("error among accepted %", "accepted_error_05", True),
    ("OOD AUROC %, served score", "auroc", False),
    ("OOD AUROC %, MSP", "auroc_msp", False),
    ("shifted: accuracy %", "shift_acc", False),
    ("shifted: Brier", "shift_brier", True),
    ("shifted: ECE %, own T", "shift_ece", True),
    ("shifted: AURC", "shift_aurc", True),
)
_PERCENT = {"acc", "ece_ts", "ece", "accept_05", "accepted_error_05", "auroc", "auroc_msp", "shift_acc", "shift_ece"}


def _key(stem: str, method: str) -> str:
    """The row key of a :data:`TARGETS` figure (``<stem>_<method>``, but for two older keys)."""
    if stem == "acc":
        return "acc" if method == "hydra" else "acc_single"
    return f"ece_{method}_ts" if stem == "ece_ts" else f"{stem}_{method}"


def verdict(hydra: list[float], single: list[float], lower_is_better: bool) -> str:
    """Hydra against Single over paired seeds: ``win`` / ``loss`` when the mean difference exceeds the standard
    deviation of the per-seed differences, else ``tie`` (also with one seed: no spread to compare against)."""
    d = [h - s for h, s in zip(hydra, single, strict=True)]
    if len(d) < 2:
        return "tie (1 seed)"
    mean = sum(d) / len(d)
    sd = (sum((x - mean) ** 2 for x in d) / (len(d) - 1)) ** 0.5
    if abs(mean) <= sd:
        return "tie"
    return "win" if (mean < 0) == lower_is_better else "loss"


def targets_over_seeds(rows: list[dict[str, Any]]) -> str:
    """Per recipe, each target figure of Hydra and Single (mean ± std over the seeds) and Hydra's verdict."""
    lines = ["", "Hydra against Single over seeds (mean ± std; a difference within its spread is a tie):", ""]
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        rs = [r for r in rows if r["recipe"] == recipe]
        lines += [f"**{recipe}** (seeds {', '.join(str(r['seed']) for r in rs)})", ""]
        lines += ["| figure | Hydra | Single | Hydra vs Single |", "|---|---|---|---|"]
        for label, stem, lower in TARGETS:
            h, s = ([r.get(_key(stem, m)) for r in rs] for m in ("hydra", "single"))
            if any(v is None for v in (*h, *s)):
                continue
            fmt = _mean_std if stem in _PERCENT else _mean_std_raw
            lines.append(f"| {label} | {fmt(h)} | {fmt(s)} | {verdict(h, s, lower)} |")
        lines.append("")
    return "\n".join(lines)


def _mean_std_raw(values: list[float | None]) -> str:
    v = [x for x in values if x is not None]
    m = sum(v) / len(v)
    sd = (sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0
    return f"{m:.4f} ± {sd:.4f}"


if __name__ == "__main__":
    sys.exit(main())
