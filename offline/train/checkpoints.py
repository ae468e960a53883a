"""Training checkpoints: a resumable run's weights and state, saved every few steps and restored on a rerun.

A checkpoint of step ``s`` is two files in the run's folder: ``model-{s:07d}.safetensors`` (the weights) and
``state-{s:07d}.pt`` (optimizer, scheduler, step, RNG states and the run's fingerprint, with ``torch.save``). The
state file is written last, each file through a temporary name, so a run killed at any point leaves either a
complete checkpoint or none; only the newest one is kept. A checkpoint is resumed only by a run with the same
fingerprint (its config, data size and model: :func:`offline.train.loop.fingerprint`).

The loaders of a user's pretrained checkpoints (:func:`check_keys`, :func:`load_timm`) live in
:mod:`offline.models.loaders`; they are importable from here too, where the builder first had them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offline.models.loaders import check_keys, load_timm

__all__ = ["check_keys", "completed_steps", "load_timm", "restore", "save", "steps"]

log = logging.getLogger("hydra.train")


def steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint (weights and state) in ``folder``, ascending."""
    out = []
    for p in folder.glob("state-*.pt"):
        step = int(p.stem.split("-")[1])
        if (folder / f"model-{step:07d}.safetensors").is_file():
            out.append(step)
    return sorted(out)


def completed_steps(folder: Path) -> int:
    """The step of the last complete checkpoint in ``folder`` (0: none)."""
    done = steps(Path(folder)) if Path(folder).is_dir() else []
    return done[-1] if done else 0


def save(folder: Path, step: int, model: nn.Module, opt: Any, sched: Any, fingerprint: str) -> None:
    """Write the checkpoint of ``step`` into ``folder`` (made if need be) and delete the older ones."""
    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    w, s = folder / f"model-{step:07d}.safetensors", folder / f"state-{step:07d}.pt"
    save_model(model, str(w.with_suffix(".tmp")))
    w.with_suffix(".tmp").replace(w)
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "fingerprint": fingerprint,
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, s.with_suffix(".tmp"))
    s.with_suffix(".tmp").replace(s)  # the state file is written last: its presence marks a complete checkpoint
    for old in steps(folder):
        if old != step:
            (folder / f"model-{old:07d}.safetensors").unlink(missing_ok=True)
            (folder / f"state-{old:07d}.pt").unlink(missing_ok=True)


def restore(folder: Path, model: nn.Module, opt: Any, sched: Any, fingerprint: str) -> int:
    """Restore the last checkpoint of ``folder`` into model/optimizer/scheduler/RNG; the step to resume at (0: none,
    or one made with another ``fingerprint``)."""
    from safetensors.torch import load_model

    done = steps(folder) if folder.is_dir() else []
    if not done:
        return 0
    step = done[-1]
    state = torch.load(folder / f"state-{step:07d}.pt", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        log.warning("checkpoint in %s was made with another config or model: starting over", folder)
        return 0
    device = next(model.parameters()).device
    load_model(model, str(folder / f"model-{step:07d}.safetensors"), strict=True, device=str(device))
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    log.info("resuming from %s at step %d", folder, step)
    return int(state["step"])
