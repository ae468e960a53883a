"""Model backends: torch eager, TorchScript, AOTInductor and ONNX Runtime, one interface.

Every backend maps a dict of input tensors (the manifest's ``model.inputs``) to the model's outputs as float32
CPU tensors, member logits ``(B, M, C)`` first. The server serves through them; the builder checks each export
against eager through the same classes (one ONNX session, one TorchScript loader), which is why they live in the
core. Which backend serves an artifact is the server's choice: :mod:`service.runtime.plan`.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from service.core.fused import GroupedLinear

__all__ = [
    "AotiBackend",
    "Backend",
    "BackendConfigError",
    "OnnxBackend",
    "TorchBackend",
    "TorchScriptBackend",
    "cast_gemm_weights",
    "onnx_session",
]

log = logging.getLogger("hydra.backends")


class BackendConfigError(ValueError):
    """The requested backend / device / precision cannot serve this artifact; the message says what to change."""


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
    """Shared by eager and TorchScript: device transfer, inference mode and bf16 autocast.

    On CUDA every input goes through a page-locked (pinned) host buffer kept per input and reused across batches, so
    that its copy to the device is asynchronous DMA rather than a staged copy through pageable memory. A buffer is
    reused only after the previous batch's outputs came back to the host (``.cpu()`` waits for the device), so no
    copy is still reading it."""

    _pinned: dict[str, torch.Tensor] | None = None

    def _to_device(self, name: str, x: torch.Tensor, dev: torch.device) -> torch.Tensor:
        if dev.type != "cuda" or x.device.type != "cpu":
            return x.to(dev, non_blocking=True)
        if self._pinned is None:
            self._pinned = {}
        buf = self._pinned.get(name)
        if buf is None or buf.dtype != x.dtype or buf.numel() < x.numel():
            buf = self._pinned[name] = torch.empty(x.numel(), dtype=x.dtype).pin_memory()
        staged = buf[: x.numel()].view(x.shape)
        staged.copy_(x)
        return staged.to(dev, non_blocking=True)

    def _run(self, fn: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        dev = torch.device(self.device)
        args = [self._to_device(k, inputs[k], dev) for k in self.input_names]
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
