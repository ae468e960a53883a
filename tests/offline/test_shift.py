"""The shift section's corruptions (``offline/method/corruptions.py``): known answers per corruption, monotone in
severity, seeded, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from offline.method import corruptions as shift


def blobs(n: int = 6, size: int = 28) -> np.ndarray:
    """Smooth grey images uint8 ``(n, size, size)``, each a bright ellipse on black (like a garment)."""
    yy, xx = np.mgrid[:size, :size] / (size - 1) - 0.5
    out = []
    for i in range(n):
        a, b = 0.2 + 0.03 * i, 0.35 - 0.02 * i
        out.append(np.where((xx / a) ** 2 + (yy / b) ** 2 < 1, 200 - 10 * i, 0))
    return np.asarray(out, dtype=np.uint8)


@pytest.mark.parametrize("kind", shift.IMAGE_CORRUPTIONS)
def test_image_corruptions_keep_shape_are_seeded_and_grow_with_severity(kind):
    x = blobs()
    errors = []
    for severity in shift.SEVERITIES:
        y = shift.corrupt(x, kind, severity, seed=3)
        assert y.shape == x.shape and y.dtype == np.uint8
        np.testing.assert_array_equal(y, shift.corrupt(x, kind, severity, seed=3))
        errors.append(np.abs(y.astype(float) - x).mean())
    assert errors[0] > 0
    assert errors[0] < errors[1] < errors[2], errors
    rgb = np.repeat(x[..., None], 3, axis=-1)
    assert shift.corrupt(rgb, kind, 2).shape == rgb.shape


def test_noise_has_the_stated_sigma():
    grey = np.full((4, 64, 64), 128, dtype=np.uint8)  # mid-grey: no clipping at sigma 0.18
    diff = (shift.corrupt(grey, "noise", 2, seed=1).astype(float) - 128) / 255
    assert abs(diff.std() - shift.NOISE_SIGMA[1]) < 0.01
    assert abs(diff.mean()) < 0.01
    assert not np.array_equal(shift.corrupt(grey, "noise", 2, seed=1), shift.corrupt(grey, "noise", 2, seed=2))


def test_contrast_scales_the_spread_about_the_mean():
    x = blobs(3)
    for severity, c in zip(shift.SEVERITIES, shift.CONTRAST, strict=True):
        y = shift.corrupt(x, "contrast", severity).astype(float)
        for xi, yi in zip(x.astype(float), y, strict=True):
            assert yi.std() == pytest.approx(c * xi.std(), abs=0.6)  # rounding to integers
            assert yi.mean() == pytest.approx(xi.mean(), abs=0.6)


def test_blur_spreads_a_point_by_the_stated_sigma():
    size = 56
    point = np.zeros((1, size, size), dtype=np.uint8)
    point[0, size // 2, size // 2] = 255
    for severity, s in zip(shift.SEVERITIES, shift.BLUR_SIGMA_PER_28PX, strict=True):
        y = shift.corrupt(point, "blur", severity)[0].astype(float)
        w = y / y.sum()
        rows = np.arange(size) - size // 2
        var = (w.sum(axis=1) * rows**2).sum()
        assert np.sqrt(var) == pytest.approx(s * size / 28, rel=0.25)


def test_rotation_turns_a_bar_by_the_stated_angle():
    bar = np.zeros((1, 57, 57), dtype=np.uint8)
    bar[0, 27:30, 8:49] = 255
    for severity, deg in zip(shift.SEVERITIES, shift.ROTATION_DEG, strict=True):
        y = shift.corrupt(bar, "rotation", severity, seed=0)[0].astype(float)
        rr, cc = np.nonzero(y > 60)
        wts = y[rr, cc]
        cov = np.cov(np.stack([cc, -rr]), aweights=wts)  # x right, y up
        angle = np.degrees(0.5 * np.arctan2(2 * cov[0, 1], cov[0, 0] - cov[1, 1]))
        assert abs(angle) == pytest.approx(deg, abs=2.0)


def test_jpeg_equals_a_pillow_round_trip_at_the_stated_quality():
    import io

    x = blobs(2)
    y = shift.corrupt(x, "jpeg", 3)
    buf = io.BytesIO()
    Image.fromarray(x[1]).save(buf, format="JPEG", quality=shift.JPEG_QUALITY[2])
    np.testing.assert_array_equal(y[1], np.asarray(Image.open(buf)))


def test_image_files_come_back_as_arrays(tmp_path):
    paths = []
    for i, x in enumerate(blobs(2)):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(x).save(paths[-1])
    y = shift.corrupt(paths, "blur", 1, modality="image")
    assert len(y) == 2 and y[0].shape == (28, 28, 3) and y[0].dtype == np.uint8


def damerau(a: str, b: str) -> int:
    """Optimal string alignment distance (insert, delete, substitute, swap neighbours)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


TEXTS = ["the delivery was late again and nobody called", "Great phone, best purchase ever!", "ok"] * 200


def corrupted_words(kind: str, severity: int, seed: int) -> list[tuple[list[str], list[str]]]:
    """Each text of :data:`TEXTS` and its corruption, split into words."""
    out = shift.corrupt(TEXTS, kind, severity, seed=seed)
    return [(a.split(), b.split()) for a, b in zip(TEXTS, out, strict=True)]


@pytest.mark.parametrize("severity", shift.SEVERITIES)
def test_typos_change_the_stated_share_of_words_by_one_edit(severity):
    pairs = corrupted_words("typos", severity, seed=5)
    changed = total = 0
    for wa, wb in pairs:
        assert len(wa) == len(wb)
        for x, y in zip(wa, wb, strict=True):
            total += 1
            changed += x != y
            assert damerau(x, y) <= 1
    share = shift.TYPO_SHARE[severity - 1]
    assert changed / total == pytest.approx(share, abs=4 * np.sqrt(share * (1 - share) / total) + 0.02)
    assert shift.corrupt(TEXTS, "typos", severity, seed=5) == shift.corrupt(TEXTS, "typos", severity, seed=5)


@pytest.mark.parametrize("severity", shift.SEVERITIES)
def test_drop_removes_the_stated_share_and_keeps_order_and_one_word(severity):
    pairs = corrupted_words("drop", severity, seed=1)
    for wa, wb in pairs:
        assert 1 <= len(wb) <= len(wa)
        it = iter(wa)
        assert all(w in it for w in wb)  # a subsequence: order kept
    kept, total = sum(len(wb) for _, wb in pairs), sum(len(wa) for wa, _ in pairs)
    share = shift.DROP_SHARE[severity - 1]
    assert 1 - kept / total == pytest.approx(share, abs=0.03)


def test_bad_requests_are_one_clear_error():
    with pytest.raises(ValueError, match="severity"):
        shift.corrupt(blobs(1), "blur", 6)
    with pytest.raises(ValueError, match="unknown corruption"):
        shift.corrupt(blobs(1), "fog", 1)
    with pytest.raises(ValueError, match="corrupts texts"):
        shift.corrupt(blobs(1), "typos", 1)
    with pytest.raises(ValueError, match="corrupts images"):
        shift.corrupt(["a text"], "blur", 1, modality="text")
    with pytest.raises(ValueError, match="modality"):
        shift.corruptions("audio")
    assert shift.corruptions("image") == shift.IMAGE_CORRUPTIONS
