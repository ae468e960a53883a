"""Shifted copies of ID inputs: the corruptions of the report's shift section, for any data set.

An ensemble's uncertainty earns its keep when the inputs drift away from the training data without leaving its
classes (Ovadia et al. 2019, "Can you trust your model's uncertainty?"). The shift section measures that on
corrupted copies of the ID test split; each corruption has five severities, all of which the report uses by default
(``data.shift_severities``, as ImageNet-C is reported) and the stream benchmark (``benchmarks/stream.py``) too:

=================  ==========================================  =============================================
corruption         what it does                                severity 1 / 2 / 3 / 4 / 5
=================  ==========================================  =============================================
``noise``          additive Gaussian noise on [0, 1] pixels    sigma 0.08 / 0.12 / 0.18 / 0.26 / 0.38
``blur``           Gaussian blur (Pillow)                      sigma 0.5 / 0.75 / 1.0 / 1.25 / 1.5 px per 28 px
``contrast``       pixels pulled to the image's mean           contrast 0.4 / 0.3 / 0.2 / 0.15 / 0.1
``jpeg``           JPEG round trip (Pillow)                    quality 25 / 18 / 12 / 9 / 6
``rotation``       rotation about the centre, bilinear         10 / 15 / 20 / 27 / 35 degrees, random sign
``typos``          one typo in a share of the words            30 / 45 / 60 / 80 / 100 % of the words
``drop``           words removed (one is always kept)          15 / 22 / 30 / 40 / 50 % of the words
=================  ==========================================  =============================================

The image levels are ImageNet-C's (Hendrycks & Dietterich 2019) where a level is defined on [0, 1] pixels
(noise: its five levels; contrast: its levels 1 to 4 and one between 3 and 4), within its range for JPEG (25 to 7),
and scaled to the image's side where a level is defined in pixels (blur). Severities 1, 3 and 5 are the three
levels the report had before it had five (``data.shift_severities: [1, 3, 5]`` gives that section again). A
typo is one of: two neighbouring letters swapped, a letter deleted, a letter doubled, a letter replaced by a
neighbour on a QWERTY keyboard. Every corruption is a function of ``(inputs, severity, seed)`` only: the same
call gives the same copies.

    shifted = corrupt(data.test.inputs, "blur", 2, seed=0)   # same type and shape as the inputs

Images are uint8 arrays ``(N, H, W)`` / ``(N, H, W, 3)`` (as the demo settings hold them) or lists of image
files (as a user's folder does; corrupted copies come back as uint8 arrays of the files' own sizes, RGB).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageFilter

IMAGE_CORRUPTIONS = ("noise", "blur", "contrast", "jpeg", "rotation")
TEXT_CORRUPTIONS = ("typos", "drop")
SEVERITIES = (1, 2, 3, 4, 5)
REPORT_SEVERITIES = (
    SEVERITIES  # the report's shift section by default (data.shift_severities; evaluation time grows with each)
)
SHIFT_PREFIX = "shift:"  # a build's shifted copies among its evaluation sets: shift:<corruption>@<severity>

NOISE_SIGMA = (0.08, 0.12, 0.18, 0.26, 0.38)  # ImageNet-C gaussian_noise levels 1 to 5
BLUR_SIGMA_PER_28PX = (0.5, 0.75, 1.0, 1.25, 1.5)
CONTRAST = (0.4, 0.3, 0.2, 0.15, 0.1)  # ImageNet-C contrast levels 1, 2, 3, (3 + 4) / 2, 4
JPEG_QUALITY = (25, 18, 12, 9, 6)
ROTATION_DEG = (10.0, 15.0, 20.0, 27.0, 35.0)
TYPO_SHARE = (0.3, 0.45, 0.6, 0.8, 1.0)
DROP_SHARE = (0.15, 0.22, 0.3, 0.4, 0.5)

QWERTY = ("qwertyuiop", "asdfghjkl", "zxcvbnm")


def corruptions(modality: str) -> tuple[str, ...]:
    """The corruptions of a modality (``"image"`` or ``"text"``)."""
    if modality not in ("image", "text"):
        raise ValueError(f"no corruptions for modality {modality!r}: image or text")
    return IMAGE_CORRUPTIONS if modality == "image" else TEXT_CORRUPTIONS


def corrupt(
    inputs: np.ndarray | Sequence[str], kind: str, severity: int, seed: int = 0, modality: str | None = None
) -> np.ndarray | list[str]:
    """Corrupted copies of ``inputs`` (images or texts) by ``kind`` at ``severity`` (1 to 5), seeded.

    ``modality`` says whether a list of strings holds texts or image files (default: texts unless ``kind`` is
    an image corruption)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    if kind in TEXT_CORRUPTIONS:
        if isinstance(inputs, np.ndarray) or modality == "image":
            raise ValueError(f"{kind!r} corrupts texts; these inputs are images")
        return corrupt_texts(list(inputs), kind, severity, seed)
    if kind not in IMAGE_CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}: one of {IMAGE_CORRUPTIONS + TEXT_CORRUPTIONS}")
    if not isinstance(inputs, np.ndarray):
        if modality == "text":
            raise ValueError(f"{kind!r} corrupts images; these inputs are texts")
        return [corrupt_image(_load(p), kind, severity, _seed(seed, i)) for i, p in enumerate(inputs)]  # type: ignore[return-value]
    return np.stack([corrupt_image(x, kind, severity, _seed(seed, i)) for i, x in enumerate(inputs)])


