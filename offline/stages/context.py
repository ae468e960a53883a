"""The build context: what every stage of one build reads, made once by the pipeline.

A build is a chain of stages (:mod:`offline.stages`). Each stage takes the :class:`BuildContext` and returns a typed
result that the later stages take. The context holds what does not change along the chain: the validated config, the
artifact's folder, the data, the family's adapter, the base model with the artifact's preprocessing and tokenizer,
where and in which precision the work runs, and the timer whose laps go into the manifest.

It is plain data, with no behaviour of its own: a stage reads ``ctx.config.hydra`` or ``ctx.data.val`` as it would
read its own arguments.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from offline.compute import Compute, resolve_device, resolve_precision
from offline.config import BuildConfig
from offline.data import Data
from offline.families import FamilyAdapter, get_adapter

__all__ = ["BaseModel", "BuildContext", "Timer", "compute_of", "train_compute"]

log = logging.getLogger("hydra.build")


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


@dataclass
class BaseModel:
    """The base model the members are pruned from, as its family's pipeline loads it."""

    model: nn.Module  # in eval mode, on the CPU
    preprocessing: dict[str, Any]  # the artifact's preprocessing block: how the server reads an input
    tokenizer: Any  # the text tokenizer, saved into the artifact; None for image classifiers
    description: dict[str, Any]  # the manifest's base_model block


@dataclass
class BuildContext:
    """One build's config, data, base model and where it computes: what every stage reads."""

    config: BuildConfig
    out: Path  # the artifact's folder (``out/.checkpoints``: the resumable state the build's processes share)
    data: Data
    adapter: FamilyAdapter  # the family's heads, pruning and fusion
    base: BaseModel
    compute: Compute  # training and head scoring: build.device under build.precision
    evaluation: Compute  # calibration and evaluation: build.device under build.eval_precision
    timer: Timer

    @classmethod
    def create(cls, config: BuildConfig, out: Path, data: Data, base: BaseModel, timer: Timer) -> BuildContext:
        """The context of a build of ``config`` into ``out`` once its data and base model are loaded."""
        return cls(
            config=config,
            out=Path(out),
            data=data,
            adapter=get_adapter(config.family),
            base=base,
            compute=compute_of(config),
            evaluation=compute_of(config, evaluation=True),
            timer=timer,
        )


def compute_of(cfg: BuildConfig, evaluation: bool = False) -> Compute:
    """The build's device with the autocast of training and scoring, or (``evaluation``) of calibration and
    evaluation (:mod:`offline.compute`)."""
    return Compute.of(cfg.build.device, cfg.build.eval_precision if evaluation else cfg.build.precision)


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
