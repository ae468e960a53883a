"""The build's stages, shared by both pipelines and the quality benchmark.

A build is a short composition of these (``offline.pipeline`` for classifiers,
``offline.pipeline_clip`` for zero-shot models)::

    load_data -> base model (per family) -> scoring batches -> build_members -> finetune_members
      -> fuse -> calibrate -> evaluate -> exports -> write_artifact

Two kinds of batches exist on purpose:

* *scoring and training* batches (:func:`batches_of`, :func:`circuit_batches`) are made from the
  in-memory arrays with the training code's transforms; they feed Taylor gradients, circuit
  extraction and fine-tuning, where augmentation may differ from serving.
* *evaluation* batches (:func:`eval_batches`) go through the server's own preprocessing
  (:mod:`service.preprocess`, built from the manifest's ``preprocessing``): what the temperature,
  the OOD threshold, the report and the export parity checks see is exactly what the server
  computes for the same input.

Each stage logs what it did and how long it took (:class:`Timer`); those timings go into the manifest.
"""

from __future__ import annotations

import logging
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from service.artifact import Manifest, write_manifest
from service.preprocess import ImagePreprocessor, TextPreprocessor
from service.uncertainty import ood_score as ood_score_of
from service.uncertainty import summarize

from . import data as data_mod
from . import train as train_mod
from .calibration import calibrate_threshold, fit_temperature
from .config import BuildConfig, ConfigError
from .families import FamilyAdapter
from .members import Budget, pool_size, sample_members
from .metrics import evaluate_predictions
from .report import measure_latency, write_report
from .scoring import circuit_ranking, random_ranking, taylor_prune

__all__ = [
    "EVAL_BATCH",
    "EVAL_MAX_PIXELS",
    "FASHION_MEAN",
    "FASHION_STD",
    "Batch",
    "Calibration",
    "Method",
    "Outputs",
    "ScoringBatches",
    "Timer",
    "Batches",
    "batches_of",
    "budget_of",
    "build_members",
    "calibrate",
    "circuit_batches",
    "collect_logits",
    "concat",
    "eval_batches",
    "evaluate",
    "finetune_members",
    "flag",
    "length_sorted_batches",
    "load_data",
    "n_params",
    "outputs_of",
    "prepare_out",
    "provenance",
    "sample_indices",
    "seeds_of",
    "standard_methods",
    "take",
    "taylor_members",
    "write_artifact",
]

log = logging.getLogger("hydra.build")

EVAL_BATCH = 128
EVAL_MAX_PIXELS = 1 << 26  # the evaluation-time preprocessor's image limit (the builder's own arrays)
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # Fashion-MNIST pixel statistics (the demo settings' normalisation)
Batch = dict[str, torch.Tensor]
Batches = list[tuple[Batch, torch.Tensor]]  # [(named inputs, int64 labels (B,))]
Outputs = tuple[torch.Tensor, dict[str, torch.Tensor]]  # member logits (N, M, C) on ID test, per OOD test set


class Timer:
    """Wall time per stage: ``lap(name)`` logs and records the time since the last lap."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self._t, 2)
        log.info("%s done in %.1f s", name, now - self._t)
        self._t = now


# ----------------------------------------------------------------------------- data
def load_data(cfg: BuildConfig) -> Any:
    """The ID splits and OOD sets of ``cfg.data`` (:class:`offline.data.Data`); ``data.labels`` checked."""
    d = cfg.data
    common = dict(max_train=d.max_train, max_val=d.max_val, max_test=d.max_test, max_ood=d.max_ood, seed=d.seed)
    if d.setting == "fashion-mnist":
        data = data_mod.fashion_mnist_setting(**common)
    elif d.setting == "tweets":
        data = data_mod.tweet_setting(**common)
    else:
        data = data_mod.user_setting(d.setting, d.path, d.ood_paths, d.ood_val_path, **common)
    if d.labels is not None and list(d.labels) != list(data.class_names):
        raise ConfigError(f"data.labels {d.labels} do not match the data's classes {data.class_names}")
    return data


def take(inputs: Any, idx: Sequence[int] | np.ndarray) -> Any:
    """``inputs[idx]`` for arrays and lists of texts alike."""
    return [inputs[i] for i in idx] if isinstance(inputs, list) else inputs[idx]


def concat(parts: Sequence[Any]) -> Any:
    """Arrays (or lists of texts) joined in order."""
    if not parts:
        return []
    if isinstance(parts[0], list):
        return [x for p in parts for x in p]
    return np.concatenate(parts)


def sample_indices(n_total: int, n: int, seed: int) -> np.ndarray:
    """``min(n, n_total)`` distinct indices drawn with ``seed``, sorted (the Taylor calibration sample)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_total, size=min(n, n_total), replace=False))


