"""What collapses the last feature of the image models, and what the layer features and the backbone give back.

    .venv/bin/python -m benchmarks.ood_ablation --out benchmarks/results/ood_ablation

The image-fast setting's base model, members and fused Hydra are built with the builder's own code
(:mod:`offline.pipelines.classifier_build`, :mod:`offline.stages`) under a few variants, and every model's OOD scores
are computed the way a build does (Gaussians on the fit split, norms and thresholds on ID validation, 95 % of it let
through):

* ``scratch-<steps>``: the small ViT trained here from scratch for that many steps (the demo's base before the
  backbone; 400 steps is what ``image-fast`` trained): does longer training, i.e. higher accuracy, collapse the
  last feature?
* ``...+same-recipe``: the members fine-tuned on the same batches from the base's head, without distillation,
  against the shipped config's recipe (a bootstrap resample each, distillation from the base): does the member
  recipe collapse it?
* ``fit=train``: the Gaussians fitted on the training images instead of held-out ones;
* ``backbone``: the shipped configs' base, the pretrained backbone (``offline.train.pretrain``) fine-tuned.

For each model (single, each member, Hydra) and each score (``mahalanobis``: the last feature;
``mahalanobis_layers``: with the intermediate layers, its layer set as the build would choose it on validation)
the table gives the share flagged of ID test, held-out classes (near), digits, noise and the repository's
foreign-image set, and the mean AUROC over the OOD test sets. Writes ``<out>/ablation.json`` and ``ablation.md``.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import result_json
from benchmarks.bench_fusion import cpu_name
from offline.config import load_config
from offline.data.foreign import foreign_images
from offline.families import get_adapter
from offline.method.ensemble_metrics import ood_metrics
from offline.method.fusion import fuse
from offline.method.ood_fit import (
    candidate_scores,
    fit_layer_stats,
    fit_ood_stats,
    layer_candidates,
    layer_columns,
    scores_np,
    select_score,
)
from offline.pipelines.classifier_build import load_base, scoring_batches
from offline.stages import (
    EVAL_MAX_PIXELS,
    BuildContext,
    Members,
    Timer,
    build_members,
    collect,
    eval_batches,
    finetune_members,
    layer_candidate_name,
    load_data,
    with_features,
)
from service.core.preprocess import make_preprocessor

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = "offline/configs/image-fast.yaml"  # overridden to the from-scratch base below
SCRATCH_BASE = {
    "base.source": "train-vit",
    "base.preset": "vit_fast",
    "base.path": None,
    "base.arch": {},
    "hydra.strategy": "circuit-avg",
}  # the demo's base before the backbone
SAME = {"hydra.member_data": "same", "hydra.reinit_head": False, "hydra.distill": 0.0}
VARIANTS: dict[str, dict[str, Any]] = {
    "scratch-100": {**SCRATCH_BASE, "base.steps": 100},
    "scratch-400": {**SCRATCH_BASE, "base.steps": 400},
    "scratch-1200": {**SCRATCH_BASE, "base.steps": 1200},
    "scratch-400+same-recipe": {**SCRATCH_BASE, "base.steps": 400, **SAME},
    "backbone": {},
    "backbone+same-recipe": dict(SAME),
}
SETS = ("test", "ood:fashion-heldout", "ood:digits", "ood:noise", "foreign")


def outputs(cfg: Any, work: Path) -> tuple[dict[str, dict[str, tuple]], dict[str, torch.Tensor]]:
    """Every model's (single, members, Hydra) logits, features and layer features on every set, and the labels."""
    torch.manual_seed(cfg.data.seed)
    data = load_data(cfg)
    adapter = get_adapter(cfg.family)
    ctx = BuildContext.create(cfg, work, data, load_base(cfg, data, work), Timer())
    base, prep = ctx.base.model, ctx.base.preprocessing
    scored = Members(*build_members(cfg, adapter, base, scoring_batches(ctx), ctx.timer))
    members = finetune_members(ctx, scored).models
    fused, _ = fuse(adapter, members, mlp=cfg.hydra.mlp)
    fused.with_features = fused.with_layer_features = True
    pre = make_preprocessor(prep, work, EVAL_MAX_PIXELS)
    foreign = [f.pixels for f in foreign_images()]
    sets = {
        "fit": (data.fit.inputs, data.fit.labels),
        "train": (data.train.inputs[:600], data.train.labels[:600]),
        "val": (data.val.inputs, data.val.labels),
        "test": (data.test.inputs, data.test.labels),
        **{f"ood:{n}": (x, np.zeros(len(x), int)) for n, (x, _) in data.ood_test.items()},
        **{f"oodval:{n}": (x, np.zeros(len(x), int)) for n, x in data.ood_val.items()},
        "foreign": (foreign, np.zeros(len(foreign), int)),
    }
    models = {
        "single": with_features(lambda b: adapter.forward(base, b), base, adapter.layer_modules(base)),
        **{
            f"member_{i}": with_features(lambda b, m=m: adapter.forward(m, b), m, adapter.layer_modules(m))
            for i, m in enumerate(members)
        },
        "hydra": lambda b: fused(**b),
    }
    runs: dict[str, dict[str, tuple]] = {m: {} for m in models}
    labels = {}
    for name, (x, y) in sets.items():
        batches = eval_batches(pre, x, y, sort=False)[0]
        labels[name] = torch.cat([yy for _, yy in batches])
        for m, fn in models.items():
            runs[m][name] = collect(fn, batches)
    return runs, labels


