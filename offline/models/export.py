"""Exports of the fused model (TorchScript, ONNX, an AOTInductor package), each checked against eager on real inputs.

A build fails when an export differs from eager by more than the tolerance
(:class:`ExportMismatch`). Exports are checked on the backend that will serve them: the
server's own ONNX Runtime session (:func:`service.core.backends.onnx_session`, same options),
TorchScript backend (:class:`service.core.backends.TorchScriptBackend`) and AOTInductor backend
(:class:`service.core.backends.AotiBackend`). Inputs are passed by name as a dict; the order of
the traced/ONNX inputs is the order of the model's ``forward`` signature
(``FusedViT(pixel_values)``, ``FusedBert(input_ids, attention_mask)``).
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.core.backends import AotiBackend, TorchScriptBackend, onnx_session
from service.core.uncertainty import summarize

__all__ = [
    "ExportMismatch",
    "ONNX_OPSET",
    "BF16_TOLERANCE",
    "BF16_MIN_AGREEMENT",
    "input_order",
    "export_torchscript",
    "export_onnx",
    "export_aoti",
    "ExportKind",
    "EXPORT_KINDS",
    "export_kind",
    "export_checked",
    "run_export",
    "check_parity",
    "as_outputs",
    "eager_outputs",
    "bf16_agreement",
    "bf16_flag_agreement",
]

log = logging.getLogger("hydra.export")

ONNX_OPSET = 17
# IR version written for opset 17 graphs: onnx 1.23 may write IR 14, which onnxruntime 1.31-1.32 rejects (max 13)
ONNX_IR_VERSION = 8
SEQUENCE_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # inputs whose dim 1 is the sequence length
# bf16 autocast vs fp32: largest accepted difference of each uncertainty field, and the argmax agreement needed
BF16_TOLERANCE = {"msp": 0.05, "entropy": 0.1, "mutual_information": 0.05}
BF16_MIN_AGREEMENT = 0.99

# one batch of a model's named inputs: {"pixel_values": (B, C, H, W)} or {"input_ids": (B, T), "attention_mask": (B, T)}
Batch = dict[str, torch.Tensor]
# a model's or an export's outputs as float tensors: the member logits (B, M, C), then the features when it has them
Outputs = tuple[torch.Tensor, ...]


@contextmanager
def _quiet_jit():
    """torch 2.14 marks ``torch.jit`` deprecated with a FutureWarning per call; TorchScript is still served here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit.*")
        yield


class ExportMismatch(RuntimeError):
    """An export's outputs differ from eager by more than the tolerance (or in shape)."""


def input_order(model: nn.Module, inputs: Batch) -> list[str]:
    """Names of ``inputs`` in the order of ``model.forward``'s parameters; every parameter must be given."""
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    missing = [p for p in params if p not in inputs]
    unknown = [k for k in inputs if k not in params]
    if missing or unknown:
        raise ValueError(
            f"inputs {sorted(inputs)} do not match {type(model).__name__}.forward{tuple(params)}: "
            f"missing {missing}, unknown {unknown}"
        )
    return params