# ----------------------------------------------------------------------------- scoring and training batches
def batches_of(inputs: Any, labels: Any, prep: dict[str, Any], tok: Any, batch_size: int = EVAL_BATCH) -> Batches:
    """Inputs in order as model batches, with the training code's transforms (scoring, fine-tuning)."""
    return train_mod.make_batches(
        inputs, labels, batch_size, kind=prep["type"], tokenizer=tok,
        max_length=prep.get("max_length"), mean=prep.get("mean"), std=prep.get("std"),
        size=prep.get("size"), channels=prep.get("channels"),
    )  # fmt: skip


def length_sorted_batches(
    inputs: Any, labels: Any, prep: dict[str, Any], tok: Any, batch_size: int = EVAL_BATCH
) -> tuple[Batches, np.ndarray]:
    """``(batches, order)``: texts sorted by token count (stable) so each batch pads only to its own longest.

    ``order`` maps batch position to input index (labels are reordered with it). Images: in order.
    """
    if prep["type"] != "text":
        return batches_of(inputs, labels, prep, tok, batch_size), np.arange(len(labels))
    lengths = [len(ids) for ids in tok(list(inputs), truncation=True, max_length=prep.get("max_length"))["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    return batches_of(take(inputs, order), np.asarray(labels)[order], prep, tok, batch_size), order


def circuit_batches(inputs: Any, labels: Any, prep: dict[str, Any], tok: Any) -> Batches:
    """Validation batches for circuit extraction, which runs them thousands of times.

    Images: batches of 256. Texts: sorted by token count and cut into batches of 32,
    so that each batch pads only to its own longest text (tweets are far shorter than
    ``max_length``); the labels travel with their texts.
    """
    return length_sorted_batches(inputs, labels, prep, tok, 32 if prep["type"] == "text" else 256)[0]


@dataclass
class ScoringBatches:
    """What head scoring needs: Taylor's gradient batches, circuit extraction's ID and OOD validation batches."""

    calib: Batches  # [(batch, labels)] from the training split, for Taylor gradients
    val_id: list[Batch]  # circuit extraction ID batches
    val_y: torch.Tensor  # (n,) their labels
    val_ood: list[Batch]  # circuit extraction OOD batches (OOD *validation* sets only)

    @classmethod
    def of(cls, calib: Batches, val: Batches, ood: Batches) -> ScoringBatches:
        return cls(calib, [b for b, _ in val], torch.cat([y for _, y in val]), [b for b, _ in ood])


# ----------------------------------------------------------------------------- evaluation batches
def eval_batches(
    pre: ImagePreprocessor | TextPreprocessor,
    inputs: Any,
    labels: Any,
    batch_size: int = EVAL_BATCH,
    extra: Batch | None = None,
    sort: bool = True,
) -> tuple[Batches, np.ndarray]:
    """``(batches, order)`` through the server's preprocessing ``pre``; ``extra`` inputs join every batch.

    Images (uint8 ``(N, H, W)`` or ``(N, H, W, 3)``) go through the server's conversion, resize and
    normalisation, in order. Texts are encoded with the artifact's tokenizer and, with ``sort``, sorted by
    token count (stable), so each batch pads only to its own longest (metrics are order-free; the labels
    travel along); ``order`` maps batch position to input index.
    """
    labels = np.asarray(labels)
    if isinstance(pre, TextPreprocessor):
        items: list[Any] = pre.encode(list(inputs))
        order = np.argsort([len(ids) for ids in items], kind="stable") if sort else np.arange(len(items))
        items = [items[i] for i in order]
    else:
        items = [pre.to_tensor(Image.fromarray(np.asarray(x))) for x in inputs]
        order = np.arange(len(items))
    y = torch.as_tensor(labels[order], dtype=torch.int64)
    return [
        ({**pre.collate(items[i : i + batch_size]), **(extra or {})}, y[i : i + batch_size])
        for i in range(0, len(items), batch_size)
    ], order


@torch.inference_mode()
def collect_logits(fn: Callable[[Batch], torch.Tensor], batches: Batches) -> torch.Tensor:
    """Concatenated outputs of ``fn`` over batches; ``(N, C)`` single models become ``(N, 1, C)``."""
    out = []
    for batch, _ in batches:
        y = fn(batch).float()
        out.append(y.unsqueeze(1) if y.dim() == 2 else y)
    return torch.cat(out)


# ----------------------------------------------------------------------------- members
def budget_of(cfg: BuildConfig) -> Budget:
    h = cfg.hydra
    return Budget(per_layer=h.prune_per_layer) if h.prune_per_layer is not None else Budget(total=h.prune_total)


def seeds_of(cfg: BuildConfig) -> list[int]:
    """One pruning seed per member: ``hydra.seeds``, else 0..M-1."""
    h = cfg.hydra
    return list(h.seeds) if h.seeds is not None else list(range(h.members))


def taylor_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, calib: Batches, counts: list[int]
) -> tuple[list[nn.Module], dict[str, Any]]:
    """One Taylor-pruned member per seed, pruning ``counts[l]`` heads of layer ``l`` from its candidate pool."""
    h = cfg.hydra
    heads = adapter.heads(base)
    pools = [pool_size(r, n, h.pool) for r, n in zip(counts, heads, strict=True)]
    members = []
    for s in seeds_of(cfg):
        res = taylor_prune(adapter, base, calib, counts, pool_per_layer=pools, seed=s if h.members > 1 else None,
                           progress=True)  # fmt: skip
        members.append(res.model)
    info = {"name": "taylor", "seeds": seeds_of(cfg), "budget": vars(budget_of(cfg)), "pool": h.pool,
            "pool_per_layer": pools}  # fmt: skip
    return members, info


def build_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, scoring: ScoringBatches, timer: Timer
) -> tuple[list[nn.Module], dict[str, Any]]:
    """The M pruned members of ``cfg.hydra.strategy`` and the manifest's ``strategy`` record."""
    h = cfg.hydra
    heads = adapter.heads(base)
    budget = budget_of(cfg)
    if h.strategy == "taylor":
        members, info = taylor_members(cfg, adapter, base, scoring.calib, budget.per_layer_counts(heads))
        timer.lap("taylor scoring and pruning")
        return members, info
    info: dict[str, Any] = {"name": h.strategy, "seeds": seeds_of(cfg), "budget": vars(budget), "pool": h.pool}
    if h.strategy == "random":
        ranking = random_ranking(heads, seed=cfg.data.seed)
    else:
        score = h.strategy.split("-", 1)[1]
        args = (adapter, base, scoring.val_id, scoring.val_y, scoring.val_ood)
        if budget.total is not None:
            res = circuit_ranking(*args, score=score, budget=pool_size(budget.total, sum(heads), h.pool))
        else:
            caps = [pool_size(budget.per_layer, n, h.pool) for n in heads]
            res = circuit_ranking(*args, score=score, budget=sum(caps), max_per_layer=caps)
        ranking = res.ranking
        info.update(circuit_scores=res.scores, circuit_base_score=res.base_score)
        timer.lap(f"circuit extraction ({score})")
    info["ranking"] = [list(x) for x in ranking]
    keeps = sample_members(ranking, heads, budget, seeds_of(cfg), pool=h.pool)
    return [adapter.prune_to(base, k) for k in keeps], info


