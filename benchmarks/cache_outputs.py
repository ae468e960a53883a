"""A built model's outputs on its own data splits, cached for the guarantees' simulation tests.

    .venv/bin/python -m benchmarks.cache_outputs --artifact artifacts/default/text \\
        --out tests/fixtures/outputs/text-fast.npz

Loads the artifact as the server does (``service.core.registry.load_model``, its preprocessing, temperature and OOD
statistics) and runs it on the splits its build drew (the manifest's resolved config: the same data setting,
sizes and seed): the calibration split, ID validation and test, and each OOD test set. Saves per split the
ensemble probabilities (float32 ``(N, C)``), the labels and the served OOD score (float64 ``(N,)``): what the
conformal sets, OOD p-values, risk rules and the drift alarm need, so that ``tests/service/
test_guarantees_simulation.py`` checks the guarantees by simulation on a real model's outputs without a build.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from offline.config import load_config
from offline.method.ood_fit import scores_np
from offline.stages import EVAL_MAX_PIXELS, collect, eval_batches, load_data
from service.core.artifact import load_manifest
from service.core.ood import ood_from_tensors
from service.core.preprocess import make_preprocessor
from service.core.registry import load_model
from service.core.uncertainty import summarize

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    root = Path(args.artifact)
    m = load_manifest(root)
    if m.task != "classification" or m.build is None:
        raise SystemExit("cache_outputs: a classifier artifact written by the builder is needed")
    cfg = load_config(None, m.build["config"])
    data = load_data(cfg)
    if data.calibration is None:
        raise SystemExit("cache_outputs: the build drew no calibration split")
    model = load_model(root / m.model.weights, m.model.config)
    model.with_features = "features" in m.model.outputs
    model.with_layer_features = "layer_features" in m.model.outputs
    pre = make_preprocessor(m.preprocessing, root, EVAL_MAX_PIXELS)
    stats = ood_from_tensors(load_file(str(root / m.ood.file))) if m.ood is not None else None
    T, metric = m.uncertainty.temperature, m.uncertainty.ood_score
    splits = {
        "calibration": (data.calibration.inputs, data.calibration.labels),
        "val": (data.val.inputs, data.val.labels),
        "test": (data.test.inputs, data.test.labels),
        **{f"ood:{n}": (x, np.zeros(len(x), int)) for n, (x, _) in data.ood_test.items()},
    }
    arrays: dict[str, np.ndarray] = {}
    for name, (x, y) in splits.items():
        batches, _ = eval_batches(pre, x, y, sort=False)
        run = collect(lambda b: model(**b), batches)
        arrays[f"{name}/probs"] = summarize(run[0], T)["probs"].float().numpy()
        arrays[f"{name}/labels"] = torch.cat([yy for _, yy in batches]).numpy().astype(np.int64)
        arrays[f"{name}/score"] = scores_np(run, stats, T)[metric]
        print(name, len(y), flush=True)
    meta = {
        "artifact": m.name,
        "version": m.version,
        "metric": metric,
        "labels": m.labels,
        "guarantees": m.guarantees.conformal.method if m.guarantees is not None else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.asarray(json.dumps(meta)), **arrays)
    print(f"{out}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