def evaluate(run: dict[str, tuple], labels: dict[str, torch.Tensor], fit: str = "fit") -> dict[str, Any]:
    """Both scores of one model: flag rates at 95 % of ID validation and AUROC per set; the layer set chosen on the
    OOD validation sets as a build chooses it."""
    classes = int(labels["fit"].max()) + 1
    val = run["val"]
    stats = fit_ood_stats(run[fit][1], labels[fit], classes, val[0], val[1], 1.0)
    md = {n: scores_np((r[0], r[1], None), stats, 1.0)["mahalanobis"] for n, r in run.items()}
    full = fit_layer_stats(run[fit][2], labels[fit], classes, val[2], torch.from_numpy(md["val"]))
    cols = {n: layer_columns(r, stats, full, 1.0) for n, r in run.items()}
    cands = {
        layer_candidate_name(ids): {n: candidate_scores(c, full, ids) for n, c in cols.items()}
        for ids in layer_candidates(val[2].shape[2])
    }
    oodval = [n for n in run if n.startswith("oodval:")]
    chosen, _ = select_score(
        {k: v["val"] for k, v in cands.items()}, {n: {k: v[n] for k, v in cands.items()} for n in oodval}, 0.95
    )
    out = {}
    for score, per_set in (("mahalanobis", md), ("mahalanobis_layers", cands[chosen])):
        t = float(np.quantile(per_set["val"], 0.95))
        row = {
            "flagged": {s: float((per_set[s] > t).mean()) for s in SETS},
            "auroc": {s: ood_metrics(per_set["test"], per_set[s])["auroc"] for s in SETS if s != "test"},
        }
        row["mean_auroc_ood_test"] = float(np.mean([row["auroc"][s] for s in SETS if s.startswith("ood:")]))
        if score == "mahalanobis_layers":
            row["layers"] = chosen.split("@")[1]
        out[score] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ood_ablation"))
    ap.add_argument("--work", default=str(ROOT / ".cache" / "ood_ablation"), help="checkpoints (reused)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.variants:
        t0 = time.perf_counter()
        over = {**VARIANTS[name], "base.cache_dir": str(work / "bases")}
        cfg = load_config(ROOT / "offline/configs/image-fast.yaml", over)
        runs, labels = outputs(cfg, work / name)
        acc = {m: float((r["test"][0].mean(1).argmax(-1) == labels["test"]).float().mean()) for m, r in runs.items()}
        for m, run in runs.items():
            rows.append({"variant": name, "model": m, "test_accuracy": acc[m], **evaluate(run, labels)})
            if name == "scratch-400" and m in ("single", "hydra"):
                rows.append(
                    {
                        "variant": name + " fit=train",
                        "model": m,
                        "test_accuracy": acc[m],
                        **evaluate(run, labels, fit="train"),
                    }
                )
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    doc = {
        "machine": {"cpu": cpu_name(), "cores": torch.get_num_threads(), "platform": platform.platform()},
        "config": "offline/configs/image-fast.yaml",
        "variants": {k: VARIANTS[k] for k in args.variants},
        "rows": rows,
    }
    result_json.write(out / "ablation.json", doc, default=str)
    (out / "ablation.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict[str, Any]) -> str:
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    head = (
        "| variant | model | acc % | score | ID test | near | digits | noise | foreign | mean AUROC (OOD test) |\n"
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['cores']} threads. Flagged % at 95 % of ID "
        "validation; `mahalanobis_layers` with the layer set chosen on the OOD validation sets.",
        "",
        head,
    ]
    for r in doc["rows"]:
        for score in ("mahalanobis", "mahalanobis_layers"):
            f = r[score]["flagged"]
            label = score if score == "mahalanobis" else f"{score} @{r[score]['layers']}"
            lines.append(
                f"| {r['variant']} | {r['model']} | {pct(r['test_accuracy'])} | {label} | "
                f"{pct(f['test'])} | {pct(f['ood:fashion-heldout'])} | {pct(f['ood:digits'])} | "
                f"{pct(f['ood:noise'])} | {pct(f['foreign'])} | {pct(r[score]['mean_auroc_ood_test'])} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