def finetune_members(
    cfg: BuildConfig, adapter: FamilyAdapter, members: list[nn.Module], data: Any, prep: dict[str, Any], tok: Any,
    out: Path, timer: Timer,
) -> list[nn.Module]:  # fmt: skip
    """Each member fine-tuned for ``hydra.finetune_steps`` (resumable under ``out/.checkpoints/member<i>``)."""
    if cfg.hydra.finetune_steps <= 0:
        return members
    preset = train_mod.PRESETS[cfg.hydra.finetune_preset or cfg.base.preset]
    tuned = []
    for i, m in enumerate(members):
        tcfg = train_mod.TrainConfig(**{**preset["finetune"], "steps": cfg.hydra.finetune_steps,
                                        "unfreeze": cfg.hydra.unfreeze, "seed": cfg.data.seed})  # fmt: skip
        tuned.append(train_mod.finetune_member(
            adapter, m, data, prep, tok, tcfg, checkpoint_dir=out / ".checkpoints" / f"member{i}", desc=f"member {i}",
        ).eval())  # fmt: skip
    timer.lap("member fine-tuning")
    return tuned


# ----------------------------------------------------------------------------- calibration
def flag(scores: np.ndarray, metric: str, threshold: float) -> np.ndarray:
    """The OOD flag of ``scores``: below the threshold for MSP, above it for entropy and MI."""
    return scores < threshold if metric == "msp" else scores > threshold


