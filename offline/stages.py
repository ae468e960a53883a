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
  (:mod:`service.core.preprocess`, built from the manifest's ``preprocessing``): what the temperature,
  the OOD threshold, the report and the export parity checks see is exactly what the server
  computes for the same input.

Each stage logs what it did and how long it took (:class:`Timer`); those timings go into the manifest.
"""

from __future__ import annotations

import dataclasses
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

from service.core.artifact import Manifest, write_manifest
from service.core.ood import OODStats
from service.core.preprocess import ImagePreprocessor, TextPreprocessor
from service.core.uncertainty import ood_flag, summarize
from service.core.uncertainty import ood_score as ood_score_of

from . import data as data_mod
from . import train as train_mod
from .calibration import calibrate_threshold, fit_temperature
from .compute import Compute, on_device, resolve_device, resolve_precision
from .config import BuildConfig, ConfigError
from .families import FamilyAdapter
from .members import Budget, pool_size, sample_members
from .metrics import evaluate_predictions
from .ood_fit import (
    LAYERS,
    Run,
    base_score,
    candidate_scores,
    detection,
    fit_layer_stats,
    fit_ood_stats,
    flag_rate,
    layer_candidates,
    layer_columns,
    restrict_layers,
    scores_np,
    select_score,
    with_layers,
)
from .progress import bar as progress_bar
from .report import measure_latency, write_report
from .scoring import circuit_ranking, random_ranking, taylor_prune

__all__ = [
    "EVAL_BATCH",
    "EVAL_MAX_PIXELS",
    "FASHION_MEAN",
    "FASHION_STD",
    "Batch",
    "Calibration",
    "EvalSets",
    "Method",
    "Outputs",
    "Run",
    "ScoringBatches",
    "Timer",
    "Batches",
    "batches_of",
    "budget_of",
    "build_members",
    "calibrate",
    "calibrate_ood",
    "forced_score",
    "served_flag",
    "circuit_batches",
    "collect",
    "collect_logits",
    "compute_of",
    "joined",
    "train_compute",
    "head_module",
    "concat",
    "eval_batches",
    "evaluate",
    "finetune_members",
    "finetune_one",
    "member_checkpoints",
    "length_sorted_batches",
    "load_data",
    "n_params",
    "prepare_out",
    "provenance",
    "sample_indices",
    "seeds_of",
    "standard_methods",
    "take",
    "taylor_members",
    "with_features",
    "write_artifact",
]

log = logging.getLogger("hydra.build")

EVAL_BATCH = 128
EVAL_MAX_PIXELS = train_mod.IMAGE_FILE_LIMIT  # the builder's own images: one limit for training and evaluation
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
    common = dict(max_train=d.max_train, max_val=d.max_val, max_test=d.max_test, max_ood=d.max_ood, seed=d.seed,
                  max_fit=d.max_fit, max_calibration=d.max_calibration)
    if d.setting == "fashion-mnist":
        data = data_mod.fashion_mnist_setting(**common)
    elif d.setting == "tweets":
        data = data_mod.tweet_setting(**common)
    else:
        data = data_mod.user_setting(data_mod.UserData(d.setting, d.path, d.ood_paths, d.ood_val_path), **common)
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
    return train_mod.make_batches(inputs, labels, batch_size, kind=prep["type"], tokenizer=tok,
                                  max_length=prep.get("max_length"), **train_mod.image_kw(prep))  # fmt: skip


def length_sorted_batches(
    inputs: Any, labels: Any, prep: dict[str, Any], tok: Any, batch_size: int = EVAL_BATCH
) -> tuple[Batches, np.ndarray]:
    """``(batches, order)``: texts sorted by token count (stable) so each batch pads only to its own longest.

    ``order`` maps batch position to input index (labels are reordered with it). Images: in order.
    """
    if len(labels) == 0:  # e.g. no OOD validation data
        return [], np.arange(0)
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

    def to(self, device: torch.device) -> ScoringBatches:
        """Every tensor on ``device`` (scoring on a GPU reads them many times: copied once)."""
        on = lambda b: {k: v.to(device) for k, v in b.items()}
        return ScoringBatches([(on(b), y.to(device)) for b, y in self.calib], [on(b) for b in self.val_id],
                              self.val_y.to(device), [on(b) for b in self.val_ood])  # fmt: skip


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
    if len(labels) == 0:
        return [], np.arange(0)
    if isinstance(pre, TextPreprocessor):
        items: list[Any] = pre.encode(list(inputs))
        order = np.argsort([len(ids) for ids in items], kind="stable") if sort else np.arange(len(items))
        items = [items[i] for i in order]
    else:
        items = [pre(Path(x).read_bytes(), where=str(x)) if isinstance(x, (str, Path))  # a user's image file
                 else pre.to_tensor(Image.fromarray(np.asarray(x))) for x in inputs]  # fmt: skip
        order = np.arange(len(items))
    y = torch.as_tensor(labels[order], dtype=torch.int64)
    return [
        ({**pre.collate(items[i : i + batch_size]), **(extra or {})}, y[i : i + batch_size])
        for i in range(0, len(items), batch_size)
    ], order


@torch.inference_mode()
def collect(fn: Callable[[Batch], Any], batches: Batches) -> Run:
    """Concatenated outputs of ``fn`` over batches (:data:`offline.ood_fit.Run`): logits, and the features and layer
    features when ``fn`` returns them (``(logits, features[, layers])``); a single model's ``(N, C)`` / ``(N, D)`` /
    ``(N, L-1, d)`` become ``(N, 1, C)`` / ``(N, 1, D)`` / ``(N, 1, L-1, d)``."""
    parts: list[list[torch.Tensor]] = [[], [], []]
    for batch, _ in batches:
        y = fn(batch)
        outs = tuple(y) if isinstance(y, tuple) else (y,)
        single = outs[0].dim() == 2
        for i, t in enumerate(outs[:3]):
            parts[i].append(t.float().unsqueeze(1) if single else t.float())
    cat = [torch.cat(p) if p else None for p in parts]
    return cat[0], cat[1], cat[2]  # type: ignore[return-value]


def collect_logits(fn: Callable[[Batch], Any], batches: Batches) -> torch.Tensor:
    """The logits of :func:`collect`."""
    return collect(fn, batches)[0]


def head_module(model: nn.Module) -> nn.Module:
    """The classifier head of a timm ViT (``head``) or a Hugging Face sequence classifier (``classifier``)."""
    for name in ("head", "classifier"):
        m = getattr(model, name, None)
        if isinstance(m, nn.Linear):
            return m
    raise ValueError(f"{type(model).__name__} has no linear head named 'head' or 'classifier'")


def with_features(
    fn: Callable[[Batch], torch.Tensor], model: nn.Module, layers: Sequence[nn.Module] = ()
) -> Callable[[Batch], tuple]:
    """``fn`` that also returns ``model``'s penultimate feature: the input of its classifier head ``(B, D)``; with
    ``layers`` (the model's blocks, :meth:`offline.families.FamilyAdapter.layer_modules`) also the outputs of every
    block but the last pooled over the tokens ``(B, L-1, d)``, as the fused model's layer features: the mean over
    all tokens, or over the real ones (``attention_mask``) for text."""
    head = head_module(model)

    def run(batch: Batch) -> tuple[torch.Tensor, ...]:
        seen: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        hooks = [head.register_forward_hook(lambda mod, args, out: seen.append(args[0]))]
        hooks += [m.register_forward_hook(lambda mod, args, out: states.append(out[0] if isinstance(out, tuple)
                                                                                 else out)) for m in layers[:-1]]
        try:
            logits = fn(batch)
        finally:
            for h in hooks:
                h.remove()
        if not states:
            return logits, seen[-1]
        mask = batch.get("attention_mask")
        if mask is None:
            pooled = [h.float().mean(dim=1) for h in states]  # (B, d) each
        else:
            w = mask.float() / mask.float().sum(dim=1, keepdim=True).clamp_min(1.0)  # (B, T)
            pooled = [(h.float() * w.unsqueeze(-1)).sum(dim=1) for h in states]
        return logits, seen[-1], torch.stack(pooled, dim=1)  # (B, L-1, d)

    return run


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
    """The M pruned members of ``cfg.hydra.strategy`` and the manifest's ``strategy`` record; head scoring runs on
    the build device under its autocast (``build.device``, ``build.precision``), the members come back on the CPU."""
    compute = compute_of(cfg)
    if not compute.cuda and compute.precision == "fp32":
        return _build_members(cfg, adapter, base, scoring, timer)
    with on_device(compute, base), compute.autocast():
        members, info = _build_members(cfg, adapter, base, scoring.to(compute.device), timer)
    return [m.to("cpu").float() for m in members], info


def _build_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, scoring: ScoringBatches, timer: Timer
) -> tuple[list[nn.Module], dict[str, Any]]:
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


MEMBER_SEED_STRIDE = 1009  # member i's fine-tuning seed: data.seed + stride * (i + 1) when members differ in data


def member_train_config(cfg: BuildConfig, i: int) -> train_mod.TrainConfig:
    """Member ``i``'s fine-tuning recipe: the preset's, with the ``hydra`` levers (steps, what trains, batch order,
    label smoothing, learning rate, flips) applied."""
    h = cfg.hydra
    preset = train_mod.PRESETS[h.finetune_preset or cfg.base.preset]["finetune"]
    own = h.member_data != "same"
    over = {"steps": h.finetune_steps, "unfreeze": h.unfreeze,
            "seed": cfg.data.seed + (MEMBER_SEED_STRIDE * (i + 1) if own else 0)}  # fmt: skip
    for key, value in (("label_smoothing", h.label_smoothing), ("lr", h.lr), ("hflip", h.augment)):
        if value is not None:
            over[key] = value
    return train_mod.TrainConfig(**{**preset, **over, **train_compute(cfg)})


def train_compute(cfg: BuildConfig) -> dict[str, Any]:
    """The ``build`` section as training settings (device, autocast precision, DataLoader workers), and
    ``data.augment`` as the image augmentation (when set; else the preset's)."""
    b, aug = cfg.build, cfg.data.augment
    # the precision as resolved on this machine: fp32 on a CPU is what training always was (older checkpoints match)
    precision = resolve_precision(b.precision, resolve_device(b.device))
    out: dict[str, Any] = {"device": b.device, "precision": precision, "workers": b.workers}
    if aug is not None:
        out.update(hflip="flip" in aug, crop_scale=cfg.data.crop_scale if "crop" in aug else 1.0)
    return out


def compute_of(cfg: BuildConfig, evaluation: bool = False) -> Compute:
    """The build's device with the autocast of training and scoring, or (``evaluation``) of calibration and
    evaluation (:mod:`offline.compute`)."""
    return Compute.of(cfg.build.device, cfg.build.eval_precision if evaluation else cfg.build.precision)


def member_data(data: Any, cfg: BuildConfig, seed: int) -> Any:
    """What a member fine-tunes on: the training split, or (``hydra.member_data: bootstrap``) a bootstrap resample
    of it drawn with ``seed`` (same size, with replacement)."""
    if cfg.hydra.member_data != "bootstrap":
        return data
    idx = np.sort(np.random.default_rng([seed, 11]).integers(0, len(data.train.labels), len(data.train.labels)))
    return dataclasses.replace(data, train=data_mod.Split(take(data.train.inputs, idx), data.train.labels[idx]))


def reinit_head(model: nn.Module, seed: int) -> None:
    """Re-initialise the classifier head (truncated normal, std 0.02; zero bias), seeded: members start apart."""
    head = head_module(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g).clamp_(-2, 2) * 0.02)
        if head.bias is not None:
            head.bias.zero_()


def finetune_members(
    cfg: BuildConfig, adapter: FamilyAdapter, members: list[nn.Module], data: Any, prep: dict[str, Any], tok: Any,
    out: Path, timer: Timer,
) -> list[nn.Module]:  # fmt: skip
    """Each member fine-tuned for ``hydra.finetune_steps`` (resumable under ``out/.checkpoints/member<i>``) with its
    own recipe (:func:`member_train_config`, :func:`member_data`, :func:`reinit_head`)."""
    if cfg.hydra.finetune_steps <= 0:
        return members
    tuned = [finetune_one(cfg, adapter, m, i, data, prep, tok, out) for i, m in enumerate(members)]
    timer.lap("member fine-tuning")
    return tuned


def member_checkpoints(out: Path, i: int) -> Path:
    """Where member ``i``'s fine-tuning checkpoints live (shared by the stages of a build)."""
    return out / ".checkpoints" / f"member{i}"


def finetune_one(
    cfg: BuildConfig, adapter: FamilyAdapter, member: nn.Module, i: int, data: Any, prep: dict[str, Any], tok: Any,
    out: Path,
) -> nn.Module:  # fmt: skip
    """Member ``i`` fine-tuned with its own recipe, resumable (a finished run reloads at once from its last
    checkpoint, which is how ``--stage finish`` collects members fine-tuned by other processes)."""
    tcfg = member_train_config(cfg, i)
    if cfg.hydra.reinit_head:
        reinit_head(member, tcfg.seed + i)
    key = {"member_data": cfg.hydra.member_data, "reinit_head": cfg.hydra.reinit_head}
    return train_mod.finetune_member(
        adapter, member, member_data(data, cfg, tcfg.seed), prep, tok, tcfg,
        resume=train_mod.Resume(member_checkpoints(out, i), key), desc=f"member {i}",
    ).eval()  # fmt: skip


# ----------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """The served ensemble's temperature and OOD score and threshold, fitted on validation data only."""

    temperature: float
    metric: str  # the served OOD score
    threshold: float
    tpr: float  # share of ID validation inputs the threshold lets through
    ood_val_flagged: float  # mean share of the OOD validation sets it flags
    stats: OODStats | None = None  # the statistics of the logit and feature scores (classifiers)
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)  # every score's validation figures
    forced: bool = False  # the config named the score
    selected: str = ""  # the candidate served (metric, or mahalanobis_layers@<ids>: the layer set)
    layer_ids: tuple[int, ...] | None = None  # the layer set of mahalanobis_layers: served, else the best candidate's

    def uncertainty(self) -> dict[str, Any]:
        """The manifest's ``uncertainty`` block."""
        return {"temperature": self.temperature, "ood_score": self.metric, "ood_threshold": self.threshold,
                "tpr": self.tpr}  # fmt: skip


def forced_score(cfg: BuildConfig) -> str | None:
    """``calibration.ood_score`` when it names a score; None for ``auto`` (selected on the OOD validation sets)."""
    return None if cfg.calibration.ood_score == "auto" else cfg.calibration.ood_score


def calibrate(
    cfg: BuildConfig, fused_fn: Callable[[Batch], torch.Tensor], val: Batches, ood_val: Batches
) -> Calibration:
    """Probability scores only (zero-shot): temperature of the fused ensemble on ID validation data, then the OOD
    threshold at ``calibration.tpr`` (``auto``: MSP)."""
    val_logits = collect_logits(fused_fn, val)
    val_y = torch.cat([y for _, y in val])
    T = fit_temperature(val_logits, val_y) if cfg.calibration.temperature else 1.0
    metric = forced_score(cfg) or "msp"  # a probability score: offline.config refuses the others for zero-shot
    id_scores = ood_score_of(summarize(val_logits, T), metric).numpy()
    threshold = calibrate_threshold(id_scores, metric, tpr=cfg.calibration.tpr)
    flagged = 0.0
    if ood_val:  # a user's data may have no OOD inputs
        ood_scores = ood_score_of(summarize(collect_logits(fused_fn, ood_val), T), metric).numpy()
        flagged = flag_rate(ood_scores, metric, threshold)
    return Calibration(T, metric, threshold, cfg.calibration.tpr, flagged, forced=forced_score(cfg) is not None)


def calibrate_ood(
    cfg: BuildConfig, hydra: Run, fit: Run, y_fit: torch.Tensor, y_val: torch.Tensor, ood_val: dict[str, Run],
    classes: int,
) -> Calibration:  # fmt: skip
    """The served score of a classifier: temperature on ID validation, the OOD statistics (Gaussians on the fit
    split's features, norms on validation), every score's threshold at ``calibration.tpr`` and recall on each OOD
    validation set; the best mean recall is served unless the config names a score (``hydra``: the fused model's
    validation outputs; ``fit``: on the fit split). With layer features every layer set of
    :func:`offline.ood_fit.layer_candidates` is a ``mahalanobis_layers`` candidate of its own."""
    val_l, val_f, val_layers = hydra
    T = fit_temperature(val_l, y_val) if cfg.calibration.temperature else 1.0
    stats = fit_ood_stats(fit[1], y_fit, classes, val_l, val_f, T) if fit[1] is not None else None
    id_val = scores_np((val_l, val_f, None), stats, T)
    ood = {name: scores_np((run[0], run[1], None), stats, T) for name, run in ood_val.items()}
    full = None
    if stats is not None and val_layers is not None and fit[2] is not None and val_layers.shape[2] > 0:
        full = fit_layer_stats(fit[2], y_fit, classes, val_layers, torch.from_numpy(id_val["mahalanobis"]))
        columns = {"": layer_columns(hydra, stats, full, T),
                   **{name: layer_columns(run, stats, full, T) for name, run in ood_val.items()}}  # fmt: skip
        for ids in layer_candidates(val_layers.shape[2]):
            name = layer_candidate_name(ids)
            id_val[name] = candidate_scores(columns[""], full, ids)
            for set_name in ood:
                ood[set_name][name] = candidate_scores(columns[set_name], full, ids)
    selected, candidates = select_score(id_val, ood, cfg.calibration.tpr, forced_score(cfg))
    c = candidates[selected]
    metric = base_score(selected)
    layer_ids = best_layers(candidates, selected)
    if metric == LAYERS and full is not None and stats is not None:
        stats = with_layers(stats, restrict_layers(full, layer_ids))  # type: ignore[arg-type]
    return Calibration(T, metric, c["threshold"], cfg.calibration.tpr, c["val_mean_recall"] or 0.0, stats,
                       candidates, forced_score(cfg) is not None, selected, layer_ids)  # fmt: skip


def layer_candidate_name(ids: Sequence[int]) -> str:
    """``mahalanobis_layers@0,2``: the multi-layer score reading layers 0 and 2."""
    return f"{LAYERS}@{','.join(str(i) for i in ids)}"


def best_layers(candidates: dict[str, dict[str, Any]], selected: str) -> tuple[int, ...] | None:
    """The layer set of the served candidate when it is ``mahalanobis_layers``, else the best layer candidate's on
    validation (the report shows what the layers would give); None without layer candidates."""
    if base_score(selected) == LAYERS:
        return tuple(int(i) for i in selected.split("@", 1)[1].split(","))
    names = [n for n in candidates if base_score(n) == LAYERS]
    if not names:
        return None
    best = max(names, key=lambda n: (candidates[n]["val_mean_recall"] or 0.0, -names.index(n)))
    return tuple(int(i) for i in best.split("@", 1)[1].split(","))


def ood_flag_np(scores: np.ndarray, metric: str, threshold: float) -> np.ndarray:
    """The served flag ``(N,)`` bool of scores ``(N,)`` (:func:`service.core.uncertainty.ood_flag`)."""
    return ood_flag(torch.from_numpy(np.asarray(scores, dtype=np.float64)), metric, threshold).numpy()


def served_flag(hydra: Method, cal: Calibration) -> tuple[dict[str, Any], dict[str, Any]]:
    """The served flag on test data, as fixed on validation: ``(report record, plot data)`` with the ID test flag
    rate (false alarms) and the recall on each OOD test set."""
    score = {name: scores_np(run, cal.stats, cal.temperature)[cal.metric] for name, run in hydra.runs.items()
             if name == "test" or name.startswith("ood:") or name.startswith("foreign")}  # fmt: skip
    ood = {k[4:]: v for k, v in score.items() if k.startswith("ood:")}
    record = {"score": cal.metric, "threshold": cal.threshold,
              "id_test_flag_rate": flag_rate(score["test"], cal.metric, cal.threshold),
              "recall": {k: flag_rate(v, cal.metric, cal.threshold) for k, v in ood.items()}}  # fmt: skip
    if "foreign" in score:  # per input, in the set's order (the caller groups them by kind)
        record["foreign"] = ood_flag_np(score["foreign"], cal.metric, cal.threshold).tolist()
    return record, {"score": cal.metric, "threshold": cal.threshold, "id": score["test"], "ood": ood}


# ----------------------------------------------------------------------------- evaluation
def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@dataclass
class EvalSets:
    """The evaluation batches every method runs on: ID test and each OOD test set; for the classifiers also ID
    validation (each method's own temperature, the OOD statistics' norms) and the fit split (their Gaussians)."""

    test: Batches
    ood_test: dict[str, Batches]
    val: Batches | None = None
    fit: Batches | None = None
    foreign: Batches | None = None  # the foreign-image test set (offline.foreign), images only: the served flag's
    calibration: Batches | None = None  # the calibration split: the guarantees' (offline.guarantees)

    def named(self) -> dict[str, Batches]:
        out = {"test": self.test, **{f"ood:{k}": v for k, v in self.ood_test.items()}}
        out |= {"val": self.val} if self.val is not None else {}
        out |= {"fit": self.fit} if self.fit else {}
        out |= {"calibration": self.calibration} if self.calibration else {}
        return out | ({"foreign": self.foreign} if self.foreign else {})

    def labels(self, name: str) -> torch.Tensor:
        return torch.cat([y for _, y in self.named()[name]])


@dataclass
class Method:
    """One row of the report: how to run it on a batch, its size, the temperature its main row is scored at, and its
    outputs on every evaluation set (``runs``: set name -> logits and, when it has them, features)."""

    fn: Callable[[Batch], Any]  # batch -> logits (B, C) or (B, M, C), or (logits, features); a list for an ensemble
    params: int
    temperature: float = 1.0
    runs: dict[str, Run] = field(default_factory=dict, repr=False)

    @property
    def outputs(self) -> Outputs:
        """Logits on ID test and on each OOD test set."""
        ood = {k[4:]: v[0] for k, v in self.runs.items() if k.startswith("ood:")}
        return self.runs["test"][0], ood


def standard_methods(
    single: Callable[[Batch], Any], base: nn.Module, member_fns: list[Callable], members: list[nn.Module],
    fused_fn: Callable[[Batch], Any], fused: nn.Module, temperature: float, sets: EvalSets,
    others: Sequence[tuple[Callable[[Batch], Any], nn.Module]] = (),
) -> dict[str, Method]:  # fmt: skip
    """The rows every build reports, with their runs on every set of ``sets``: the base model, each member, fused
    Hydra (at ``temperature``) and the unfused ensemble of the same members (their outputs concatenated); with
    ``others`` (more base models, trained like the first), the Deep Ensemble of the base and them."""
    methods = {"single": Method(single, n_params(base))}
    for i, (f, m) in enumerate(zip(member_fns, members, strict=True)):
        methods[f"member_{i}"] = Method(f, n_params(m))
    methods["hydra"] = Method(fused_fn, n_params(fused), temperature)
    extra = [Method(f, n_params(m)) for f, m in others]
    named = sets.named()
    with progress_bar(desc="evaluation (methods x sets)", total=(len(methods) + len(extra)) * len(named)) as bar:
        for m in [*methods.values(), *extra]:
            m.runs = {}
            for name, batches in named.items():
                m.runs[name] = collect(m.fn, batches)
                bar.update(1)
    methods["ensemble_unfused"] = Method(lambda b: [f(b) for f in member_fns], sum(n_params(m) for m in members),
                                         runs=joined([methods[f"member_{i}"].runs for i in range(len(members))]))
    if extra:
        methods["deep_ensemble"] = Method(lambda b: [single(b)] + [m.fn(b) for m in extra],
                                          n_params(base) + sum(m.params for m in extra),
                                          runs=joined([methods["single"].runs] + [m.runs for m in extra]))
    return methods  # fmt: skip


def joined(runs: list[dict[str, Run]]) -> dict[str, Run]:
    """Several models' runs as one ensemble's: logits ``(N, M, C)``, features ``(N, M, D)`` and layer features
    ``(N, M, L-1, d)`` concatenated along the member axis, set by set."""
    def cat(name: str, i: int) -> torch.Tensor | None:
        return torch.cat([r[name][i] for r in runs], dim=1) if runs[0][name][i] is not None else None

    return {name: (torch.cat([r[name][0] for r in runs], dim=1), cat(name, 1), cat(name, 2)) for name in runs[0]}


def calibrated_metrics(m: Method, y_val: torch.Tensor, y_test: np.ndarray) -> dict[str, float]:
    """The method at its own temperature fitted on ID validation: ``temperature`` and the ID metrics there."""
    T = fit_temperature(m.runs["val"][0], y_val)
    probs = torch.softmax(m.runs["test"][0] / T, -1).numpy()
    return {"temperature": T, **{k: v for k, v in evaluate_predictions(probs, y_test, {}).items()
                                 if k in ("acc", "nll", "brier", "ece", "aece")}}  # fmt: skip


def method_stats(
    m: Method, y_fit: torch.Tensor, y_val: torch.Tensor, classes: int, layer_ids: tuple[int, ...] | None = None
) -> tuple[float, OODStats | None]:
    """The method's own temperature (fitted on ID validation) and OOD statistics (Gaussians on the fit split, norms
    on validation; ``layer_ids``: the layer set of ``mahalanobis_layers``, Hydra's): the same treatment as Hydra's."""
    (val_l, val_f, val_layers), (_, fit_f, fit_layers) = m.runs["val"], m.runs["fit"]
    T = fit_temperature(val_l, y_val)
    stats = fit_ood_stats(fit_f, y_fit, classes, val_l, val_f, T) if fit_f is not None else None
    if stats is not None and layer_ids and fit_layers is not None and val_layers is not None:
        val_md = torch.from_numpy(scores_np((val_l, val_f, None), stats, T)["mahalanobis"])
        stats = with_layers(stats, fit_layer_stats(fit_layers, y_fit, classes, val_layers, val_md, layer_ids))
    return T, stats


def ood_detection(
    m: Method, y_fit: torch.Tensor, y_val: torch.Tensor, classes: int, layer_ids: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """Every OOD score of the method (:func:`method_stats`) and its detection quality per OOD test set: Single and
    the members with the same scores as Hydra."""
    T, stats = method_stats(m, y_fit, y_val, classes, layer_ids)
    id_scores = scores_np(m.runs["test"], stats, T)
    ood = {k[4:]: scores_np(v, stats, T) for k, v in m.runs.items() if k.startswith("ood:")}
    return detection(id_scores, ood)


def evaluate(
    methods: dict[str, Method], sets: EvalSets, y_test: np.ndarray, ood_kinds: dict[str, str], metric: str,
    latency: tuple[Batch, Batch], classes: int | None = None, layer_ids: tuple[int, ...] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Report rows and the plots' data. Each row: the metrics at the method's temperature (scored with the probability
    score ``metric``), size, latency on the ``latency`` batches of 1 and 8 inputs; with validation outputs also the
    method at its own fitted temperature (``calibrated``), and with fit outputs every OOD score's detection
    (``ood_scores``)."""
    one, eight = latency
    rows = []
    plots: dict[str, Any] = {"labels": y_test, "ood_kinds": ood_kinds}
    for name, m in methods.items():
        logits, ood_logits = m.outputs
        probs = torch.softmax(logits / m.temperature, -1).numpy()
        ood_probs = {n: torch.softmax(v / m.temperature, -1).numpy() for n, v in ood_logits.items()}
        row = {"method": name, **evaluate_predictions(probs, y_test, ood_probs, ood_score=metric)}
        row["temperature"] = m.temperature
        if sets.val is not None:
            row["calibrated"] = calibrated_metrics(m, sets.labels("val"), y_test)
        if sets.fit is not None and sets.val is not None and classes is not None:
            row["ood_scores"] = ood_detection(m, sets.labels("fit"), sets.labels("val"), classes, layer_ids)
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