def _settle(model: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    """One eager call before tracing, so that decisions the model caches on first use (e.g.
    ``MemberLayerNorm.shared``, which compares the members' parameters) are made outside the trace: the
    comparison's ops are then not recorded, and ``check_trace``'s second trace sees the same graph."""
    with torch.no_grad():
        model(*args)


def export_torchscript(model: nn.Module, example_inputs: Batch, path: Path) -> None:
    """Trace ``model`` on ``example_inputs`` (``torch.jit.trace`` with ``check_trace``) and save it to ``path``.

    Args:
        model: a fused model; traced in eval mode.
        example_inputs: e.g. ``{"pixel_values": (B, C, H, W)}`` or ``{"input_ids": (B, T), "attention_mask": (B, T)}``.
        path: output file (``model.ts``).
    """
    model = model.eval()
    args = tuple(example_inputs[k] for k in input_order(model, example_inputs))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _settle(model, args)
    with torch.no_grad(), _quiet_jit():
        traced = torch.jit.trace(model, args, check_trace=True)
        torch.jit.save(traced, str(path))


def export_onnx(model: nn.Module, example_inputs: Batch, path: Path, output_names: list[str]) -> None:
    """Export ``model`` to ONNX (legacy exporter, opset 17) that onnxruntime loads.

    Input names are the dict keys (in ``forward`` order); every input and output
    has a dynamic batch axis (0); ``input_ids`` / ``attention_mask`` also a
    dynamic sequence axis (1). The file's IR version is set to the one of opset
    17 (8) when onnx wrote a newer one, since onnxruntime rejects IR versions
    newer than it knows; the file is then loaded once with onnxruntime.
    """
    import onnx

    model = model.eval()
    names = input_order(model, example_inputs)
    args = tuple(example_inputs[k] for k in names)
    dynamic_axes: dict[str, dict[int, str]] = {}
    for k in names:
        dynamic_axes[k] = {0: "batch", 1: "sequence"} if k in SEQUENCE_INPUTS else {0: "batch"}
    for k in output_names:
        dynamic_axes[k] = {0: "batch"}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _settle(model, args)
    with torch.no_grad():
        torch.onnx.export(
            model,
            args,
            str(path),
            input_names=names,
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            opset_version=ONNX_OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    proto = onnx.load(str(path))
    if proto.ir_version > ONNX_IR_VERSION:
        log.info(
            "onnx wrote IR version %d; setting %d (opset %d) for onnxruntime",
            proto.ir_version,
            ONNX_IR_VERSION,
            ONNX_OPSET,
        )
        proto.ir_version = ONNX_IR_VERSION
        onnx.save(proto, str(path))
    onnx.checker.check_model(str(path))
    onnx_session(path)  # fails here, at build time, if onnxruntime cannot run the file


AOTI_MAX_BATCH = 4096  # the largest batch an AOTInductor package accepts (its dynamic batch dimension's bound)


def export_aoti(model: nn.Module, example_inputs: Batch, path: Path, max_seq: int = 4096) -> None:
    """Compile ``model`` ahead of time for the CPU (``torch.export`` + AOTInductor) into the package ``path``.

    The batch dimension (and, for text, the sequence dimension up to ``max_seq``) stays dynamic. The model is run
    eagerly once first (:func:`_settle`: shape-independent facts it caches, such as whether its members share a
    LayerNorm affine, are fixed before the graph is captured). The package runs fp32 on the device it was compiled
    for; it is loaded by :class:`service.core.backends.AotiBackend`."""
    model = model.eval()
    names = input_order(model, example_inputs)
    args = tuple(example_inputs[k].contiguous() for k in names)
    batch = torch.export.Dim("batch", min=1, max=AOTI_MAX_BATCH)
    seq = torch.export.Dim("sequence", min=2, max=max_seq)
    dynamic = tuple({0: batch, 1: seq} if k in SEQUENCE_INPUTS else {0: batch} for k in names)
    _settle(model, args)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.export.export(model, args, dynamic_shapes=dynamic, strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))


@dataclass(frozen=True)
class ExportKind:
    """How one kind of export is written, and loaded back as the server loads it (on the CPU) to check it."""

    write: Callable[[nn.Module, Batch, Path, list[str]], None]  # (model, example, path, output names)
    load: Callable[[Path, list[str]], Any]  # (path, input order) -> a backend or an onnxruntime session


EXPORT_KINDS: dict[str, ExportKind] = {
    "torchscript": ExportKind(
        write=lambda model, example, path, _outputs: export_torchscript(model, example, path),
        load=lambda path, order: TorchScriptBackend(path, order, "cpu", "fp32"),
    ),
    "onnx": ExportKind(
        write=lambda model, example, path, outputs: export_onnx(model, example, path, output_names=outputs),
        load=lambda path, _order: onnx_session(path),
    ),
    "aoti": ExportKind(
        write=lambda model, example, path, _outputs: export_aoti(model, example, path),
        load=lambda path, order: AotiBackend(path, order, "cpu"),
    ),
}


def export_kind(kind: str) -> ExportKind:
    """The :class:`ExportKind` named ``kind``; a ValueError naming the known ones for any other name."""
    if kind not in EXPORT_KINDS:
        raise ValueError(f"unknown export kind {kind!r}; expected 'torchscript', 'onnx' or 'aoti'")
    return EXPORT_KINDS[kind]


def run_export(runner: Any, kind: str, inputs: Batch, order: list[str]) -> Outputs:
    """Every output of a loaded export, on named ``inputs``: a TorchScript backend, or an onnxruntime session fed
    the graph's own inputs (an ONNX graph may drop an input its outputs do not depend on)."""
    if kind in ("torchscript", "aoti"):
        return runner.outputs(inputs)
    if kind == "onnx":
        wanted = [i.name for i in runner.get_inputs()]
        feed = {k: inputs[k].detach().cpu().numpy() for k in wanted}
        return tuple(torch.from_numpy(np.asarray(o)).float() for o in runner.run(None, feed))
    raise ValueError(f"unknown export kind {kind!r}; expected 'torchscript' or 'onnx'")


def as_outputs(out: Any) -> Outputs:
    """A model's or export's output as a tuple of float tensors (logits first; then features, when it has them)."""
    return tuple(o.float() for o in out) if isinstance(out, (tuple, list)) else (out.float(),)


def eager_outputs(model: nn.Module, batches: list[Batch]) -> list[Outputs]:
    """fp32 eager outputs of ``model`` on ``batches`` (the reference shared by the export and bf16 checks)."""
    model = model.eval()
    order = input_order(model, batches[0])
    with torch.inference_mode():
        return [as_outputs(model(*(b[k] for k in order))) for b in batches]


def _reference(model: nn.Module, batches: list[Batch], reference: list[Outputs] | None) -> list[Outputs]:
    """``reference`` checked against ``batches``, or the eager outputs computed now."""
    if reference is None:
        return eager_outputs(model, batches)
    if len(reference) != len(batches):
        raise ValueError(f"{len(reference)} reference outputs for {len(batches)} batches")
    return reference


def check_parity(
    model: nn.Module,
    path: Path,
    kind: str,
    batches: list[Batch],
    tol: float,
    reference: list[Outputs] | None = None,
) -> float:
    """Largest absolute output difference between ``model`` (eager) and its export over ``batches``.

    Args:
        model: the eager model the export was made from.
        path: the export file.
        kind: ``torchscript``, ``onnx`` or ``aoti`` (:data:`EXPORT_KINDS`).
        batches: named inputs (real validation inputs; vary batch sizes and, for text, sequence lengths).
        tol: largest accepted absolute difference.
        reference: the eager outputs on ``batches`` when already computed (:func:`eager_outputs`).

    Raises :class:`ExportMismatch` (naming the batch, the difference and the
    tolerance) when a batch differs by more than ``tol``, in shape, or has NaNs.
    """
    if not batches:
        raise ValueError("check_parity needs at least one batch")
    model = model.eval()
    order = input_order(model, batches[0])
    runner = export_kind(kind).load(path, order)
    worst = 0.0
    for i, (batch, refs) in enumerate(zip(batches, _reference(model, batches, reference), strict=True)):
        gots = run_export(runner, kind, batch, order)
        shapes = {k: tuple(v.shape) for k, v in batch.items()}
        if len(gots) != len(refs):
            raise ExportMismatch(f"{kind} export {path}: {len(gots)} outputs, eager gives {len(refs)}")
        for j, (got, ref) in enumerate(zip(gots, refs, strict=True)):  # every output: logits, then features
            if got.shape != ref.shape:
                raise ExportMismatch(
                    f"{kind} export {path}: batch {i} (inputs {shapes}) output {j} has shape {tuple(got.shape)}, "
                    f"eager gives {tuple(ref.shape)}"
                )
            diff = float((got - ref).abs().max()) if ref.numel() else 0.0
            if math.isnan(diff) or diff > tol:
                raise ExportMismatch(
                    f"{kind} export {path} differs from eager on batch {i} (inputs {shapes}), output {j}: "
                    f"max abs diff {diff:.3g} > tolerance {tol:.3g}"
                )
            worst = max(worst, diff)
    log.info("%s parity over %d batches: max abs diff %.3g (tolerance %.3g)", kind, len(batches), worst, tol)
    return worst


def export_checked(
    model: nn.Module,
    kind: str,
    path: Path,
    batches: list[Batch],
    tol: float,
    output_names: list[str],
    reference: list[Outputs] | None = None,
    example: Batch | None = None,
) -> float:
    """Export ``model`` as ``kind`` (one of :data:`EXPORT_KINDS`) to ``path``, traced on ``example`` (default
    ``batches[0]``), and return its largest difference to eager over ``batches`` (:func:`check_parity`; raises
    :class:`ExportMismatch`). ``reference``: the eager outputs on ``batches`` when already computed."""
    example = batches[0] if example is None else example
    export_kind(kind).write(model, example, path, output_names)
    return check_parity(model, path, kind, batches, tol, reference=reference)


@torch.inference_mode()
def bf16_agreement(
    model: nn.Module,
    batches: list[Batch],
    temperature: float,
    reference: list[Outputs] | None = None,
) -> dict:
    """CPU bf16 autocast vs fp32 on validation batches: does serving in bf16 give the same answers?

    Both runs' member logits ``(B, M, C)`` go through ``service.core.uncertainty.summarize``
    at ``temperature``. Returns ``{"argmax_agreement"`` (fraction of inputs whose
    ensemble prediction is the same), ``"max_abs_diff": {msp, entropy, mutual_information}``,
    ``"max_abs_logit_diff"``, ``"tolerance"`` (:data:`BF16_TOLERANCE`), ``"min_agreement"``,
    ``"ok"`` (agreement >= 0.99 and every field within tolerance), ``"n"`` (inputs)}.
    ``reference``: the fp32 outputs on ``batches`` when already computed (:func:`eager_outputs`).
    """
    if not batches:
        raise ValueError("bf16_agreement needs at least one batch")
    refs = [r[0] for r in _reference(model, batches, reference)]  # the logits
    model = model.eval()
    order = input_order(model, batches[0])
    fields = tuple(BF16_TOLERANCE)
    same, n, logit_diff = 0, 0, 0.0
    diffs = dict.fromkeys(fields, 0.0)
    for batch, ref in zip(batches, refs, strict=True):
        args = [batch[k] for k in order]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = as_outputs(model(*args))[0]
        s_ref, s_low = summarize(ref, temperature), summarize(low, temperature)
        same += int((s_ref["prediction"] == s_low["prediction"]).sum())
        n += ref.shape[0]
        logit_diff = max(logit_diff, float((ref - low).abs().max()))
        for f in fields:
            diffs[f] = max(diffs[f], float((s_ref[f] - s_low[f]).abs().max()))
    agreement = same / n
    ok = agreement >= BF16_MIN_AGREEMENT and all(diffs[f] <= BF16_TOLERANCE[f] for f in fields)
    return {
        "argmax_agreement": agreement,
        "max_abs_diff": diffs,
        "max_abs_logit_diff": logit_diff,
        "tolerance": dict(BF16_TOLERANCE),
        "min_agreement": BF16_MIN_AGREEMENT,
        "ok": bool(ok),
        "n": n,
    }


@torch.inference_mode()
def bf16_flag_agreement(
    model: nn.Module,
    batches: list[Batch],
    reference: list[Outputs],
    flags_of: Any,
) -> float:
    """Share of inputs whose served OOD flag is the same under CPU bf16 autocast as in fp32 (``reference``).

    ``flags_of(outputs) -> (B,) bool``: the server's flag from a model's outputs (logits, and features when the
    model returns them); the feature scores run in float64 either way, so this measures what bf16 features do.
    """
    model = model.eval()
    order = input_order(model, batches[0])
    same = n = 0
    for batch, ref in zip(batches, reference, strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = as_outputs(model(*(batch[k] for k in order)))
        same += int((flags_of(ref) == flags_of(low)).sum())
        n += ref[0].shape[0]
    return same / n