@dataclass
class Calibration:
    """The served ensemble's temperature and OOD threshold, fitted on ID validation data only."""

    temperature: float
    metric: str  # the OOD score the threshold applies to
    threshold: float
    tpr: float  # share of ID validation inputs the threshold lets through
    ood_val_flagged: float  # share of the OOD validation inputs it flags

    def uncertainty(self) -> dict[str, Any]:
        """The manifest's ``uncertainty`` block."""
        return {"temperature": self.temperature, "ood_score": self.metric, "ood_threshold": self.threshold,
                "tpr": self.tpr}  # fmt: skip


def calibrate(
    cfg: BuildConfig, fused_fn: Callable[[Batch], torch.Tensor], val: Batches, ood_val: Batches
) -> Calibration:
    """Temperature of the fused ensemble on ID validation data, then the OOD threshold at ``calibration.tpr``."""
    val_logits = collect_logits(fused_fn, val)
    val_y = torch.cat([y for _, y in val])
    T = fit_temperature(val_logits, val_y) if cfg.calibration.temperature else 1.0
    metric = cfg.calibration.ood_score
    id_scores = ood_score_of(summarize(val_logits, T), metric).numpy()
    threshold = calibrate_threshold(id_scores, metric, tpr=cfg.calibration.tpr)
    ood_scores = ood_score_of(summarize(collect_logits(fused_fn, ood_val), T), metric).numpy()
    return Calibration(T, metric, threshold, cfg.calibration.tpr, float(np.mean(flag(ood_scores, metric, threshold))))


# ----------------------------------------------------------------------------- evaluation
def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@dataclass
class Method:
    """One row of the report: how to run it on a batch, its size and the temperature it is scored at."""

    fn: Callable[[Batch], Any]  # batch -> logits (B, C) or (B, M, C); a list of those for an unfused ensemble
    params: int
    temperature: float = 1.0
    outputs: Outputs | None = field(default=None, repr=False)  # filled by :func:`outputs_of`


def outputs_of(fn: Callable[[Batch], torch.Tensor], test: Batches, ood_test: dict[str, Batches]) -> Outputs:
    """Member logits of ``fn`` on the ID test batches and on every OOD test set."""
    return collect_logits(fn, test), {n: collect_logits(fn, b) for n, b in ood_test.items()}


