"""The user's own data: an image folder (one subfolder per class) or a CSV/JSONL text file, with optional OOD sets.

Every file is checked before anything is drawn, and a problem names the file (and row or line): an unreadable
image, a missing column, an empty label, too few classes or examples.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from offline.data.common import (
    CAL_HELD_OUT,
    Data,
    HeldOut,
    Sizes,
    Split,
    dedup_labelled,
    fit_indices,
    id_records,
    normalize_text,
    split_id_pool,
    split_record,
    take,
)
from service.core.artifact import file_sha256
from service.core.jsonl import json_objects

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm"}
USER_EVAL_FRACTION = 0.15  # share of user data (per split, capped by max_val / max_test) held out for val and test
USER_OOD_VAL_FRACTION = 0.3  # share of each user OOD set carved out for validation when no ood_val_path is given
USER_SETTINGS = ("image-folder", "text-file")
# what an image-folder setting's inputs are (its record's "image" entry)
IMAGE_INPUTS = (
    "file paths, decoded per batch at the model's size and colour by the artifact's preprocessing "
    "(service/core/preprocess.py)"
)


@dataclass(frozen=True)
class UserData:
    """Where a user's data is (the ``data`` section's ``setting``, ``path``, ``ood_paths``, ``ood_val_path``)."""

    setting: str  # image-folder (one subfolder per class) | text-file (a CSV or JSONL file with text, label)
    path: str | Path  # the folder or the file of the labelled ID inputs
    # OOD sets by name: a folder of images (any nesting) or a CSV/JSONL/TXT file of texts; "near..." names are near-OOD
    ood_paths: dict[str, str] | None = None
    # OOD validation inputs; without them a share (USER_OOD_VAL_FRACTION) of every OOD set is carved out
    ood_val_path: str | Path | None = None


# ----------------------------------------------------------------------------- reading the files
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
            raise ValueError(
                f"{path}: row {i + 1} has no {' / '.join(repr(m) for m in missing)} "
                f"column (found {sorted(r)}); expected columns 'text' and 'label'"
            )
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
        try:
            rows = [obj for _, obj in json_objects(text.splitlines())]
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
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
    source = {
        "path": str(root),
        "files": len(files),
        "file_list_sha256": hashlib.sha256("\n".join(str(f.relative_to(root)) for f in files).encode()).hexdigest()[
            :16
        ],
    }
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


# ----------------------------------------------------------------------------- the setting
def _user_sizes(n: int, s: Sizes) -> list[tuple[str, int]]:
    """The ID splits' sizes of ``n`` labelled examples, in the order they are drawn."""
    n_eval = max(1, round(USER_EVAL_FRACTION * n))
    n_test, n_val = min(s.max_test, n_eval), min(s.max_val, n_eval)
    if n - n_test - n_val < 1:
        raise ValueError(f"{n} labelled examples are too few to split into train, val and test (need at least 3)")
    # the calibration split takes up to another eval fraction, and never the last training example
    n_cal = max(0, min(s.max_calibration, n_eval, n - n_test - n_val - 1))
    sizes = [("test", n_test), ("val", n_val)] + ([("calibration", n_cal)] if n_cal else [])
    return sizes + [("train", min(s.max_train, n - n_test - n_val - n_cal))]


