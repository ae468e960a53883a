"""The choice of backend, device and precision for an artifact (the backends themselves: :mod:`service.core.backends`).

:func:`resolve_plan` is the policy (pure, tested without hardware):

* device ``auto``: CUDA when available, else CPU.
* precision ``auto``: bf16 autocast on CUDA; on CPU bf16 only when the CPU has
  native bf16 (``avx512_bf16`` / ``amx_bf16``) *and* the build recorded that bf16
  predictions agree with fp32 (manifest ``precision.bf16.ok``); else fp32.
* backend ``auto``: CUDA -> torch; CPU -> ONNX Runtime when the artifact has an
  ONNX export and precision is fp32 (2-3x faster than fp32 eager on CPU), else
  torch eager (bf16 autocast).
* TorchScript and ONNX exports run fp32 only.
* ``eager_only`` (a model served by torch eager alone: the zero-shot runtime): the
  device as above; precision ``auto`` is bf16 autocast on CUDA and fp32 on CPU (its
  build checks bf16 on the fixed labels only); ``HYDRA_BACKEND`` does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.core.artifact import Manifest
from service.core.backends import (
    AotiBackend,
    Backend,
    BackendConfigError,
    OnnxBackend,
    TorchBackend,
    TorchScriptBackend,
)
from service.core.hardware import cpu_has_native_bf16
from service.core.registry import load_model

__all__ = ["FP32_ONLY", "Plan", "load_backend", "onnxruntime_available", "resolve_plan"]

# exports traced in fp32: autocast cannot re-type a traced graph (the fused model's in-place fp32 fast paths are
# baked into it), so these backends serve fp32; bf16 is the eager torch backend's.
FP32_ONLY = frozenset({"onnx", "torchscript", "aoti"})


def onnxruntime_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Plan:
    """Resolved serving choice for one artifact."""

    backend: str  # torch | torchscript | onnx | aoti
    device: str  # cpu | cuda
    precision: str  # fp32 | bf16
    reason: str  # why, for the log


def _export_path(manifest: Manifest, kind: str) -> str:
    """The file of the export ``kind``, which the plan chose because it exists."""
    file = manifest.export_file(kind)
    if file is None:
        raise BackendConfigError(f"{manifest.name}: the artifact has no {kind} export")
    return file


def resolve_plan(
    manifest: Manifest,
    *,
    device: str = "auto",
    backend: str = "auto",
    precision: str = "auto",
    eager_only: bool = False,
    cuda_available: bool | None = None,
    cpu_bf16: bool | None = None,
    onnx_available: bool | None = None,
) -> Plan:
    """Pick backend, device and precision for ``manifest`` from the settings and the hardware.

    ``eager_only``: the model is served by torch eager alone (no exports: the zero-shot runtime); see the module
    docstring for what changes. Hardware facts default to the real machine; pass them to test the policy.
    """
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    name = manifest.name
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    elif device == "cuda" and not cuda_available:
        raise BackendConfigError(f"{name}: HYDRA_DEVICE=cuda but no CUDA device is visible; use auto or cpu")
    elif device not in ("cpu", "cuda"):
        raise BackendConfigError(f"{name}: HYDRA_DEVICE={device!r} is not auto, cpu or cuda")
    if eager_only:
        return _eager_plan(manifest, device, backend, precision)
    reasons = []
    if precision == "auto":
        precision, why = _auto_precision(manifest, device, backend, cpu_bf16)
        reasons.append(f"precision {precision} ({why})")
    elif precision not in ("fp32", "bf16"):
        raise BackendConfigError(f"{name}: HYDRA_PRECISION={precision!r} is not auto, fp32 or bf16")
    ort_ok = onnxruntime_available() if onnx_available is None else onnx_available
    backend, chosen = _backend(manifest, backend, device, precision, ort_ok)
    reasons += [chosen] if chosen else []
    if backend in FP32_ONLY and precision == "bf16":
        raise BackendConfigError(
            f"{name}: the {backend} export runs fp32 only; set HYDRA_PRECISION=fp32 (or auto), or HYDRA_BACKEND=torch"
        )
    return Plan(backend=backend, device=device, precision=precision, reason="; ".join(reasons) or "as configured")


def _auto_precision(manifest: Manifest, device: str, backend: str, cpu_bf16: bool | None) -> tuple[str, str]:
    """``HYDRA_PRECISION=auto`` on ``device`` (resolved): ``(precision, why)``."""
    if device == "cuda":
        precision, why = "bf16", "CUDA"
    else:
        native = cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16
        if native and manifest.bf16_ok:
            precision, why = "bf16", "CPU has native bf16 and the build found bf16 agrees with fp32"
        else:
            precision = "fp32"
            why = "CPU lacks native bf16" if not native else "the build did not record that bf16 agrees with fp32"
    # the exports run fp32 only (a trace is specialised to fp32): auto precision follows an explicit one
    if backend in FP32_ONLY and precision == "bf16":
        precision, why = "fp32", f"the {backend} export runs fp32"
    return precision, why


def _backend(manifest: Manifest, backend: str, device: str, precision: str, ort_ok: bool) -> tuple[str, str | None]:
    """``HYDRA_BACKEND`` checked against the artifact (``auto`` chosen): ``(backend, why it was chosen)``."""
    name = manifest.name
    if backend == "auto":
        if device == "cpu" and precision == "fp32" and manifest.export_file("onnx") and ort_ok:
            return "onnx", "backend onnx (CPU fp32: ONNX Runtime is faster than eager)"
        return "torch", "backend torch" + (" (CUDA)" if device == "cuda" else f" ({precision})")
    if backend == "onnx":
        if not manifest.export_file("onnx"):
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=onnx but the artifact has no ONNX export; use torch")
        if not ort_ok:
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=onnx but onnxruntime is not installed")
    elif backend == "torchscript":
        if not manifest.export_file("torchscript"):
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=torchscript but the artifact has no TorchScript export")
    elif backend == "aoti":
        if not manifest.export_file("aoti"):
            raise BackendConfigError(
                f"{name}: HYDRA_BACKEND=aoti but the artifact has no AOTInductor package "
                "(build it with export.aoti: true)"
            )
        if device != "cpu":
            raise BackendConfigError(f"{name}: the AOTInductor package is compiled for the CPU; use HYDRA_DEVICE=cpu")
    elif backend != "torch":
        raise BackendConfigError(f"{name}: HYDRA_BACKEND={backend!r} is not auto, torch, torchscript, onnx or aoti")
    return backend, None


def _eager_plan(manifest: Manifest, device: str, backend: str, precision: str) -> Plan:
    """The plan of a model served by torch eager alone, on ``device`` (already resolved)."""
    if precision == "auto":
        # bf16 autocast on CUDA; on CPU fp32 even with native bf16 (unless asked for): a zero-shot build checks
        # bf16 against fp32 on its fixed labels only, and /zero-shot embeds labels that check never saw
        precision = "bf16" if device == "cuda" else "fp32"
    elif precision not in ("fp32", "bf16"):
        raise BackendConfigError(f"{manifest.name}: HYDRA_PRECISION={precision!r} is not auto, fp32 or bf16")
    reason = f"{manifest.task} runs torch eager; precision {precision}"
    if backend not in ("auto", "torch"):  # the exported backends are the classifiers'
        reason += f" (HYDRA_BACKEND={backend} applies to classifiers only)"
    return Plan(backend="torch", device=device, precision=precision, reason=reason)


def load_backend(root: str | Path, manifest: Manifest, plan: Plan, threads: int | None = None) -> Backend:
    """Build the backend ``plan`` names for the artifact at ``root``."""
    root = Path(root)
    spec = manifest.model
    inputs = list(spec.inputs)
    if plan.backend == "onnx":
        return OnnxBackend(root / _export_path(manifest, "onnx"), inputs, plan.device, threads)
    if plan.backend == "torchscript":
        return TorchScriptBackend(root / _export_path(manifest, "torchscript"), inputs, plan.device, plan.precision)
    if plan.backend == "aoti":
        return AotiBackend(root / _export_path(manifest, "aoti"), inputs, plan.device)
    model: Any = load_model(root / spec.weights, spec.config, device=plan.device)
    model.with_features = "features" in spec.outputs  # as the exports were traced
    model.with_layer_features = "layer_features" in spec.outputs
    return TorchBackend(model, inputs, plan.device, plan.precision)