def standard_methods(
    single: Callable[[Batch], torch.Tensor], base: nn.Module, member_fns: list[Callable], members: list[nn.Module],
    fused_fn: Callable[[Batch], torch.Tensor], fused: nn.Module, temperature: float, test: Batches,
    ood_test: dict[str, Batches],
) -> dict[str, Method]:  # fmt: skip
    """The rows every build reports: the base model, each member, fused Hydra (at its fitted temperature) and the
    unfused ensemble of the same members (their outputs concatenated), with outputs computed."""
    methods = {"single": Method(single, n_params(base))}
    for i, (f, m) in enumerate(zip(member_fns, members, strict=True)):
        methods[f"member_{i}"] = Method(f, n_params(m))
    methods["hydra"] = Method(fused_fn, n_params(fused), temperature)
    for m in methods.values():
        m.outputs = outputs_of(m.fn, test, ood_test)
    outs = [methods[f"member_{i}"].outputs for i in range(len(members))]
    joined = (torch.cat([o[0] for o in outs], dim=1), {n: torch.cat([o[1][n] for o in outs], dim=1) for n in ood_test})
    methods["ensemble_unfused"] = Method(lambda b: [f(b) for f in member_fns], sum(n_params(m) for m in members),
                                         outputs=joined)  # fmt: skip
    return methods


def evaluate(
    methods: dict[str, Method], y_test: np.ndarray, ood_kinds: dict[str, str], metric: str,
    latency: tuple[Batch, Batch],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Report rows (metrics at each method's temperature, size, latency on the ``latency`` batches of 1 and 8
    inputs) and the plots' data."""
    one, eight = latency
    rows = []
    plots: dict[str, Any] = {"labels": y_test, "ood_kinds": ood_kinds}
    for name, m in methods.items():
        assert m.outputs is not None, f"method {name} has no outputs"
        logits, ood_logits = m.outputs
        probs = torch.softmax(logits / m.temperature, -1).numpy()
        ood_probs = {n: torch.softmax(v / m.temperature, -1).numpy() for n, v in ood_logits.items()}
        row = {"method": name, **evaluate_predictions(probs, y_test, ood_probs, ood_score=metric)}
        row["temperature"] = m.temperature
        row["params"] = m.params
        row["latency_ms"] = {"batch1": measure_latency(lambda f=m.fn: f(one)),
                             "batch8": measure_latency(lambda f=m.fn: f(eight))}  # fmt: skip
        rows.append(row)
        plots[name] = {"member_probs_id": probs, "member_probs_ood": ood_probs}
    return rows, plots


# ----------------------------------------------------------------------------- the artifact
def prepare_out(out: Path) -> None:
    """Empty ``out`` for a new artifact, keeping ``.checkpoints`` (resumable training state) until the end."""
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.name != ".checkpoints":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def provenance(cfg: BuildConfig, timer: Timer) -> dict[str, Any]:
    """The manifest's ``build`` block: resolved config, stage timings, versions, machine, time."""
    return {"config": cfg.to_dict(), "timings_s": timer.times, "torch": torch.__version__,
            "machine": platform.platform(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip


def write_artifact(
    out: Path, manifest: Callable[[dict[str, Any]], Manifest], rows: list[dict[str, Any]], ood_kinds: dict[str, str],
    plots: dict[str, Any], title: str, extra: dict[str, Any],
) -> Path:  # fmt: skip
    """Write the report, then the manifest (``manifest(metrics_summary)``, listing every file), and drop the
    training checkpoints: the last step, so a failed build leaves no manifest behind."""
    summary = write_report(out, rows, ood_kinds, plots, title, extra)
    m = manifest(summary)
    ckpt = out / ".checkpoints"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    write_manifest(out, m)
    log.info("artifact written to %s", out)
    return out
