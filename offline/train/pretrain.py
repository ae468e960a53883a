"""Pretrain an image backbone once, on in-distribution training images only: ``python -m offline.train.pretrain``.

The demo image configs (``image-fast``, ``image-full``) and the zero-shot model's image tower start from the
backbone this writes, through ``base.path``: the same code path a user's timm checkpoint takes
(:func:`offline.models.loaders.load_timm`). It is a timm ``VisionTransformer`` (the config's ``arch``, a variant of
the timm model named ``timm``) trained supervised on the six in-distribution Fashion-MNIST classes, with the
training pool of :func:`offline.data.fashion_pools` only: never the reserved images the builds validate and fit
on, never the held-out classes, digits, noise or any OOD set.

Strong augmentation (random resized crops down to ``crop_scale`` of the area, horizontal flips, label smoothing,
stochastic depth) for as long as two CPU cores allow (about an hour); the run checkpoints every ``checkpoint_every``
steps and resumes where it stopped. At the end it writes, into ``--out``:

* ``<name>.safetensors``: the weights (bf16 when ``weights_dtype: bf16``; the head included), timm's key names;
* ``<name>.json``: the record: the command, config, data (sources, pool hash, size), seed, steps, time, machine,
  the file's sha256 and the accuracy on the ID test images of the test file with the fp32 weights and with the
  stored ones (reported, never used to choose anything).

A rerun with the same config, thread count and machine gives the same weights bit for bit (every batch is a
function of the seed and step); ``tests/offline/test_pretrain.py`` checks that on a short run, and the shipped
file against its record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from offline import data as data_mod
from offline.config import read_yaml_mapping
from offline.data import Split
from offline.train import GRAY_MEAN, GRAY_STD, TrainConfig, accuracy, make_batches, recorded, train_base_vit
from service.core.artifact import file_sha256
from service.core.hardware import cpu_name

__all__ = ["PretrainConfig", "load_pretrain_config", "main", "pretrain", "test_accuracy"]

log = logging.getLogger("hydra.pretrain")
ROOT = Path(__file__).resolve().parents[1]


class PretrainError(ValueError):
    """A bad pretraining config or command line (one line, exit status 2)."""


def _dict(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise PretrainError(f"{where} must be a mapping, got {type(x).__name__}")
    return x


class PretrainConfig:
    """A pretraining config: ``name``, ``timm`` (the timm model the weights fit, with ``arch``'s overrides),
    ``arch`` (``VisionTransformer`` keyword arguments), ``train`` (:class:`offline.train.TrainConfig` fields),
    ``weights_dtype`` (``bf16`` or ``fp32``: how the weights are stored) and ``max_train`` (images of the training
    pool, stratified; default all)."""

    KEYS = ("name", "timm", "arch", "train", "weights_dtype", "max_train", "checkpoint_every")

    def __init__(self, doc: dict[str, Any]) -> None:
        unknown = sorted(set(doc) - set(self.KEYS))
        if unknown:
            raise PretrainError(f"unknown pretraining config keys {unknown}; expected some of {list(self.KEYS)}")
        self.name = str(doc.get("name", "backbone"))
        self.timm = str(doc.get("timm", "vit_tiny_patch16_224"))
        self.arch = dict(_dict(doc.get("arch", {}), "arch"))
        self.weights_dtype = str(doc.get("weights_dtype", "bf16"))
        if self.weights_dtype not in ("bf16", "fp32"):
            raise PretrainError(f"weights_dtype must be 'bf16' or 'fp32', got {self.weights_dtype!r}")
        self.max_train = doc.get("max_train")
        train = dict(_dict(doc.get("train", {}), "train"))
        train.setdefault("checkpoint_every", int(doc.get("checkpoint_every", 500)))
        try:
            self.train = TrainConfig(**train)
        except (TypeError, ValueError) as e:
            raise PretrainError(f"train: {e}") from e
        if self.train.steps < 1:
            raise PretrainError(f"train.steps must be >= 1, got {self.train.steps}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "timm": self.timm,
            "arch": self.arch,
            "train": recorded(self.train),
            "weights_dtype": self.weights_dtype,
            "max_train": self.max_train,
        }


def load_pretrain_config(path: str | Path, steps: int | None = None) -> PretrainConfig:
    """The YAML config at ``path`` (``steps`` overrides ``train.steps``)."""
    p = Path(path)
    doc = read_yaml_mapping(p, PretrainError)
    if steps is not None:
        doc = {**doc, "train": {**_dict(doc.get("train", {}), "train"), "steps": steps}}
    return PretrainConfig(doc)


def pool_data(max_train: int | None) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The training pool's images uint8 ``(N, 28, 28)``, labels ``(N,)`` (0..5, the ID classes in order) and its
    record; ``max_train`` draws that many, stratified and seeded, else all of it."""
    d = data_mod.fashion_dir()
    xtr, ytr, _, _ = data_mod.read_fashion(d)
    pool, reserved = data_mod.fashion_pools(ytr)
    if max_train is not None:
        pool = np.sort(pool[data_mod.stratified_indices(ytr[pool], int(max_train), np.random.default_rng(0))])
    rec = {
        "source": "Fashion-MNIST train file, training pool (offline.data.fashion_pools)",
        "classes": [data_mod.FASHION_CLASSES[c] for c in data_mod.FASHION_ID_CLASSES],
        "size": len(pool),
        "index_sha256": hashlib.sha256(pool.astype(np.int64).tobytes()).hexdigest()[:16],
        "reserved_left_out": len(reserved),
        "train_file_sha256": file_sha256(d / data_mod.FASHION_FILES["train_images"]),
    }
    return np.ascontiguousarray(xtr[pool]), data_mod.fashion_id_labels(ytr[pool]), rec


def test_images() -> tuple[np.ndarray, np.ndarray]:
    """The ID images of the Fashion-MNIST test file and their labels (0..5)."""
    _, _, xte, yte = data_mod.read_fashion(data_mod.fashion_dir())
    idx = np.flatnonzero(np.isin(yte, data_mod.FASHION_ID_CLASSES))
    return np.ascontiguousarray(xte[idx]), data_mod.fashion_id_labels(yte[idx])


def test_accuracy(model: torch.nn.Module) -> float:
    """Top-1 accuracy on the 6,000 ID images of the Fashion-MNIST test file (28x28, the demo normalisation)."""
    x, y = test_images()
    batches = make_batches(x, y, 500, kind="image", mean=list(GRAY_MEAN), std=list(GRAY_STD), size=[28, 28], channels=1)
    return accuracy(model, lambda m, b: m(b["pixel_values"]), batches)


def test_per_class(model: torch.nn.Module) -> dict[str, float]:
    """Top-1 accuracy per ID class on the test file's ID images, keyed by the data set's own class name."""
    return {name: round(acc, 4) for name, acc in per_class_accuracy(model, *test_images()).items()}


def per_class_accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Top-1 accuracy per ID class, keyed by the data set's own class name, of uint8 images ``x`` ``(N, 28, 28)``
    with labels ``y`` (0..5) at the demo normalisation."""
    batches = make_batches(x, y, 500, kind="image", mean=list(GRAY_MEAN), std=list(GRAY_STD), size=[28, 28], channels=1)
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(b["pixel_values"]).argmax(-1) for b, _ in batches]).numpy()
    names = [data_mod.FASHION_CLASSES[c] for c in data_mod.FASHION_ID_CLASSES]
    return {name: float(np.mean(pred[y == i] == i)) for i, name in enumerate(names)}


def _store(model: torch.nn.Module, cfg: PretrainConfig, out: Path) -> Path:
    """Write ``model``'s weights as ``cfg.weights_dtype`` into ``out`` (the file), then put the stored (rounded) values
    back into the fp32 model, so that what is measured next is what the file holds."""
    dtype = torch.bfloat16 if cfg.weights_dtype == "bf16" else torch.float32
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    weights = out / f"{cfg.name}.safetensors"
    # one metadata key: safetensors writes its metadata map in no fixed order, so two keys would make equal weights
    # two different files (the timm model's name is in the record)
    save_file(state, str(weights), metadata={"format": "pt"})
    with torch.no_grad():  # the stored weights' accuracy: the fp32 model with the rounded weights
        for k, p in model.state_dict().items():
            p.copy_(state[k].float())
    return weights


def _provenance(t0: float) -> dict[str, Any]:
    """How long the run took since ``t0``, and where and when it ran: the record's machine fields."""
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "processor": cpu_name(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def pretrain(cfg: PretrainConfig, out: Path, checkpoint_dir: Path, command: str) -> dict[str, Any]:
    """Train the backbone of ``cfg`` (resumable in ``checkpoint_dir``), write its weights and record into ``out``;
    the record."""
    t0 = time.perf_counter()
    x, y, data_rec = pool_data(cfg.max_train)
    log.info(
        "pretraining %s on %d images of the training pool (%d steps of %d)",
        cfg.name,
        len(y),
        cfg.train.steps,
        cfg.train.batch_size,
    )
    n_val = min(600, len(y))  # the end-of-training check: pool images (the reserved ones stay untouched)
    model = train_base_vit(Split(x, y), Split(x[:n_val], y[:n_val]), cfg.arch, cfg.train, checkpoint_dir=checkpoint_dir)
    acc_fp32 = test_accuracy(model)
    weights = _store(model, cfg, out)
    acc_stored = test_accuracy(model)
    per_class = test_per_class(model)
    record = {
        "name": cfg.name,
        "command": command,
        "config": cfg.to_dict(),
        "data": data_rec,
        "seed": cfg.train.seed,
        "steps": cfg.train.steps,
        "params": int(sum(p.numel() for p in model.parameters())),
        "file": weights.name,
        "bytes": weights.stat().st_size,
        "sha256": file_sha256(weights),
        "test_accuracy": {
            "fp32_weights": round(acc_fp32, 4),
            "stored_weights": round(acc_stored, 4),
            "per_class_stored_weights": per_class,
            "images": "the 6,000 ID images of the Fashion-MNIST test file (reported, not chosen on)",
        },
        **_provenance(t0),
        "load": load_spec(cfg),
    }
    (out / f"{cfg.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    log.info(
        "%s: %d params, test accuracy %.4f (fp32) / %.4f (%s weights), %s (%d bytes)",
        cfg.name,
        record["params"],
        acc_fp32,
        acc_stored,
        cfg.weights_dtype,
        weights,
        record["bytes"],
    )
    return record


def load_spec(cfg: PretrainConfig) -> dict[str, Any]:
    """How a build config loads the backbone as a user's timm checkpoint (``base.source``, ``base.arch``): the
    architecture without its training-only settings, and timm's ``pretrained_cfg_overlay`` saying that the weights
    have the six-class head and the demo's input (28x28 grey, its mean and std), so timm keeps the head."""
    arch = {k: v for k, v in cfg.arch.items() if k not in ("num_classes", "drop_path_rate")}
    size = int(cfg.arch["img_size"])
    overlay = {
        "num_classes": int(cfg.arch.get("num_classes", 6)),
        "input_size": [int(cfg.arch.get("in_chans", 1)), size, size],
        "mean": list(GRAY_MEAN),
        "std": list(GRAY_STD),
        "crop_pct": 1.0,
        "interpolation": "bilinear",
    }
    return {"base.source": f"timm:{cfg.timm}", "base.arch": {**arch, "pretrained_cfg_overlay": overlay}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offline.train.pretrain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="pretraining config (offline/configs/pretrain/fashion-vit-s.yaml)")
    ap.add_argument("--out", default=str(ROOT / "offline" / "backbones"), help="folder for the weights and record")
    ap.add_argument("--steps", type=int, default=None, help="override train.steps (a short run, e.g. a test)")
    ap.add_argument(
        "--checkpoint-dir", default=None, help="resumable training state (default .cache/pretrain/<name>-<steps>)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = load_pretrain_config(args.config, args.steps)
        ckpt = Path(args.checkpoint_dir or ROOT / ".cache" / "pretrain" / f"{cfg.name}-{cfg.train.steps}")
        command = "python -m offline.train.pretrain " + " ".join(argv if argv is not None else sys.argv[1:])
        pretrain(cfg, Path(args.out), ckpt, command)
    except (PretrainError, FileNotFoundError) as e:
        print(f"offline.train.pretrain: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
