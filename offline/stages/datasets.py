"""The data stage: the build's data sets, the batches made of them, and a model's outputs over those batches.

Two kinds of batches exist on purpose:

* *scoring and training* batches (:func:`batches_of`, :func:`circuit_batches`) are made from the in-memory arrays
  with the training code's transforms; they feed Taylor gradients, circuit extraction and fine-tuning, where
  augmentation may differ from serving.
* *evaluation* batches (:func:`eval_batches`, :func:`eval_sets`, :func:`zero_shot_sets`) go through the server's
  own preprocessing (:mod:`service.core.preprocess`, built from the manifest's ``preprocessing``): what the
  temperature, the OOD threshold, the report and the export parity checks see is exactly what the server computes
  for the same input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from offline import data as data_mod
from offline import train as train_mod
from offline.config import BuildConfig, ConfigError
from offline.data import Data
from offline.data.foreign import foreign_images
from offline.method.corruptions import SHIFT_PREFIX, corrupt, corruptions
from offline.method.ood_fit import Run
from offline.stages.context import BuildContext
from offline.train import lit
from service.core.preprocess import ImagePreprocessor, TextPreprocessor, make_preprocessor

__all__ = [
    "EVAL_BATCH",
    "EVAL_MAX_PIXELS",
    "FASHION_MEAN",
    "FASHION_STD",
    "Batch",
    "Batches",
    "EvalSets",
    "ZeroShotSets",
    "batches_of",
    "circuit_batches",
    "collect",
    "collect_logits",
    "concat",
    "eval_batches",
    "eval_sets",
    "fashion_vit_prep",
    "head_module",
    "length_sorted_batches",
    "load_data",
    "prompt_batch",
    "sample_indices",
    "shift_sets",
    "take",
    "with_features",
    "zero_shot_sets",
]

EVAL_BATCH = 128
SHIFT_SEED = 0  # the corruptions' seed: every build corrupts the same inputs the same way
EVAL_MAX_PIXELS = train_mod.IMAGE_FILE_LIMIT  # the builder's own images: one limit for training and evaluation
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # Fashion-MNIST pixel statistics (the demo settings' normalisation)
Batch = dict[str, torch.Tensor]
Batches = list[tuple[Batch, torch.Tensor]]  # [(named inputs, int64 labels (B,))]


def fashion_vit_prep() -> dict[str, Any]:
    """The artifact's preprocessing of a ViT trained here on Fashion-MNIST: 28x28 grayscale, the pixel statistics."""
    return {
        "type": "image",
        "size": [28, 28],
        "mean": [FASHION_MEAN],
        "std": [FASHION_STD],
        "interpolation": "bilinear",
        "channels": 1,
        "resize": "direct",
    }


# ----------------------------------------------------------------------------- the data
def load_data(cfg: BuildConfig) -> Data:
    """The ID splits and OOD sets of ``cfg.data`` (:class:`offline.data.Data`, drawn by :func:`offline.data.load`);
    ``data.labels`` checked."""
    d = cfg.data
    data = data_mod.load(d)
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
        inputs,
        labels,
        batch_size,
        kind=prep["type"],
        tokenizer=tok,
        max_length=prep.get("max_length"),
        **train_mod.image_kw(prep),
    )


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
        items = [_image_item(pre, x) for x in inputs]
        order = np.arange(len(items))
    y = torch.as_tensor(labels[order], dtype=torch.int64)
    return [
        ({**pre.collate(items[i : i + batch_size]), **(extra or {})}, y[i : i + batch_size])
        for i in range(0, len(items), batch_size)
    ], order


def _image_item(pre: ImagePreprocessor, x: Any) -> torch.Tensor:
    """One image through the server's preprocessing: a user's image file as the server reads a request's bytes, an
    array as a decoded image."""
    if isinstance(x, (str, Path)):
        return pre(Path(x).read_bytes(), where=str(x))
    return pre.to_tensor(Image.fromarray(np.asarray(x)))


