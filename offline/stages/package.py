"""The artifact stage: the folder emptied for a new artifact, the weights and statistics saved, every export checked
against eager (:mod:`offline.models.export`), the report written (:mod:`offline.report`) and, last, the manifest (its
one writer: :func:`service.core.artifact.write_manifest`), so that a failed build leaves no manifest behind."""

from __future__ import annotations

import logging
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from safetensors.torch import save_file
from torch import nn

from offline.config import BuildConfig, ExportConfig
from offline.data import Data
from offline.method.guarantee_fits import GUARANTEES_FILE, Fitted
from offline.method.ood_fit import LAYERS
from offline.models.export import (
    BF16_MIN_AGREEMENT,
    ONNX_OPSET,
    bf16_agreement,
    bf16_flag_agreement,
    eager_outputs,
    export_checked,
)
from offline.report import write_report
from offline.stages.calibrate import Calibration, ZeroShotCalibration
from offline.stages.certify import Guarantees
from offline.stages.context import BuildContext, Timer
from offline.stages.datasets import Batch, Batches, EvalSets, ZeroShotSets, prompt_batch
from offline.stages.ensemble import Fused
from offline.stages.evaluation import Evaluation
from offline.stages.shift_eval import shift_report
from offline.train import lit
from service.core.artifact import OOD_FILE, Manifest, write_manifest
from service.core.ood import ensemble_scores, ood_tensors
from service.core.progress import stage as progress_stage
from service.core.uncertainty import ood_flag

__all__ = [
    "Exports",
    "export_classifier",
    "export_zero_shot",
    "label_free_spec",
    "model_outputs",
    "model_spec",
    "ood_spec",
    "prepare_out",
    "provenance",
    "report_extra",
    "save_weights",
    "write_artifact",
    "zero_shot_extra",
]

log = logging.getLogger("hydra.build")


@dataclass
class Exports:
    """The checked exports and the bf16 check, as the manifest's ``exports`` and ``precision`` blocks record them."""

    exports: dict[str, Any]
    precision: dict[str, Any]


def prepare_out(ctx: BuildContext) -> None:
    """Empty ``out`` for a new artifact, keeping ``.checkpoints`` (resumable training state) until the end; then save
    the tokenizer first (the server's text preprocessing, which evaluation runs, reads the artifact's).

    ``.checkpoints`` is made here if it is missing: a folder that has it is an unfinished build, which the same
    command resumes (:func:`offline.build.resumable_only`), wherever it was stopped."""
    out = ctx.out
    (out / ".checkpoints").mkdir(parents=True, exist_ok=True)  # an unfinished build until write_artifact ends
    for p in out.iterdir():
        if p.name != ".checkpoints":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if ctx.base.tokenizer is not None:
        ctx.base.tokenizer.save_pretrained(str(out / "tokenizer"))


def save_weights(out: Path, fused: nn.Module, cal: Calibration, guarantees: Fitted | None) -> None:
    """The fused model's weights, the OOD statistics (when the served score has any) and the guarantees (when the
    build has a calibration split)."""
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, str(out / "model.safetensors"))
    if cal.stats is not None:
        save_file(ood_tensors(cal.stats), str(out / OOD_FILE))
    if guarantees is not None:
        save_file(guarantees.tensors, str(out / GUARANTEES_FILE))


# ----------------------------------------------------------------------------- exports
def export_classifier(ctx: BuildContext, fused: Fused, cal: Calibration, sets: EvalSets) -> Exports:
    """A classifier's exports, checked on validation inputs; the fused model serves (and exports) its layer features
    only when the served score reads them."""
    model = fused.model
    model.with_layer_features = cal.stats is not None and cal.stats.layers is not None
    with progress_stage("export"):
        exports = export_fused(ctx.config.export, model, parity_batches(sets.val or []), ctx.out, cal)
    ctx.timer.lap("export")
    return exports