def _seed(seed: int, i: int) -> np.random.Generator:
    return np.random.default_rng([seed, i, 0x5EED])


def _load(path: str) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


# ----------------------------------------------------------------------------- images
def corrupt_image(x: np.ndarray, kind: str, severity: int, rng: np.random.Generator) -> np.ndarray:
    """One uint8 image ``(H, W)`` or ``(H, W, 3)`` corrupted; same shape and dtype."""
    level = severity - 1
    if kind == "noise":
        noisy = x / 255.0 + rng.normal(0.0, NOISE_SIGMA[level], x.shape)
        return _to_uint8(noisy * 255.0)
    if kind == "contrast":
        mean = x.astype(np.float64).mean()
        return _to_uint8((x - mean) * CONTRAST[level] + mean)
    im = Image.fromarray(x)
    if kind == "blur":
        radius = BLUR_SIGMA_PER_28PX[level] * min(x.shape[:2]) / 28.0
        out = im.filter(ImageFilter.GaussianBlur(radius))
    elif kind == "jpeg":
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=JPEG_QUALITY[level])
        buf.seek(0)
        with Image.open(buf) as decoded:
            out = decoded.convert(im.mode)
    else:  # rotation: the sign drawn per image, so the set does not lean one way
        angle = ROTATION_DEG[level] * (1 if rng.random() < 0.5 else -1)
        out = im.rotate(angle, resample=Image.Resampling.BILINEAR, fillcolor=0 if im.mode == "L" else (0, 0, 0))
    return np.asarray(out, dtype=np.uint8).reshape(x.shape)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------- texts
def corrupt_texts(texts: list[str], kind: str, severity: int, seed: int = 0) -> list[str]:
    """Each text with ``kind`` (``typos`` or ``drop``) applied at ``severity``; words split on whitespace."""
    level = severity - 1
    out = []
    for i, text in enumerate(texts):
        rng = _seed(seed, i)
        words = text.split()
        if kind == "typos":
            hit = rng.random(len(words)) < TYPO_SHARE[level]
            words = [typo(w, rng) if h and any(c.isalpha() for c in w) else w for w, h in zip(words, hit, strict=True)]
        elif words:
            keep = rng.random(len(words)) >= DROP_SHARE[level]
            if not keep.any():
                keep[rng.integers(len(words))] = True
            words = [w for w, k in zip(words, keep, strict=True) if k]
        out.append(" ".join(words))
    return out


def typo(word: str, rng: np.random.Generator) -> str:
    """``word`` with one typo at a letter: swap with the next letter, delete, double, or a keyboard neighbour."""
    letters = [i for i, c in enumerate(word) if c.isalpha()]
    i = letters[int(rng.integers(len(letters)))]
    op = int(rng.integers(4))
    if op == 0 and i + 1 < len(word) and word[i + 1] != word[i]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if op == 1 and len(word) > 1:
        return word[:i] + word[i + 1 :]
    if op == 2:
        return word[:i] + word[i] + word[i:]
    near = _neighbours(word[i].lower())
    c = near[int(rng.integers(len(near)))] if near else word[i]
    return word[:i] + (c.upper() if word[i].isupper() else c) + word[i + 1 :]


def _neighbours(c: str) -> str:
    """Letters next to ``c`` on its QWERTY row (left and right); empty for a letter off the keyboard."""
    for row in QWERTY:
        j = row.find(c)
        if j >= 0:
            return row[max(0, j - 1) : j] + row[j + 1 : j + 2]
    return ""