@dataclass
class EvalSets:
    """The evaluation batches every method runs on: ID test and each OOD test set; for the classifiers also ID
    validation (each method's own temperature, the OOD statistics' norms) and the fit split (their Gaussians)."""

    test: Batches
    ood_test: dict[str, Batches]
    val: Batches | None = None
    fit: Batches | None = None
    foreign: Batches | None = None  # the foreign-image test set (offline.data.foreign), images only: the served flag's
    calibration: Batches | None = None  # the calibration split: the guarantees' (offline.method.guarantee_fits)
    ood_val: dict[str, Batches] = field(default_factory=dict)  # the OOD validation sets: the served score's choice
    test_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # (N,) in batch order
    latency: Batch = field(default_factory=dict)  # the first 8 test inputs in their own order: the latency batch
    shift: dict[str, Batches] = field(default_factory=dict)  # corrupted copies of ID test inputs (shift_sets)

    def named(self) -> dict[str, Batches]:
        """The sets every method runs on, by name: ``test``, ``ood:<name>``, ``val``, ``fit``, ``calibration``,
        ``foreign``, ``shift:<corruption>@<severity>`` (those the build has)."""
        out = {"test": self.test, **{f"ood:{k}": v for k, v in self.ood_test.items()}}
        out |= {"val": self.val} if self.val is not None else {}
        out |= {"fit": self.fit} if self.fit else {}
        out |= {"calibration": self.calibration} if self.calibration else {}
        out |= {"foreign": self.foreign} if self.foreign else {}
        return out | {SHIFT_PREFIX + k: v for k, v in self.shift.items()}

    def labels(self, name: str) -> torch.Tensor:
        return torch.cat([y for _, y in self.named()[name]])


def eval_sets(ctx: BuildContext) -> EvalSets:
    """A classifier's evaluation sets through the server's preprocessing of the artifact (its tokenizer is read
    from ``ctx.out``: saved first). Validation keeps its input order (its first batches are the export checks'
    inputs); the others are sorted by length (texts), their labels travel along."""
    pre = make_preprocessor(ctx.base.preprocessing, ctx.out, EVAL_MAX_PIXELS)
    data = ctx.data
    test, order = eval_batches(pre, data.test.inputs, data.test.labels)
    foreign = [f.pixels for f in foreign_images()] if data.modality == "image" else []
    first = np.arange(min(8, len(order)))  # the first test inputs in their own order (not the shortest texts)
    return EvalSets(
        test=test,
        ood_test={name: unlabelled(pre, x) for name, (x, _) in data.ood_test.items()},
        val=eval_batches(pre, data.val.inputs, data.val.labels, sort=False)[0],
        fit=eval_batches(pre, data.fit_split.inputs, data.fit_split.labels)[0],
        foreign=unlabelled(pre, foreign, sort=False) if foreign else None,
        calibration=_calibration_batches(pre, data),
        ood_val={name: unlabelled(pre, x) for name, x in data.ood_val.items()},
        test_labels=data.test.labels[order],
        latency=eval_batches(pre, take(data.test.inputs, first), data.test.labels[:8], 8, sort=False)[0][0][0],
        shift=shift_sets(ctx, pre),
    )


def shift_sets(ctx: BuildContext, pre: ImagePreprocessor | TextPreprocessor) -> dict[str, Batches]:
    """The report's shift section's sets (:mod:`offline.stages.shift_eval`): the first ``data.shift_inputs`` ID test
    inputs corrupted by every corruption of the modality at each of ``data.shift_severities``
    (:mod:`offline.method.corruptions`), by
    ``<corruption>@<severity>``, through the server's preprocessing ``pre``; empty when the config asks for none."""
    n = min(ctx.config.data.shift_inputs, len(ctx.data.test.labels))
    if n <= 0:
        return {}
    idx = np.arange(n)
    inputs, labels = take(ctx.data.test.inputs, idx), ctx.data.test.labels[idx]
    return {
        f"{kind}@{s}": eval_batches(pre, corrupt(inputs, kind, s, SHIFT_SEED, ctx.data.modality), labels)[0]
        for kind in corruptions(ctx.data.modality)
        for s in ctx.config.data.shift_severities
    }


def unlabelled(
    pre: ImagePreprocessor | TextPreprocessor, inputs: Any, extra: Batch | None = None, sort: bool = True
) -> Batches:
    """Evaluation batches of inputs without labels (OOD sets: label 0)."""
    return eval_batches(pre, inputs, [0] * len(inputs), extra=extra, sort=sort)[0]


