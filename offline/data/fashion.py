"""The Fashion-MNIST setting: the six garments in distribution, footwear and bags near-OOD, digits and noise far.

The IDX files come from ``$HYDRA_DATA_DIR/fashion-mnist`` or Debian's ``dataset-fashion-mnist`` package. The train
file's ID images are split once into a training pool and reserved images (:func:`fashion_pools`), the same for
every seed and size: no model trained on the pool has seen the images a build validates, fits and calibrates on.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from offline.data.common import (
    ROOT,
    Data,
    HeldOut,
    Sizes,
    Split,
    class_counts,
    held_out,
    index_hash,
    split_record,
    stratified_indices,
)
from offline.data.digits import DIGITS_SOURCE, digits_ood
from offline.data.noise import NOISE_KINDS, synthetic_images
from offline.data.outliers import CORRUPTIONS, SHIFTS, corrupted, shifted
from service.core.artifact import file_sha256

SYSTEM_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = [  # the data set's documented label order (pinned to torchvision's list in the tests)
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
FASHION_ID_CLASSES = (0, 1, 2, 3, 4, 6)  # the six garments in distribution ...
FASHION_OOD_CLASSES = (5, 7, 8, 9)  # ... footwear (Sandal, Sneaker, Ankle boot) and Bag held out as near-OOD
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
# The Fashion-MNIST train file's ID images are split once, the same way for every seed and size: 1,000 images per
# class are reserved for validation and the fit split (and never trained on: not by a build's base model or members,
# nor by the image backbone offline.train.pretrain trains); the other 30,000 form the training pool
FASHION_RESERVED_PER_CLASS = 1000
FASHION_POOL_SEED = 20261124  # the generator of that one split (not data.seed: the pools must not move with it)


def fashion_dir() -> Path:
    """Folder with the Fashion-MNIST IDX gz files: ``$HYDRA_DATA_DIR/fashion-mnist``, else the Debian package's."""
    base = Path(os.environ.get("HYDRA_DATA_DIR", ROOT / ".cache" / "datasets")) / "fashion-mnist"
    for d in (base, SYSTEM_FASHION_DIR):
        if all((d / f).is_file() for f in FASHION_FILES.values()):
            return d
    raise FileNotFoundError(
        f"Fashion-MNIST not found under {base} or {SYSTEM_FASHION_DIR}; run `bash scripts/fetch_data.sh` "
        "(installs or extracts Debian's dataset-fashion-mnist)"
    )


def read_idx_images(path: Path) -> np.ndarray:
    """IDX3 gz file -> uint8 ``(N, 28, 28)``."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    n, h, w = (int.from_bytes(raw[i : i + 4], "big") for i in (4, 8, 12))
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, h, w)


def read_idx_labels(path: Path) -> np.ndarray:
    """IDX1 gz file -> int64 ``(N,)``."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    return np.frombuffer(raw, dtype=np.uint8, offset=8).astype(np.int64)