def _check_user_paths(source: UserData) -> tuple[Path, dict[str, str]]:
    """Fail early, before anything is read, on an unknown setting or a missing path: ``(data root, ood_paths)``."""
    if source.setting not in USER_SETTINGS:
        raise ValueError(f"user data setting must be 'image-folder' or 'text-file', got {source.setting!r}")
    root = Path(source.path)
    if not root.exists():
        raise ValueError(f"data path {root} does not exist")
    ood_paths = dict(source.ood_paths or {})  # none at all is fine: the threshold then comes from ID validation alone
    for name, p in ood_paths.items():
        if not Path(p).exists():
            raise ValueError(f"OOD set {name!r}: {p} does not exist")
    if source.ood_val_path is not None and not Path(source.ood_val_path).exists():
        raise ValueError(f"OOD validation path {source.ood_val_path} does not exist")
    return root, ood_paths


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
            ood_val[name] = take(x, perm[:n_val])
            rec_val[name] = {
                "from": str(ood_paths[name]),
                "carved_fraction": USER_OOD_VAL_FRACTION,
                "kind": kind,
                **split_record(perm[:n_val]),
            }
        test_idx = perm[n_val : n_val + max_ood]
        ood_test[name] = (take(x, test_idx), kind)
        rec_test[name] = {"from": str(ood_paths[name]), "kind": kind, "available": len(x), **split_record(test_idx)}
    if ood_val_path is not None:
        x = _read_ood(ood_val_path, image)
        pick = rng.permutation(len(x))[:max_ood]
        ood_val["ood-val"] = take(x, pick)
        rec_val["ood-val"] = {"from": str(ood_val_path), "available": len(x), **split_record(pick)}
    given = bool(ood_paths) or ood_val_path is not None
    if given and (not ood_val or sum(len(v) for v in ood_val.values()) == 0):
        raise ValueError("no OOD validation inputs: give data.ood_val_path, or OOD sets with at least 2 inputs each")
    return ood_val, ood_test, rec_val, rec_test


def user_setting(source: UserData, sizes: Sizes) -> Data:
    """Your data (``source``): ``image-folder`` (one subfolder per class) or ``text-file`` (CSV/JSONL with text, label).

    ID data is split stratified into test / val / calibration / train (each ``USER_EVAL_FRACTION`` of the data
    for val, test and calibration, capped by ``sizes.max_val`` / ``max_test`` / ``max_calibration``; the calibration
    split never takes the last training example). The fit split is the train split, unless ``sizes.max_train``
    leaves inputs unused: then up to ``sizes.fit`` of those. ``source.ood_paths`` maps a set name to a folder of
    images (any nesting) or a CSV/JSONL/TXT file of texts; a set is near-OOD if its name starts with "near", else
    far. ``source.ood_val_path`` holds OOD validation inputs; without it a disjoint ``USER_OOD_VAL_FRACTION`` of
    every OOD set is carved out for validation.
    """
    root, ood_paths = _check_user_paths(source)
    rng = np.random.default_rng(sizes.seed)
    image = source.setting == "image-folder"
    inputs: np.ndarray | list[str]
    class_names, inputs, y, id_source = (_read_image_classes if image else _read_text_classes)(root)
    y_arr = np.asarray(y, dtype=np.int64)
    # the ID split draws from rng before the OOD sets do: that order fixes every split for a seed
    idx = split_id_pool(y_arr, _user_sizes(len(y_arr), sizes), rng)
    cal_idx = idx.pop("calibration", None)
    ood_val, ood_test, rec_val, rec_test = _user_ood_sets(ood_paths, source.ood_val_path, image, sizes.max_ood, rng)
    used = [*idx.values(), *([cal_idx] if cal_idx is not None else [])]
    fit_idx, fit_rec = fit_indices(y_arr, used, sizes.fit, sizes.seed)
    # the calibration split came with the ID splits (a share of the data, as val and test)
    cal_source = CAL_HELD_OUT if cal_idx is not None else "none (max_calibration = 0)"
    held = HeldOut(fit_idx, fit_rec, cal_idx, {"source": cal_source})

    def split(ids: np.ndarray) -> Split:
        return Split(take(inputs, ids), y_arr[ids])

    train = split(idx["train"])
    fit = train if held.fit is None else split(held.fit)
    splits = {
        "setting": source.setting,
        "seed": sizes.seed,
        "requested": sizes.requested(),
        "sources": {"id": id_source},
        "classes": {"label_order": class_names},
        "eval_fraction": USER_EVAL_FRACTION,
        "id": id_records(idx, y_arr, class_names, held),
        "ood_val": rec_val,
        "ood_test": rec_test,
        "indices_into": "sorted file list (images) or deduplicated rows in file order (texts)",
    }
    if image:
        splits["image"] = {"inputs": IMAGE_INPUTS}
    calibration = None if cal_idx is None else split(cal_idx)
    modality = "image" if image else "text"
    return Data(
        modality, class_names, train, split(idx["val"]), split(idx["test"]), ood_val, ood_test, splits, fit, calibration
    )
