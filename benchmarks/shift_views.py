"""Why the served OOD score misses mild pixel-level shift, and whether the drift alarm would fire sooner on more views.

The stream benchmark (``benchmarks/stream.py``) shows shifted streams that cost 10-17 points of accuracy with only
12-25 % of their inputs flagged, and a drift alarm that needs 30-60 inputs to fire on them. This measures, on the
stream benchmark's own inputs (the same pools, draw and corruption seed), what every *view* the artifact has of an
input sees of each corruption and severity:

* the served score; for ``mahalanobis_layers`` each column it combines (the last feature's Mahalanobis score and
  each selected layer's, standardised as the artifact does) on its own; the negated MSP;
* per view, the share of inputs above the calibration split's 95th percentile (what a flag at ``ood_alpha`` 0.05
  on that view alone would catch), with the ID validation split as the false-alarm check;
* the first input at which the drift alarm would fire on the served score (the server's procedure,
  :class:`service.core.drift.DriftMonitor`) against two alternatives that keep its false-alarm bound ``m / A`` (the
  mean of Shiryaev-Roberts processes is one): an alarm on every view at once (the served mixture of bets per view,
  fitted at ``delta / J``, on when the mean of the ``J`` statistics reaches ``A``), and the previous alarm's one bet
  on the served score (levels 0.05, 0.1, 0.2 at stake 0.25: what the mixture gains over it);
* Lorden's lower bound on the mean delay of *any* detector with that false-alarm rate, ``log A / KL`` with the
  divergence of the stream's served p-values from uniform (estimated): where it exceeds the delay a target asks
  for, no alarm on the served score can meet it.

Nothing is fitted: every threshold comes from the artifact's calibration split. Also the views' share on the build's
mild-shift validation set (:func:`offline.data.outliers.shifted`, shifts none of the corruptions have).

    python -m benchmarks.shift_views --artifact artifacts/default/image

Writes ``benchmarks/results/shift_views/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from benchmarks import harness
from benchmarks.stream import SEVERITIES, STREAM_SEED, image_pool, text_pool
from benchmarks.stream_figures import lorden_bound
from offline.config import load_config
from offline.data.outliers import shifted
from offline.method.corruptions import corrupt, corruptions
from offline.stages import EVAL_MAX_PIXELS, eval_batches, load_data
from service.core.artifact import load_manifest
from service.core.conformal import ood_p_values
from service.core.drift import CAP_DECADES, COMPONENTS, HORIZON, LEVELS, STAKE, DriftMonitor, TailBets, alarm_paths
from service.core.guarantees import outlier_oriented
from service.core.ood import ensemble_scores, layer_pair_scores, mahalanobis, ood_from_tensors, standardize
from service.core.preprocess import make_preprocessor
from service.core.registry import load_model
from service.core.uncertainty import summarize

DRIFT_DELTA = 0.01  # the builder's default drift delta


class Views:
    """An artifact's model and every view of an input it has (module docstring): ``__call__`` gives ``(N, J)``
    outlier-oriented scores, column 0 the served score."""

    def __init__(self, root: Path) -> None:
        self.manifest = load_manifest(root)
        m = self.manifest
        self.model = load_model(root / m.model.weights, m.model.config)
        self.model.with_features = "features" in m.model.outputs
        self.model.with_layer_features = "layer_features" in m.model.outputs
        self.pre = make_preprocessor(m.preprocessing, root, EVAL_MAX_PIXELS)
        self.stats = ood_from_tensors(load_file(str(root / m.ood.file))) if m.ood is not None else None
        self.metric, self.T = m.uncertainty.ood_score, m.uncertainty.temperature
        layers = self.stats.layers if self.stats is not None and self.metric == "mahalanobis_layers" else None
        self.layers = layers
        self.names = [f"served ({self.metric})"]
        if layers is not None:
            self.names += ["last feature"] + [f"block {i}" for i in layers.ids]
        self.names.append("MSP")

    @torch.no_grad()
    def __call__(self, inputs: Any, predictions: bool = False) -> Any:
        """``(N, J)`` scores of ``inputs``; with ``predictions`` also the served predictions ``(N,)``."""
        batches, _ = eval_batches(self.pre, inputs, np.zeros(len(inputs), int), sort=False)
        rows, preds = [], []
        for batch, _ in batches:
            out = self.model(**batch)
            out = out if isinstance(out, tuple) else (out,)
            logits, feats = out[0], out[1] if len(out) > 1 else None
            lf = out[2] if len(out) > 2 else None
            summary = summarize(logits, self.T)
            s = ensemble_scores(logits, feats, self.stats, self.T, summary=summary, layer_features=lf)
            cols = [torch.as_tensor(outlier_oriented(s[self.metric].numpy(), self.metric))]
            if self.layers is not None:
                assert self.stats is not None and feats is not None and lf is not None
                last = standardize(mahalanobis(feats, self.stats.gaussians), *self.stats.norms["mahalanobis"])
                c = torch.cat([last.unsqueeze(2), layer_pair_scores(lf, self.layers)], dim=2).mean(dim=1)
                cols += list(standardize(c.double(), *self.layers.column_norms).T)
            cols.append(-s["msp"].double())
            rows.append(torch.stack([c.double() for c in cols], dim=1))
            preds.append(summary["prediction"])
        scores = torch.cat(rows).numpy()
        return (scores, torch.cat(preds).numpy()) if predictions else scores


def first_alarm_mixture(cal: np.ndarray, stream: np.ndarray, previous: bool = False) -> int | None:
    """The first input (1-based) at which the mean over the views of each view's alarm statistic reaches
    ``A = HORIZON / delta``, from a fresh start; None if it never does. ``cal (n, J)``, ``stream (T, J)``. Each view
    gets the served alarm's bets (:data:`service.core.drift.COMPONENTS`) fitted at ``delta / J``, or with
    ``previous`` the previous alarm's one bet (levels 0.05, 0.1, 0.2 at stake 0.25)."""
    j = cal.shape[1]
    comps = [(LEVELS, STAKE)] if previous else COMPONENTS
    fitted = [TailBets.fit(cal[:, k], DRIFT_DELTA / j, comps) for k in range(j)]
    log_e = np.concatenate([b.log_e(stream[:, k]) for k, b in enumerate(fitted)], axis=1)  # (T, sum of J_k)
    log_w = np.concatenate([b.log_weights - math.log(j) for b in fitted])
    log_a = math.log(HORIZON / DRIFT_DELTA)
    _, on = alarm_paths(log_e[None], log_a, log_a + CAP_DECADES * math.log(10), log_w)
    hit = np.flatnonzero(on[0])
    return int(hit[0]) + 1 if hit.size else None


