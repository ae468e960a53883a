"""Model backends (torch eager, TorchScript, ONNX Runtime) and the choice of backend, device and precision.

Every backend maps a dict of input tensors (the manifest's ``model.inputs``) to
the model's first output as a float32 CPU tensor, member logits ``(B, M, C)``.

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

import logging
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .fused import GroupedLinear
from .models import load_model

__all__ = [
    "Backend",
    "BackendConfigError",
    "OnnxBackend",
    "Plan",
    "TorchBackend",
    "TorchScriptBackend",
    "cpu_bf16_flags",
    "cpu_has_native_bf16",
    "load_backend",
    "onnx_session",
    "onnxruntime_available",
    "resolve_plan",
]

log = logging.getLogger("hydra.backends")

# exports traced in fp32: autocast cannot re-type a traced graph (the fused model's in-place fp32 fast paths are
# baked into it), so these backends serve fp32; bf16 is the eager torch backend's.
FP32_ONLY = frozenset({"onnx", "torchscript", "aoti"})


class BackendConfigError(ValueError):
    """The requested backend / device / precision cannot serve this artifact; the message says what to change."""


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str] | None:
    """The native bf16 flags the CPU lists (``avx512_bf16``, ``amx_bf16``; Linux), None when unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return None


def cpu_name(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux ``model name``), else what ``platform`` knows: the machine named in every
    measurement (benchmarks, the backbone's record)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list ``avx512_bf16`` or ``amx_bf16`` (Linux; False when unreadable)."""
    return bool(cpu_bf16_flags(cpuinfo))


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


def _export_file(manifest: dict[str, Any], kind: str) -> str | None:
    exp = (manifest.get("exports") or {}).get(kind)
    if not exp:
        return None
    return exp.get("file") if isinstance(exp, dict) else None


def resolve_plan(
    manifest: dict[str, Any],
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
    name = manifest.get("name", "?")
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    elif device == "cuda" and not cuda_available:
        raise BackendConfigError(f"{name}: HYDRA_DEVICE=cuda but no CUDA device is visible; use auto or cpu")
    elif device not in ("cpu", "cuda"):
        raise BackendConfigError(f"{name}: HYDRA_DEVICE={device!r} is not auto, cpu or cuda")
    if eager_only:
        return _eager_plan(manifest, device, backend, precision)

    bf16_ok = bool(((manifest.get("precision") or {}).get("bf16") or {}).get("ok", False))
    reasons = []
    if precision == "auto":
        if device == "cuda":
            precision, why = "bf16", "CUDA"
        else:
            native = cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16
            if native and bf16_ok:
                precision, why = "bf16", "CPU has native bf16 and the build found bf16 agrees with fp32"
            else:
                precision = "fp32"
                why = "CPU lacks native bf16" if not native else "the build did not record that bf16 agrees with fp32"
        # the exports run fp32 only (a trace is specialised to fp32): auto precision follows an explicit one
        if backend in FP32_ONLY and precision == "bf16":
            precision, why = "fp32", f"the {backend} export runs fp32"
        reasons.append(f"precision {precision} ({why})")
    elif precision not in ("fp32", "bf16"):
        raise BackendConfigError(f"{name}: HYDRA_PRECISION={precision!r} is not auto, fp32 or bf16")

    onnx_file = _export_file(manifest, "onnx")
    ts_file = _export_file(manifest, "torchscript")
    ort_ok = onnxruntime_available() if onnx_available is None else onnx_available
    if backend == "auto":
        if device == "cpu" and precision == "fp32" and onnx_file and ort_ok:
            backend = "onnx"
            reasons.append("backend onnx (CPU fp32: ONNX Runtime is faster than eager)")
        else:
            backend = "torch"
            reasons.append("backend torch" + (" (CUDA)" if device == "cuda" else f" ({precision})"))
    elif backend == "onnx":
        if not onnx_file:
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=onnx but the artifact has no ONNX export; use torch")
        if not ort_ok:
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=onnx but onnxruntime is not installed")
    elif backend == "torchscript":
        if not ts_file:
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=torchscript but the artifact has no TorchScript export")
    elif backend == "aoti":
        if not _export_file(manifest, "aoti"):
            raise BackendConfigError(f"{name}: HYDRA_BACKEND=aoti but the artifact has no AOTInductor package "
                                     "(build it with export.aoti: true)")  # fmt: skip
        if device != "cpu":
            raise BackendConfigError(f"{name}: the AOTInductor package is compiled for the CPU; use HYDRA_DEVICE=cpu")
    elif backend != "torch":
        raise BackendConfigError(f"{name}: HYDRA_BACKEND={backend!r} is not auto, torch, torchscript, onnx or aoti")
    if backend in FP32_ONLY and precision == "bf16":
        raise BackendConfigError(
            f"{name}: the {backend} export runs fp32 only; set HYDRA_PRECISION=fp32 (or auto), or HYDRA_BACKEND=torch"
        )
    return Plan(backend=backend, device=device, precision=precision, reason="; ".join(reasons) or "as configured")


def _eager_plan(manifest: dict[str, Any], device: str, backend: str, precision: str) -> Plan:
    """The plan of a model served by torch eager alone, on ``device`` (already resolved)."""
    name = manifest.get("name", "?")
    if precision == "auto":
        # bf16 autocast on CUDA; on CPU fp32 even with native bf16 (unless asked for): a zero-shot build checks
        # bf16 against fp32 on its fixed labels only, and /zero-shot embeds labels that check never saw
        precision = "bf16" if device == "cuda" else "fp32"
    elif precision not in ("fp32", "bf16"):
        raise BackendConfigError(f"{name}: HYDRA_PRECISION={precision!r} is not auto, fp32 or bf16")
    reason = f"{manifest.get('task', 'the model')} runs torch eager; precision {precision}"
    if backend not in ("auto", "torch"):  # the exported backends are the classifiers'
        reason += f" (HYDRA_BACKEND={backend} applies to classifiers only)"
    return Plan(backend="torch", device=device, precision=precision, reason=reason)


class Backend:
    """Base: ``backend.outputs(inputs)`` -> every model output, float32 on CPU: member logits ``(B, M, C)``, then
    (artifacts whose ``model.outputs`` lists ``features``) the members' penultimate features ``(B, M, D)``;
    ``backend(inputs)`` -> the logits alone."""

    name = "base"

    def __init__(self, input_names: list[str], device: str, precision: str) -> None:
        self.input_names = list(input_names)
        self.device = device
        self.precision = precision

    def outputs(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.outputs(inputs)[0]

    def _check(self, inputs: dict[str, torch.Tensor]) -> None:
        missing = [k for k in self.input_names if k not in inputs]
        if missing:
            raise KeyError(f"backend {self.name}: missing inputs {missing}")


class _TorchLike(Backend):
    """Shared by eager and TorchScript: device transfer, inference mode and bf16 autocast."""

    def _run(self, fn: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        dev = torch.device(self.device)
        args = [inputs[k].to(dev, non_blocking=True) for k in self.input_names]
        with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            out = fn(*args)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return tuple(o.float().cpu() for o in outs)


def cast_gemm_weights(model: torch.nn.Module) -> torch.nn.Module:
    """The weights of ``model``'s matrix products (linear, grouped linear and convolution layers) stored in bf16, in
    place; everything else (norms, embeddings, biases, tokens) stays fp32.

    Under bf16 autocast these weights are cast to bf16 for every product anyway, so the outputs are bit for bit
    the same, but autocast casts them again on every forward: a copy of every weight matrix per call
    (``benchmarks/results/backends/profile_vit_b16_bf16_b1.txt``). Cast once, the fused ViT-B/16 answers one image
    3-4 % sooner and a dense one 12 % sooner, with half the weight memory (AMD EPYC, 2 threads;
    ``benchmarks/results/bf16_weights/``)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d, GroupedLinear)):
            module.weight.data = module.weight.data.to(torch.bfloat16)
    return model


class TorchBackend(_TorchLike):
    """``nn.Module`` eager; ``forward`` takes the inputs positionally in manifest order. In bf16 the weights of its
    matrix products are stored in bf16 (:func:`cast_gemm_weights`: the same outputs, no per-call casts)."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, input_names: list[str], device: str, precision: str) -> None:
        super().__init__(input_names, device, precision)
        self.model = model.to(device).eval()
        if precision == "bf16":
            cast_gemm_weights(self.model)

    def outputs(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self._run(self.model, inputs)


class TorchScriptBackend(_TorchLike):
    """A ``torch.jit`` export (traced with the inputs in manifest order)."""

    name = "torchscript"

    def __init__(self, path: str | Path, input_names: list[str], device: str, precision: str) -> None:
        super().__init__(input_names, device, precision)
        with warnings.catch_warnings():  # torch.jit.load's deprecation notice: the export is what we serve
            warnings.simplefilter("ignore", FutureWarning)
            self.module = torch.jit.load(str(path), map_location=device).eval()

    def outputs(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self._run(self.module, inputs)


class AotiBackend(Backend):
    """An AOTInductor package (``model.pt2``: ``torch.export`` compiled ahead of time for the CPU), fp32.

    Its kernels were generated for contiguous inputs, so every input is made contiguous first (a strided view,
    such as a column slice of a batch, would otherwise be read with the wrong strides)."""

    name = "aoti"

    def __init__(self, path: str | Path, input_names: list[str], device: str = "cpu") -> None:
        from torch._inductor import aoti_load_package  # the compiler's package loader: imported when used

        super().__init__(input_names, device, "fp32")
        self.runner = aoti_load_package(str(path))

    def outputs(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        with torch.inference_mode():
            out = self.runner(*(inputs[k].contiguous() for k in self.input_names))
        return tuple(o.float() for o in (out if isinstance(out, (tuple, list)) else (out,)))


def onnx_session(
    path: str | Path, device: str = "cpu", threads: int | None = None, profile_prefix: str | None = None
) -> Any:
    """The one way an ONNX export is opened, by the server, the build's parity check and the benchmarks.

    An ``onnxruntime.InferenceSession`` with every graph optimisation, ``threads`` intra-op threads (default
    torch's), idle threads that sleep instead of spinning (the event loop and preprocessing share these cores),
    and the CUDA execution provider first when ``device`` is ``cuda`` and onnxruntime has it (else CPU, with a
    warning). The provider that runs is ``session.get_providers()[0]``. ``profile_prefix``: ONNX Runtime's
    profiler on, its JSON file named after it (``session.end_profiling()`` writes it and returns its path).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if profile_prefix is not None:
        opts.enable_profiling, opts.profile_file_prefix = True, profile_prefix
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        else:
            log.warning("onnxruntime has no CUDA execution provider (install onnxruntime-gpu): running on CPU")
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)


class OnnxBackend(Backend):
    """An ONNX export in ONNX Runtime (:func:`onnx_session`): CUDA execution provider when asked for and present."""

    name = "onnx"

    def __init__(self, path: str | Path, input_names: list[str], device: str, threads: int | None = None) -> None:
        self.session = onnx_session(path, device, threads)
        active = self.session.get_providers()[0]
        super().__init__(input_names, "cuda" if active == "CUDAExecutionProvider" else "cpu", "fp32")
        graph_inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [k for k in input_names if k not in graph_inputs]
        if missing:
            raise BackendConfigError(f"{path}: ONNX graph lacks inputs {missing}; it has {sorted(graph_inputs)}")
        self._dtypes = {k: ("int64" if "int64" in graph_inputs[k].type else "float32") for k in input_names}

    def outputs(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        feed = {k: inputs[k].numpy().astype(self._dtypes[k], copy=False) for k in self.input_names}
        return tuple(torch.from_numpy(o).float() for o in self.session.run(None, feed))


def load_backend(
    root: str | Path, manifest: dict[str, Any], plan: Plan, threads: int | None = None
) -> Backend:
    """Build the backend ``plan`` names for the artifact at ``root``."""
    root = Path(root)
    spec = manifest["model"]
    inputs = list(spec["inputs"])
    if plan.backend == "onnx":
        return OnnxBackend(root / _export_file(manifest, "onnx"), inputs, plan.device, threads)
    if plan.backend == "torchscript":
        return TorchScriptBackend(root / _export_file(manifest, "torchscript"), inputs, plan.device, plan.precision)
    if plan.backend == "aoti":
        return AotiBackend(root / _export_file(manifest, "aoti"), inputs, plan.device)
    model = load_model(root / spec["weights"], spec["config"], device=plan.device)
    model.with_features = "features" in spec.get("outputs", ["logits"])  # as the exports were traced
    model.with_layer_features = "layer_features" in spec.get("outputs", ["logits"])
    return TorchBackend(model, inputs, plan.device, plan.precision)