@lru_cache(maxsize=1)
def _read_fashion(folder: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images, train labels, test images, test labels (read-only arrays, read once per process)."""
    d = Path(folder)
    out = (
        read_idx_images(d / FASHION_FILES["train_images"]),
        read_idx_labels(d / FASHION_FILES["train_labels"]),
        read_idx_images(d / FASHION_FILES["test_images"]),
        read_idx_labels(d / FASHION_FILES["test_labels"]),
    )
    for a in out:
        a.flags.writeable = False
    return out


def read_fashion(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images ``(60000, 28, 28)``, train labels, test images ``(10000, 28, 28)``, test labels of the
    Fashion-MNIST files in ``folder`` (read-only arrays, read once per process)."""
    return _read_fashion(str(folder))


def fashion_pools(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(training pool, reserved pool)``: indices of the ID images of the Fashion-MNIST train file (``labels``: its
    labels), split once by :data:`FASHION_POOL_SEED`: :data:`FASHION_RESERVED_PER_CLASS` images per ID class are
    reserved (validation, the fit split), the rest is the training pool (base models, members, the backbone).
    Both sorted."""
    rng = np.random.default_rng(FASHION_POOL_SEED)
    reserved = np.concatenate(
        [rng.permutation(np.flatnonzero(labels == c))[:FASHION_RESERVED_PER_CLASS] for c in FASHION_ID_CLASSES]
    )
    pool = np.setdiff1d(np.flatnonzero(np.isin(labels, FASHION_ID_CLASSES)), reserved)
    return pool, np.sort(reserved)


def fashion_id_labels(official: np.ndarray) -> np.ndarray:
    """The setting's labels (0..5, :data:`FASHION_ID_CLASSES` in order; -1 for the held-out classes) of official
    Fashion-MNIST labels (0..9), int64."""
    remap = np.full(10, -1, dtype=np.int64)
    remap[list(FASHION_ID_CLASSES)] = np.arange(len(FASHION_ID_CLASSES))
    return remap[official]


@dataclass
class _Indices:
    """Where each split comes from: indices into the train file (``pool``, ``reserved``, ``train``, ``val``,
    ``near_val``, ``held``: the fit and calibration splits) or the test file (``test``, ``near_test``)."""

    pool: np.ndarray
    reserved: np.ndarray
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    near_val: np.ndarray
    near_test: np.ndarray
    held: HeldOut


def _draw(ytr: np.ndarray, yte: np.ndarray, s: Sizes, rng: np.random.Generator) -> _Indices:
    """The ID and near-OOD splits, drawn from ``rng`` in a fixed order, then the fit and calibration splits from the
    reserved images (from their own generators)."""
    pool, reserved = fashion_pools(ytr)
    ood_tr = np.flatnonzero(np.isin(ytr, FASHION_OOD_CLASSES))
    id_te = np.flatnonzero(np.isin(yte, FASHION_ID_CLASSES))
    ood_te = np.flatnonzero(np.isin(yte, FASHION_OOD_CLASSES))
    # (split, the indices it is drawn from, their file's labels, its size), in the order they are drawn
    plan = (
        ("val", reserved, ytr, s.max_val),
        ("train", pool, ytr, s.max_train),
        ("test", id_te, yte, s.max_test),
        ("near_val", ood_tr, ytr, s.max_ood),
        ("near_test", ood_te, yte, s.max_ood),
    )
    drawn = {name: among[stratified_indices(labels[among], n, rng)] for name, among, labels, n in plan}
    return _Indices(pool, reserved, **drawn, held=held_out(ytr, [drawn["val"]], s, pool=reserved))


def fashion_mnist_setting(sizes: Sizes) -> Data:
    """Fashion-MNIST: the six garments (0-4, 6) in distribution, footwear and bags (5, 7-9) near-OOD, digits, noise far.

    Train and val come from the official train file (disjoint), test from the test file;
    near-OOD val / test from the held-out classes of the train / test files. Train is drawn from the train
    file's training pool, val and the fit split (``sizes.fit``) from its reserved images (:func:`fashion_pools`), so
    no model trained on the pool has seen them; the calibration split (``max_calibration``) from the reserved images
    in neither.
    """
    d = fashion_dir()
    xtr, ytr, xte, yte = _read_fashion(str(d))
    rng = np.random.default_rng(sizes.seed)
    class_names = [FASHION_CLASSES[c] for c in FASHION_ID_CLASSES]
    ix = _draw(ytr, yte, sizes, rng)
    digits_up, dval, dtest = digits_ood(sizes.max_ood, rng)
    noise_seed = int(rng.integers(2**31))

    def split(x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> Split:
        return Split(np.ascontiguousarray(x[idx]), fashion_id_labels(y[idx]))

    train, val, test = split(xtr, ytr, ix.train), split(xtr, ytr, ix.val), split(xte, yte, ix.test)
    fit = train if ix.held.fit is None else split(xtr, ytr, ix.held.fit)
    calibration = None if ix.held.calibration is None else split(xtr, ytr, ix.held.calibration)
    ood_val = {
        "fashion-heldout": xtr[ix.near_val],
        "digits": digits_up[dval],
        "corrupted": corrupted(val.inputs[: min(sizes.max_ood, len(val))], sizes.seed),
        "shifted": shifted(val.inputs[: min(sizes.max_ood, len(val))], sizes.seed),
    }
    ood_test = {
        "fashion-heldout": (xte[ix.near_test], "near"),
        "digits": (digits_up[dtest], "far"),
        "noise": (synthetic_images(min(sizes.max_ood, 1000), noise_seed), "far"),
    }
    splits = {
        "setting": "fashion-mnist",
        "seed": sizes.seed,
        "requested": sizes.requested(),
        **_fashion_sources(d, noise_seed, class_names),
        "id": _id_records(ix, {"train": train, "val": val, "test": test}, fashion_id_labels(ytr)),
        "pools": _pool_records(ix),
        **_fashion_ood_records((ix.near_val, ix.near_test), (dval, dtest), ood_val, ood_test),
        "image": {"size": [28, 28], "channels": 1, "dtype": "uint8"},
    }
    return Data("image", class_names, train, val, test, ood_val, ood_test, splits, fit=fit, calibration=calibration)


def _id_records(ix: _Indices, parts: dict[str, Split], labels: np.ndarray) -> dict[str, Any]:
    """The record of the ID splits (``parts``: train, val, test; ``labels``: the train file's, remapped)."""
    names = [FASHION_CLASSES[c] for c in FASHION_ID_CLASSES]
    reserved = {"from": "train file, reserved images"}
    return {
        "train": {
            "from": "train file, training pool",
            **split_record(ix.train),
            "class_counts": class_counts(parts["train"].labels, names),
        },
        "val": {**reserved, **split_record(ix.val), "class_counts": class_counts(parts["val"].labels, names)},
        "test": {
            "from": "test file",
            **split_record(ix.test),
            "class_counts": class_counts(parts["test"].labels, names),
        },
        **ix.held.records(ix.train, labels, names, **reserved),
    }


def _pool_records(ix: _Indices) -> dict[str, Any]:
    """The record of the train file's training pool and reserved images."""
    return {
        "training": {"size": len(ix.pool), "index_sha256": index_hash(ix.pool)},
        "reserved": {
            "size": len(ix.reserved),
            "index_sha256": index_hash(ix.reserved),
            "per_class": FASHION_RESERVED_PER_CLASS,
            "seed": FASHION_POOL_SEED,
        },
    }


def _fashion_sources(d: Path, noise_seed: int, class_names: list[str]) -> dict[str, Any]:
    """The ``sources`` and ``classes`` of the Fashion-MNIST setting's record."""
    return {
        "sources": {
            "fashion-mnist": {
                f: {"path": str(d / name), "sha256": file_sha256(d / name)} for f, name in FASHION_FILES.items()
            },
            "digits": DIGITS_SOURCE,
            "noise": {"kinds": list(NOISE_KINDS), "seed": noise_seed},
        },
        "classes": {
            "in_distribution": {str(c): FASHION_CLASSES[c] for c in FASHION_ID_CLASSES},
            "near_ood": {str(c): FASHION_CLASSES[c] for c in FASHION_OOD_CLASSES},
            "label_order": class_names,
        },
    }


def _fashion_ood_records(
    near: tuple[np.ndarray, np.ndarray],
    digits: tuple[np.ndarray, np.ndarray],
    ood_val: dict[str, Any],
    ood_test: dict[str, tuple[Any, str]],
) -> dict[str, Any]:
    """The Fashion-MNIST setting's ``ood_val`` and ``ood_test`` records: ``near`` and ``digits`` (val, test)
    indices."""
    return {
        "ood_val": {
            "fashion-heldout": {"from": "train file", "kind": "near", **split_record(near[0])},
            "digits": {
                "from": "load_digits, first half of a seeded permutation",
                "kind": "far",
                **split_record(digits[0]),
            },
            "corrupted": {
                "from": "the ID validation images, each corrupted (offline.data.outliers)",
                "kind": "far",
                "corruptions": list(CORRUPTIONS),
                "size": len(ood_val["corrupted"]),
            },
            "shifted": {
                "from": "the ID validation images, each under a mild shift (offline.data.outliers.shifted)",
                "kind": "shift",
                "shifts": list(SHIFTS),
                "size": len(ood_val["shifted"]),
            },
        },
        "ood_test": {
            "fashion-heldout": {"from": "test file", "kind": "near", **split_record(near[1])},
            "digits": {"from": "load_digits, second half", "kind": "far", **split_record(digits[1])},
            "noise": {"from": "synthetic", "kind": "far", "size": len(ood_test["noise"][0])},
        },
    }