def parity_batches(val: Batches) -> list[Batch]:
    """The export checks' inputs: 256 validation inputs, and other batch sizes and (text) a shorter length."""
    full = [b for b, _ in val[:2]]
    first = full[0]
    odd = [{k: v[:1] for k, v in first.items()}, {k: v[:5] for k, v in first.items()}]
    if "attention_mask" in first:
        n = int(first["attention_mask"][:3].sum(1).max())
        odd.append({k: v[:3, :n] for k, v in first.items()})
    return full + odd


def export_fused(e: ExportConfig, fused: nn.Module, batches: list[Batch], out: Path, cal: Calibration) -> Exports:
    """TorchScript, ONNX and AOTInductor exports (as ``e``, the config's ``export`` section, asks) checked against one
    fp32 eager reference, and the bf16 check (the uncertainty fields and the served OOD flag under bf16 autocast)."""
    tol = e.tolerance
    reference = eager_outputs(fused, batches)
    example = {k: v[:2] for k, v in batches[0].items()}
    exports: dict[str, Any] = {}
    wanted = {"torchscript": e.torchscript, "onnx": e.onnx, "aoti": e.aoti}
    for kind, file in (("torchscript", "model.ts"), ("onnx", "model.onnx"), ("aoti", "model.pt2")):
        if wanted[kind]:
            diff = export_checked(fused, kind, out / file, batches, tol, model_outputs(fused), reference, example)
            exports[kind] = {"file": file, "max_abs_diff": diff, "tolerance": tol}
            if kind == "onnx":
                exports[kind]["opset"] = ONNX_OPSET
    precision = {}
    if e.bf16_check:  # CPUs without native bf16 emulate it 3-4x slower than fp32
        check = bf16_agreement(fused, batches, temperature=cal.temperature, reference=reference)

        def flags_of(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            features = outs[1] if len(outs) > 1 else None
            layers = outs[2] if len(outs) > 2 else None
            scores = ensemble_scores(outs[0], features, cal.stats, cal.temperature, layer_features=layers)
            return ood_flag(scores[cal.metric], cal.metric, cal.threshold)

        check["ood_flag_agreement"] = bf16_flag_agreement(fused, batches, reference, flags_of)
        check["ok"] = bool(check["ok"] and check["ood_flag_agreement"] >= BF16_MIN_AGREEMENT)
        precision["bf16"] = check
    return Exports(exports, precision)


def model_outputs(fused: nn.Module) -> list[str]:
    """The fused model's named outputs as exported and listed in the manifest: logits, features, and the layer
    features when the served score reads them."""
    return ["logits", "features"] + (["layer_features"] if fused.layer_features else [])


def export_zero_shot(ctx: BuildContext, fused: Fused, cal: Calibration, sets: ZeroShotSets, prompts: Batch) -> Exports:
    """Both encoders of a zero-shot model exported and checked, and the bf16 check; the image encoder serves its
    layer features only when the served score reads them."""
    model = fused.model
    model.visual.with_layer_features = cal.stats is not None and cal.stats.layers is not None
    with progress_stage("export"):
        exports = zero_shot_exports(ctx, model, sets.val, prompts)
    precision = {}
    if ctx.config.export.bf16_check:
        precision["bf16"] = bf16_agreement(model, [b for b, _ in sets.val[:4]], temperature=cal.temperature)
    ctx.timer.lap("export")
    return Exports(exports, precision)


def zero_shot_exports(ctx: BuildContext, fused: nn.Module, val: Batches, prompts: Batch) -> dict[str, Any]:
    """Both encoders exported and checked against eager: images at batch 2, 5 and 16; prompts of the build's labels,
    of two labels with another template, and of more labels than the build saw."""
    class_names = list(ctx.data.class_names)
    image_batches = [{"pixel_values": b["pixel_values"][:k]} for (b, _), k in zip(val[:3], (2, 5, 16), strict=False)]
    text_batches = [
        dict(prompts),
        prompt_batch(ctx, class_names[:2], "a photo of the {label}, a type of clothing."),
        prompt_batch(ctx, class_names + ["dog", "bicycle"], "{label}"),
    ]
    image_out = ["image_embeds"] + (["layer_features"] if fused.visual.with_layer_features else [])
    encoders = {
        "image": (fused.image_encoder, image_batches, image_out),
        "text": (fused.text_encoder, text_batches, ["text_embeds"]),
    }
    e = ctx.config.export
    exports: dict[str, Any] = {}
    for kind, on in (("torchscript", e.torchscript), ("onnx", e.onnx)):
        if not on:
            continue
        ext = "ts" if kind == "torchscript" else "onnx"
        rec: dict[str, Any] = {"max_abs_diff": {}, "tolerance": e.tolerance}
        if ext == "onnx":
            rec.update(opset=ONNX_OPSET, inputs={})
        for side, (mod, batches, names) in encoders.items():
            path = ctx.out / f"{side}_encoder.{ext}"
            rec["max_abs_diff"][side] = export_checked(mod, kind, path, batches, e.tolerance, names)
            rec[side] = path.name
            if ext == "onnx":  # the graph inputs actually present
                rec["inputs"][side] = [i.name for i in onnx.load(str(path)).graph.input]
        exports[kind] = rec
    return exports


# ----------------------------------------------------------------------------- the manifest's blocks
def ood_spec(cal: Calibration, data: Data) -> dict[str, Any] | None:
    """A classifier manifest's ``ood`` block: the statistics file, the scores the server computes and how one was
    chosen."""
    if cal.stats is None:
        return None
    # the scores the server computes: every candidate but the multi-layer score's layer sets, which the artifact
    # carries (one set) only when it serves that score
    return _ood_block(cal, data, [n for n in cal.candidates if "@" not in n])


def label_free_spec(cal: Calibration, data: Data) -> dict[str, Any] | None:
    """The manifest's ``ood`` block of a zero-shot model with label-free statistics (None: probability scores)."""
    if cal.stats is None:
        return None
    return _ood_block(cal, data, ["mahalanobis"], label_free=True)


def _ood_block(cal: Calibration, data: Data, scores: list[str], **extra: Any) -> dict[str, Any]:
    """The ``ood`` block both kinds share: the statistics file, the served ``scores`` (plus the multi-layer score
    when the statistics carry layers), how one was chosen, ``extra`` and the layer set."""
    layers = cal.stats.layers if cal.stats is not None else None
    spec = {
        "file": OOD_FILE,
        "scores": scores + ([LAYERS] if layers is not None else []),
        "selected": cal.metric,
        "forced": cal.forced,
        "candidates": cal.candidates,
        "fit": data.splits.get("id", {}).get("fit"),
        **extra,
    }
    if layers is not None:
        spec["layers"] = list(layers.ids)
        if layers.reduce != "max":  # written only when it differs from what older artifacts mean by its absence
            spec["layers_reduce"] = layers.reduce
        if cal.layers is not None and cal.layers.label_free:
            spec["layers_label_free"] = True
    return spec


def model_spec(fcfg: dict[str, Any], cal: Calibration | None = None) -> dict[str, Any]:
    """The manifest's ``model`` block of a fused dual encoder; ``outputs``: with label-free OOD statistics the image
    embeddings are the scores' ``features`` (and, for ``mahalanobis_layers``, the image tower's layer features)."""
    image = {"inputs": ["pixel_values"], "output": "image_embeds", "shape": "(B, M, D)"}
    outputs = ["logits"]
    if cal is not None and cal.stats is not None:
        outputs.append("features")
        if cal.stats.layers is not None:
            outputs.append("layer_features")
            image["outputs"] = ["image_embeds", "layer_features"]
    return {
        "config": fcfg,
        "weights": "model.safetensors",
        "inputs": ["pixel_values", "input_ids", "attention_mask"],
        "output": "logits",
        "shape": "(B, M, L)",
        "outputs": outputs,
        "image_encoder": image,
        "text_encoder": {"inputs": ["input_ids", "attention_mask"], "output": "text_embeds", "shape": "(L, M, D)"},
    }


def provenance(cfg: BuildConfig, timer: Timer) -> dict[str, Any]:
    """The manifest's ``build`` block: resolved config, stage timings, versions, machine, time."""
    return {
        "config": cfg.to_dict(),
        "timings_s": timer.times,
        "torch": torch.__version__,
        "machine": platform.platform(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ----------------------------------------------------------------------------- the report and the manifest
def report_extra(ctx: BuildContext, cal: Calibration, evaluation: Evaluation, guarantees: Guarantees) -> dict[str, Any]:
    """The build facts a classifier's report shows next to its tables."""
    data = ctx.data
    out = {
        "temperature": cal.temperature,
        "ood_threshold": cal.threshold,
        "ood_score": cal.metric,
        "timings_s": ctx.timer.times,
        "ood_val_flagged": cal.ood_val_flagged,
        "ood_candidates": cal.candidates,
        "ood_selected": cal.selected or cal.metric,
        "ood_forced": cal.forced,
        "served_flag": evaluation.served,
        "no_ood_data": not data.ood_val and not data.ood_test,
    }
    if cal.layers is not None:  # the blocks mahalanobis_layers reads: served, or the best layer set on validation
        out["ood_layers"] = list(cal.layers.ids)
        out["ood_layers_reduce"] = cal.layers.reduce
        out["ood_layers_label_free"] = cal.layers.label_free
    shift = shift_report(evaluation.shift, guarantees.report)
    return {**out, **evaluation.extra, "guarantees_report": guarantees.report} | ({"shift": shift} if shift else {})


def zero_shot_extra(
    ctx: BuildContext, cal: ZeroShotCalibration, t_single: float, guarantees: Guarantees
) -> dict[str, Any]:
    """The build facts a zero-shot report shows next to its tables; ``t_single``: the base model's own temperature."""
    c = cal.calibration
    extra = {
        "template": lit.TEMPLATE,
        "labels": list(ctx.data.class_names),
        "temperature": c.temperature,
        "temperature_single_ts": t_single,
        "ood_threshold": c.threshold,
        "ood_score": c.metric,
        "timings_s": ctx.timer.times,
        "ood_val_flagged": c.ood_val_flagged,
        "base_zero_shot_val_acc": ctx.base.description.get("lit", {}).get("val_zero_shot_accuracy"),
    }
    if guarantees.report is not None:
        extra["guarantees_report"] = guarantees.report
    if cal.served is not None:
        extra.update(ood_candidates=c.candidates, ood_selected=c.selected or c.metric, served_flag=cal.served)
        if c.layers is not None:
            extra["ood_layers"] = list(c.layers.ids)
            extra["ood_layers_reduce"] = c.layers.reduce
    return extra


def write_artifact(
    ctx: BuildContext,
    manifest: Callable[[dict[str, Any]], Manifest],
    evaluation: Evaluation,
    title: str,
    extra: dict[str, Any],
) -> Path:
    """Write the report, then the manifest (``manifest(metrics_summary)``, listing every file; written whole or not
    at all), then drop the training checkpoints, the last step: until they are gone the folder is an unfinished
    build that the same command resumes, and a failed build leaves no manifest behind."""
    out, data = ctx.out, ctx.data
    evaluation.plots["class_names"] = list(data.class_names)  # the per-class table and confusion matrix, by name
    ood_kinds = {name: kind for name, (_, kind) in data.ood_test.items()}
    summary = write_report(out, evaluation.rows, ood_kinds, evaluation.plots, title, extra)
    write_manifest(out, manifest(summary))
    ckpt = out / ".checkpoints"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    log.info("artifact written to %s", out)
    return out
