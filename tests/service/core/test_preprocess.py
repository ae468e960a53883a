"""Preprocessing from the manifest: known pixel values, resizing, refused inputs, the artifact's tokenizer."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from service.core.artifact import ImagePreprocessing
from service.core.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.core.preprocess import ImagePreprocessor, TextPreprocessor, decode_base64
from tests.service.helpers import b64, png

GREY = {"type": "image", "size": [16, 16], "mean": [0.5], "std": [0.25], "interpolation": "bilinear", "channels": 1}
# the manifest's typed block, as the server hands it (GREY: the JSON form); RGB and the image type are its defaults
RGB = ImagePreprocessing(size=(8, 12), mean=[0.1, 0.2, 0.3], std=[0.5, 0.25, 0.125], interpolation="bicubic")


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels but holds (almost) no data: a bomb that must not decode."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def test_image_known_values():
    pre = ImagePreprocessor(GREY, max_pixels=10_000)
    arr = np.arange(256, dtype=np.uint8).reshape(16, 16)
    x = pre(png(arr))
    assert x.shape == (1, 16, 16) and x.dtype == torch.float32
    expected = (arr.astype(np.float32) / 255 - 0.5) / 0.25
    np.testing.assert_allclose(x[0].numpy(), expected, rtol=0, atol=1e-6)
    batch = pre.collate([x, x])
    assert batch["pixel_values"].shape == (2, 1, 16, 16)


def test_image_rgb_converted_and_resized():
    pre = ImagePreprocessor(RGB, max_pixels=10_000)
    x = pre(png(200, size=(30, 20), mode="RGB"))  # (W, H) = (30, 20) -> resized to H=8, W=12
    assert x.shape == (3, 8, 12)
    for c, (m, s) in enumerate(zip(RGB.mean, RGB.std, strict=True)):
        torch.testing.assert_close(x[c], torch.full((8, 12), (200 / 255 - m) / s), atol=1e-5, rtol=0)
    grey_in = pre(png(100, size=(12, 8), mode="L"))  # greyscale input -> 3 equal channels before normalising
    raw = grey_in * torch.tensor(RGB.std).view(3, 1, 1) + torch.tensor(RGB.mean).view(3, 1, 1)
    torch.testing.assert_close(raw, torch.full((3, 8, 12), 100 / 255), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_other_accepted_formats(fmt):
    pre = ImagePreprocessor(GREY, max_pixels=10_000)
    x = pre(png(77, size=(16, 16), fmt=fmt))
    assert torch.allclose(x, torch.full_like(x, (77 / 255 - 0.5) / 0.25), atol=0.05)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_refused_before_decoding():
    pre = ImagePreprocessor(GREY, max_pixels=1_000_000)
    # decoding these would fail (no pixel data): a 413 shows the size was checked on the header, first
    with pytest.raises(PayloadTooLarge, match=r"limit of 1000000 pixels \(HYDRA_MAX_IMAGE_PIXELS\)"):
        pre(huge_png_header(20_000, 20_000))  # above 2x: Pillow's own guard (MAX_IMAGE_PIXELS) refuses it
    with pytest.raises(PayloadTooLarge, match=r"1001x1000 = 1001000 pixels.*HYDRA_MAX_IMAGE_PIXELS"):
        pre(huge_png_header(1001, 1000))  # between 1x and 2x, where Pillow only warns: ours refuses


@pytest.mark.parametrize(
    ("data", "exc", "match"),
    [
        (png(1, fmt="GIF"), UnsupportedMediaType, "GIF images are not accepted"),
        (png(1, fmt="BMP"), UnsupportedMediaType, "BMP images are not accepted"),
        (b"definitely not an image", InvalidInput, "not a decodable image"),
        (png(1, size=(64, 64))[:60], InvalidInput, "img"),  # truncated PNG
    ],
)
def test_bad_images(data, exc, match):
    pre = ImagePreprocessor(GREY, max_pixels=10_000)
    with pytest.raises(exc, match=match):
        pre(data, where="img")


def test_base64_and_data_urls():
    data = png(5)
    assert decode_base64(b64(data), "image") == data
    assert decode_base64("data:image/png;base64," + b64(data), "image") == data
    wrapped = "\n".join(b64(data)[i : i + 60] for i in range(0, len(b64(data)), 60))
    assert decode_base64(wrapped, "image") == data  # line-wrapped base64 (MIME style)
    for bad in ("not base64!!", "abc", "data:image/png,rawbytes"):
        with pytest.raises(InvalidInput, match="images\\[2\\]"):
            decode_base64(bad, "images[2]")


@pytest.fixture(scope="module")
def text_pre(artifacts):
    return TextPreprocessor({"type": "text", "max_length": 12, "tokenizer": "tokenizer"}, artifacts["bert"])


def test_tokenizer_matches_transformers(text_pre, artifacts):
    """The server's ``tokenizers`` path gives exactly what ``AutoTokenizer(padding=True, truncation=True)`` gives."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(artifacts["bert"] / "tokenizer"))
    texts = ["Hello world!", "a much longer sentence that will certainly be truncated at twelve tokens", "Ünïcödé ok"]
    want = hf(texts, padding=True, truncation=True, max_length=12, return_tensors="pt")
    got = text_pre.collate(text_pre.encode(texts))
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert got["input_ids"].shape == (3, 12)
    assert text_pre.pad_id == hf.pad_token_id


