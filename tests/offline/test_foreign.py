"""The foreign-image test set (offline/data/foreign.py): every kind, deterministic, images a server accepts."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from offline.data.foreign import FOREIGN_KINDS, NINE_INPUTS, foreign_images, nine_inputs
from service.core.preprocess import ImagePreprocessor

PREP = {"type": "image", "size": [28, 28], "mean": [0.286], "std": [0.353], "channels": 1, "resize": "direct"}


def test_every_kind_several_sizes_deterministic():
    a = foreign_images(0)
    counts = Counter(f.kind for f in a)
    assert set(counts) == set(FOREIGN_KINDS) and min(counts.values()) >= 10 and len(a) >= 200
    assert len({f.pixels.shape[:2] for f in a}) >= 5  # from 28x28 to photographs
    assert {f.pixels.ndim for f in a} == {2, 3} and all(f.pixels.dtype == np.uint8 for f in a)
    b = foreign_images(0)
    assert all(np.array_equal(x.pixels, y.pixels) and x.name == y.name for x, y in zip(a, b, strict=True))
    c = foreign_images(1)
    assert not all(np.array_equal(x.pixels, y.pixels) for x, y in zip(a, c, strict=True) if x.kind == "noise")
    # leaving a kind out changes none of the others
    only = foreign_images(0, kinds=("pattern",))
    assert [f.name for f in only] == [f.name for f in a if f.kind == "pattern"]
    with pytest.raises(ValueError, match="unknown foreign-image kinds"):
        foreign_images(0, kinds=("video",))


def test_the_nine_inputs_and_that_a_server_decodes_every_image():
    nine = nine_inputs()
    assert [f.name for f in nine] == list(NINE_INPUTS)
    assert (nine[2].pixels == 255).all() and (nine[8].pixels == 0).all() and nine[6].pixels.shape[2] == 3
    pre = ImagePreprocessor(PREP, 1 << 22)
    for f in [*nine, *foreign_images(0)[::7]]:
        buf = io.BytesIO()
        Image.fromarray(f.pixels).save(buf, format="PNG")
        assert pre(buf.getvalue(), f.name).shape == (1, 28, 28)