def lorden_estimate(cal: np.ndarray, scores: np.ndarray) -> float | None:
    """``log A / KL``: Lorden's lower bound on the mean delay of any change detector whose mean run length to a false
    alarm is at least ``A``, for a change from the calibration split's p-values (uniform) to these; KL estimated
    from the served score's binned p-values (:func:`benchmarks.stream_figures.lorden_bound`: an estimate, not a
    bound: binning lowers the divergence, a sample of 640 raises it). None: no divergence seen."""
    return lorden_bound(ood_p_values(scores, np.sort(cal)).tolist(), HORIZON / DRIFT_DELTA)


def first_alarm_served(cal: np.ndarray, stream: np.ndarray) -> int | None:
    """The served alarm's first input on the served scores (column 0), from a fresh start."""
    mon = DriftMonitor(cal[:, 0], delta=DRIFT_DELTA)
    _, on = mon.simulate(stream[None, :, 0])
    hit = np.flatnonzero(on[0])
    return int(hit[0]) + 1 if hit.size else None


def row(name: str, cal: np.ndarray, x: np.ndarray, accuracy: float | None) -> dict[str, Any]:
    cut = np.quantile(cal, 0.95, axis=0)  # (J,) the calibration split's 95th percentile per view
    return {
        "stream": name,
        "accuracy": accuracy,
        "flagged": (x > cut).mean(axis=0).round(4).tolist(),
        "alarm_served": first_alarm_served(cal, x),
        "alarm_every_view": first_alarm_mixture(cal, x),
        "alarm_previous_bet": first_alarm_mixture(cal[:, :1], x[:, :1], previous=True),
        "lorden_delay": lorden_estimate(cal[:, 0], x[:, 0]),
    }