def test_missing_tokenizer_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TextPreprocessor({"type": "text", "max_length": 8, "tokenizer": "tokenizer"}, tmp_path)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    ("mode", "fmt"), [("I;16", "PNG"), ("CMYK", "JPEG"), ("LA", "PNG"), ("P", "PNG"), ("1", "PNG"), ("RGBA", "WEBP")]
)
def test_unusual_modes_are_converted(mode, fmt, channels):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (5, 7)).save(buf, format=fmt)
    pre = ImagePreprocessor({**GREY, "size": [8, 8], "channels": channels, "mean": [0.5], "std": [0.25]}, 10_000)
    x = pre(buf.getvalue())
    assert x.shape == (channels, 8, 8) and torch.isfinite(x).all()


@pytest.mark.parametrize("size", [(37, 53), (224, 160), (300, 300)])
def test_shorter_crop_is_timms_evaluation_transform(size):
    """``resize: shorter_crop`` gives the tensor timm's own eval transform gives (``resolve_data_config`` +
    ``create_transform``) for a timm ViT's data config, on images of other sizes and aspect ratios."""
    import timm
    from timm.data import create_transform, resolve_data_config

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    dc = resolve_data_config({}, model=model)
    spec = {
        "type": "image",
        "size": list(dc["input_size"][1:]),
        "mean": list(dc["mean"]),
        "std": list(dc["std"]),
        "interpolation": dc["interpolation"],
        "channels": 3,
        "resize": "shorter_crop",
        "crop_pct": dc["crop_pct"],
    }
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    pre = ImagePreprocessor(spec, 1 << 24)  # first: it sets Pillow's pixel limit, which timm's transform meets too
    want = create_transform(**dc)(im)
    got = pre.to_tensor(im)
    assert got.shape == want.shape == (3, 224, 224)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("channels", [1, 3])
def test_sixteen_bit_png_is_scaled_not_clipped(channels):
    """A 16-bit greyscale PNG gives the pixels of its 8-bit rendering (v / 257): Pillow's convert("L") would clip
    every value above 255 to white and turn the image into a silhouette."""
    import io

    deep = (np.arange(256, dtype=np.uint16).reshape(16, 16) * 257).astype(np.uint16)  # 0..65535
    deep[0, 0], deep[0, 1] = 128, 65534  # between the 8-bit levels: rounded
    buf = io.BytesIO()
    Image.fromarray(deep).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode == "I;16"
    pre = ImagePreprocessor({**GREY, "channels": channels, "mean": [0.5], "std": [0.25]}, 10_000)
    x, ref = pre(buf.getvalue()), pre(png(np.round(deep / 257).astype(np.uint8)))
    torch.testing.assert_close(x, ref, rtol=0, atol=0)
    assert float(x.std()) > 0.5  # the gradient survives (clipped, it would be nearly all white)


def test_float_pixels_are_refused_with_415():
    from service.core.preprocess import _eight_bit

    im = Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8))
    assert im.mode == "F"
    with pytest.raises(UnsupportedMediaType, match="floating point"):
        _eight_bit(im)
    wide = Image.fromarray(np.full((4, 4), 70_000, dtype=np.int32))
    with pytest.raises(UnsupportedMediaType, match="32-bit integer"):
        _eight_bit(wide)


def test_an_exif_orientation_is_applied_and_the_pixels_are_those_of_the_turned_image():
    """A JPEG whose EXIF says "rotated 90 degrees" (orientation 6) is turned before preprocessing, as the camera
    meant it: the same tensor as the turned image sent without EXIF; an image without the tag is left as it is."""
    import io

    import numpy as np
    from PIL import Image

    from service.core.preprocess import ImagePreprocessor

    pre = ImagePreprocessor({"type": "image", "size": [8, 12], "mean": [0.5], "std": [0.5], "channels": 1}, 1 << 20)
    a = np.zeros((12, 8), np.uint8)
    a[:3, :] = 255  # a white band at the top of a portrait image

    def jpeg(img: Image.Image, exif: bytes | None = None) -> bytes:
        buf = io.BytesIO()
        img.save(buf, format="PNG" if exif is None else "JPEG", **({} if exif is None else {"exif": exif}))
        return buf.getvalue()

    stored = Image.fromarray(a).transpose(Image.Transpose.ROTATE_90)  # what the sensor wrote: landscape (8 x 12)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to view
    turned = pre(jpeg(stored.convert("L"), exif.tobytes()))
    plain = pre(jpeg(Image.fromarray(a)))
    assert turned.shape == plain.shape == (1, 8, 12)
    assert abs(turned - plain).mean() < 0.2  # JPEG's loss aside, the same picture
    unturned = pre(jpeg(stored))
    assert abs(unturned - plain).mean() > 0.3
