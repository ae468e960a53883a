"""Where a build computes, and in which precision (the ``build`` section of the config).

The policy:

* ``build.device: auto`` is CUDA when torch sees a GPU, else the CPU. Base fine-tuning, head scoring (Taylor
  gradients, circuit extraction), member fine-tuning, calibration and evaluation run there; the models come back
  to the CPU in fp32 before anything is saved, so the artifact does not depend on the build device.
* ``build.precision`` is the autocast of the heavy, gradient-carrying work: training and head scoring. ``auto`` is
  bf16 on CUDA (the paper's regime: a ViT-B/16 member fine-tunes in hours, not days) and on a CPU with native
  bf16 (``avx512_bf16`` / ``amx_bf16``: its matmuls run about twice as fast as fp32's), fp32 on other CPUs (which
  emulate bf16 several times slower than fp32). The weights and optimiser state stay fp32; only the matmuls run
  in bf16, and a run is as deterministic as in fp32 (the same config, machine and threads give the same weights).
* ``build.eval_precision`` is the autocast of calibration and evaluation: fp32 by default, because the temperature
  and the OOD threshold are fitted on these outputs and the fp32 server backends must see the same numbers for the
  same input. The bf16 server path is checked separately at export (``precision.bf16`` in the manifest).
* ``build.workers`` DataLoader processes decode and batch training inputs (a user's image files), with pinned
  memory on CUDA; each batch depends only on ``(seed, step)``, so the result does not depend on the count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from service.core.hardware import cpu_has_native_bf16

DEVICES = ("auto", "cpu", "cuda")  # and cuda:<index>
PRECISIONS = ("auto", "fp32", "bf16")

Batch = dict[str, torch.Tensor]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; a CUDA device that is not there is an error, not a silent CPU run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: torch sees no CUDA device (use auto or cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_precision(name: str, device: torch.device, native_bf16: bool | None = None) -> str:
    """``auto`` -> bf16 on CUDA and on a CPU with native bf16 (``avx512_bf16`` / ``amx_bf16``), fp32 elsewhere
    (``native_bf16``: the CPU's answer, default read from the machine)."""
    if name == "auto":
        if device.type == "cuda":
            return "bf16"
        native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        return "bf16" if native else "fp32"
    return name


@dataclass(frozen=True)
class Compute:
    """One device and one autocast precision."""

    device: torch.device
    precision: str = "fp32"  # fp32 | bf16

    @classmethod
    def of(cls, device: str = "cpu", precision: str = "fp32") -> Compute:
        d = resolve_device(device)
        return cls(d, resolve_precision(precision, d))

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on the device, or nothing."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def batch(self, batch: Batch) -> Batch:
        """``batch`` on the device (asynchronous copies from pinned memory on CUDA)."""
        return {k: v.to(self.device, non_blocking=self.cuda) for k, v in batch.items()}

    def wrap(self, fn: Callable[[Batch], Any]) -> Callable[[Batch], Any]:
        """``fn`` run on the device under this autocast, its tensor outputs back on the CPU in fp32."""

        def run(batch: Batch) -> Any:
            with self.autocast():
                return _to_cpu(fn(self.batch(batch)))

        return run


def _to_cpu(y: Any) -> Any:
    if isinstance(y, torch.Tensor):
        return y.float().cpu()
    if isinstance(y, (tuple, list)):
        return type(y)(_to_cpu(v) for v in y)
    return y


@contextlib.contextmanager
def on_device(compute: Compute, *models: torch.nn.Module) -> Iterator[None]:
    """``models`` moved to the device for the block, back to the CPU after it (what is saved lives there)."""
    for m in models:
        m.to(compute.device)
    try:
        yield
    finally:
        for m in models:
            m.to("cpu")