def run(root: Path, inputs: int) -> dict[str, Any]:
    views = Views(root)
    m = views.manifest
    manifest = json.loads((root / "manifest.json").read_text())
    data = load_data(load_config(None, m.build["config"]))
    if data.calibration is None:
        raise SystemExit("shift_views: the artifact's build drew no calibration split")
    modality = "image" if m.family == "vit" else "text"
    cal = views(data.calibration.inputs)
    print(f"calibration: {len(cal)}", flush=True)
    rows = [row("ID validation", cal, views(data.val.inputs), None)]
    if modality == "image":
        mild = data.ood_val.get("shifted")  # the build's own mild-shift validation set, else made here
        mild = mild if mild is not None else shifted(data.val.inputs, 0)
        rows.append(row("mild-shift validation", cal, views(mild), None))
    x, y = image_pool(manifest) if modality == "image" else text_pool(manifest)
    idx = np.random.default_rng(0).permutation(len(y))[:inputs]
    picked = x[idx] if modality == "image" else [x[i] for i in idx]
    streams: list[tuple[str, Any]] = [("clean", picked)]
    for kind in corruptions(modality):
        for sev in SEVERITIES:
            streams.append((f"{kind} @{sev}", corrupt(picked, kind, sev, seed=STREAM_SEED, modality=modality)))
    for name, xs in streams:
        scores, pred = views(xs, predictions=True)
        rows.append(row(name, cal, scores, float((pred == y[idx]).mean())))
        print(f"{name}: {rows[-1]}", flush=True)
    return {
        "command": f"python -m benchmarks.shift_views --artifact {harness.relative_to_root(root)}",
        "machine": harness.machine(),
        "artifact": m.name,
        "views": views.names,
        "inputs": inputs,
        "rows": rows,
    }


def markdown(doc: dict[str, Any]) -> str:
    names = doc["views"]
    head = "| stream | accuracy % | " + " | ".join(f"{n}: flagged %" for n in names)
    head += " | alarm, served | alarm, every view | alarm, previous bet | Lorden delay (est.) |"
    lines = [
        f"# What each view of an input sees of shift: {doc['artifact']}",
        "",
        f"`{doc['command']}`",
        "",
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs. {doc['inputs']} inputs per stream (the "
        "stream benchmark's pool, draw and corruption seed). Flagged: above the calibration split's 95th percentile "
        "of that view. Alarm: the first input at which the drift alarm fires from a fresh start (`-`: not within "
        "the stream); every view: one detector per view, bets at delta / J, on at the mean of the statistics "
        "reaching A (the same false-alarm bound); previous bet: the alarm before its mixture of bets (one bet at "
        "levels 0.05, 0.1, 0.2, stake 0.25) on the served score. Lorden delay: log A / KL of the served "
        "score's p-values against uniform, the least mean delay any detector with this false-alarm rate can have "
        "(estimated from the stream's binned p-values).",
        "",
        head,
        "|---|---:|" + "---:|" * (len(names) + 4),
    ]
    for r in doc["rows"]:
        acc = "–" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}"
        flags = " | ".join(f"{100 * f:.1f}" for f in r["flagged"])
        cells = [r[k] for k in ("alarm_served", "alarm_every_view", "alarm_previous_bet", "lorden_delay")]
        alarms = " | ".join("–" if v is None else str(v) for v in cells)
        lines.append(f"| {r['stream']} | {acc} | {flags} | {alarms} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--inputs", type=int, default=640, help="inputs per stream (default 640)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON result (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    doc = run(args.artifact.resolve(), args.inputs)
    path = harness.write_result(doc, args.out, f"shift_views/{doc['artifact']}.json")
    path.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
