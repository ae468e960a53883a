"""Synthetic outliers from ID images (offline/data/outliers.py): each corruption does what it says,
deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from offline.data.outliers import CORRUPTIONS, SHIFTS, corrupted, shifted


def _images(n: int = 12, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 28, 28), np.uint8)
    for i in range(n):  # a bright blob on black, as a Fashion-MNIST garment
        r0, c0 = rng.integers(4, 10, 2)
        x[i, r0 : r0 + 14, c0 : c0 + 12] = rng.integers(120, 255)
    return x


def test_each_corruption_in_turn_keeps_shape_and_dtype_and_is_seeded():
    x = _images()
    out = corrupted(x, seed=3)
    assert out.shape == x.shape and out.dtype == np.uint8
    assert np.array_equal(out, corrupted(x, seed=3)) and not np.array_equal(out, corrupted(x, seed=4))
    permuted = out[CORRUPTIONS.index("permute")]
    assert sorted(permuted.ravel().tolist()) == sorted(x[0].ravel().tolist())  # the histogram is kept ...
    assert not np.array_equal(permuted, x[0])  # ... the image is not
    patches = out[CORRUPTIONS.index("patches")]
    tiles = lambda a: sorted(a.reshape(7, 4, 7, 4).transpose(0, 2, 1, 3).reshape(49, 16).tolist())  # noqa: E731
    assert tiles(patches) == tiles(x[1])  # the same 4x4 patches, elsewhere
    blur = out[CORRUPTIONS.index("blur")]
    assert blur.astype(float).std() < x[2].astype(float).std()  # smoother
    contrast = out[CORRUPTIONS.index("contrast")]
    assert contrast.astype(float).std() > x[4].astype(float).std()


def test_lists_of_images_of_any_size_and_colour():
    rng = np.random.default_rng(1)
    imgs = [
        rng.integers(0, 256, (9, 13, 3), dtype=np.uint8),
        rng.integers(0, 256, (20, 20), dtype=np.uint8),
        rng.integers(0, 256, (16, 8), dtype=np.uint8),
        rng.integers(0, 256, (12, 12, 3), dtype=np.uint8),
    ]
    out = corrupted(imgs, seed=0)
    assert isinstance(out, list) and [o.shape for o in out] == [i.shape for i in imgs]
    assert corrupted([], seed=0) == []


def test_unknown_corruption_is_refused():
    from offline.data.outliers import _one

    with pytest.raises(ValueError, match="unknown corruption"):
        _one(np.zeros((4, 4), np.uint8), "melt", np.zeros((4, 4), np.uint8), np.random.default_rng(0))


def test_each_mild_shift_keeps_the_image_recognisable_and_is_seeded():
    """The shifts of the fourth validation set: each one in turn, its known effect on a blob, same shape and dtype."""
    x = _images()
    out = shifted(x, seed=3)
    assert out.shape == x.shape and out.dtype == np.uint8
    assert np.array_equal(out, shifted(x, seed=3)) and not np.array_equal(out, shifted(x, seed=4))
    pix = out[SHIFTS.index("pixelate")].astype(int)
    assert np.array_equal(pix[0::2, 0::2], pix[1::2, 1::2])  # 2x2 blocks of one value
    sp = out[SHIFTS.index("speckle")]
    changed = sp != x[1]
    assert 0.01 < changed.mean() < 0.08 and set(np.unique(sp[changed]).tolist()) <= {0, 255}
    post = out[SHIFTS.index("posterize")]
    assert set(np.unique(post).tolist()) <= {0, 85, 170, 255}
    moved = out[SHIFTS.index("translate")]
    assert moved.astype(float).sum() > 0 and not np.array_equal(moved, x[3])
    assert abs(int(moved.astype(bool).sum()) - int(x[3].astype(bool).sum())) <= 14 * 3  # the blob moved, whole
    gamma = out[SHIFTS.index("gamma")].astype(float)
    assert not np.allclose(gamma, x[2]) and gamma[x[2] == 0].max() == 0  # black stays black
    sheared = out[SHIFTS.index("shear")]
    assert sheared.shape == (28, 28) and not np.array_equal(sheared, x[5])
    colour = [np.random.default_rng(2).integers(0, 256, (10, 14, 3), dtype=np.uint8) for _ in range(6)]
    assert [o.shape for o in shifted(colour, seed=0)] == [(10, 14, 3)] * 6
    assert shifted([], seed=0) == []