def _calibration_batches(
    pre: ImagePreprocessor | TextPreprocessor, data: Data, extra: Batch | None = None
) -> Batches | None:
    if data.calibration is None:
        return None
    return eval_batches(pre, data.calibration.inputs, data.calibration.labels, extra=extra)[0]


def prompt_batch(ctx: BuildContext, class_names: Sequence[str], template: str) -> Batch:
    """Tokenised class prompts ``{"input_ids", "attention_mask"}`` ``(L, T)`` as ``preprocessing.text`` says."""
    text = ctx.base.preprocessing["text"]
    texts = lit.prompts(class_names, template)
    return lit.tokenize_prompts(ctx.base.tokenizer, texts, text["max_length"], padding=text.get("padding", "longest"))


@dataclass
class ZeroShotSets:
    """A zero-shot build's evaluation batches through the server's image preprocessing, each batch with the label
    prompts (``input_ids``, ``attention_mask``) of the build's labels."""

    pre: ImagePreprocessor
    val: Batches
    test: Batches
    ood_test: dict[str, Batches]
    ood_val: Batches  # every OOD validation set, joined
    calibration: Batches | None  # the calibration split (the guarantees'), None without one

    def evaluation(self) -> EvalSets:
        """The sets every method runs on: ID test and each OOD test set."""
        return EvalSets(self.test, self.ood_test)


def zero_shot_sets(ctx: BuildContext, prompts: Batch) -> ZeroShotSets:
    """The zero-shot evaluation sets of ``ctx.data`` with ``prompts`` in every batch."""
    pre = ImagePreprocessor(ctx.base.preprocessing, EVAL_MAX_PIXELS)
    data = ctx.data
    ood_val = concat(list(data.ood_val.values()))
    return ZeroShotSets(
        pre=pre,
        val=eval_batches(pre, data.val.inputs, data.val.labels, extra=prompts)[0],
        test=eval_batches(pre, data.test.inputs, data.test.labels, extra=prompts)[0],
        ood_test={name: unlabelled(pre, x, extra=prompts) for name, (x, _) in data.ood_test.items()},
        ood_val=unlabelled(pre, ood_val, extra=prompts),
        calibration=_calibration_batches(pre, data, extra=prompts),
    )


# ----------------------------------------------------------------------------- a model's outputs over batches
@torch.inference_mode()
def collect(fn: Callable[[Batch], Any], batches: Batches) -> Run:
    """Concatenated outputs of ``fn`` over batches (:data:`offline.method.ood_fit.Run`): logits, and the features and
    layer features when ``fn`` returns them (``(logits, features[, layers])``); a single model's ``(N, C)`` / ``(N, D)``
    / ``(N, L-1, d)`` become ``(N, 1, C)`` / ``(N, 1, D)`` / ``(N, 1, L-1, d)``."""
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
    fn: Callable[[Batch], torch.Tensor],
    model: nn.Module,
    layers: Sequence[nn.Module] = (),
    head: nn.Module | None = None,
) -> Callable[[Batch], tuple]:
    """``fn`` that also returns ``model``'s penultimate feature: the input of its classifier head ``(B, D)``; with
    ``layers`` (the model's blocks, :meth:`offline.families.FamilyAdapter.layer_modules`) also the outputs of every
    block but the last pooled over the tokens ``(B, L-1, d)``, as the fused model's layer features: the mean over
    all tokens, or over the real ones (``attention_mask``) for text. ``head``: the module whose input is the
    penultimate feature, when it is not ``model``'s linear ``head`` / ``classifier`` (a wrapped one)."""
    head = head if head is not None else head_module(model)

    def run(batch: Batch) -> tuple[torch.Tensor, ...]:
        seen: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        hooks = [head.register_forward_hook(lambda mod, args, out: seen.append(args[0]))]
        hooks += [m.register_forward_hook(lambda mod, args, out: states.append(_first(out))) for m in layers[:-1]]
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


def _first(out: Any) -> torch.Tensor:
    """A block's hidden states ``(B, T, d)``: its output, or the first of its outputs (Hugging Face blocks)."""
    return out[0] if isinstance(out, tuple) else out
