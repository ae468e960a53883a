"""Inputs to model tensors, from the manifest's ``preprocessing`` only (docs/artifact.md, "Preprocessing").

* Images: bytes (JPEG, PNG, WebP) -> ``(C, H, W)`` float32, ``(uint8 / 255 - mean) / std``
  after converting to ``channels`` (L or RGB) and resizing to ``size``. The pixel
  count is checked from the header, before decoding: decompression bombs are refused.
* Texts: the artifact's own tokenizer (``tokenizers``; ``transformers`` only as a
  fallback for tokenizers without ``tokenizer.json``), truncated to ``max_length``;
  :meth:`TextPreprocessor.collate` pads to the longest text of the batch.

Each input is prepared on its own (one bad input fails only its request); the
batcher then stacks prepared inputs with ``collate``.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from service.core.errors import InvalidInput, PayloadTooLarge, ServiceError, UnsupportedMediaType
from service.core.manifest import ClipTextPreprocessing, ImagePreprocessing, TextPreprocessing

__all__ = ["ImagePreprocessor", "TextPreprocessor", "decode_base64", "make_preprocessor", "ACCEPTED_IMAGE_FORMATS"]

ACCEPTED_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
# Pillow warns between 1x and 2x MAX_IMAGE_PIXELS; we refuse above 1x ourselves, so the warning is noise.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
}
# magic numbers of image formats we recognise but do not accept (for a 415 instead of a 400)
_OTHER_FORMATS = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
)
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,", re.IGNORECASE)
_WS = re.compile(r"\s+")


def decode_base64(value: str, where: str) -> bytes:
    """Bytes of a base64 string or ``data:<mime>;base64,`` URL; :class:`InvalidInput` naming ``where`` if malformed."""
    m = _DATA_URL.match(value)
    if m:
        value = value[m.end() :]
    elif value.startswith("data:"):
        raise InvalidInput(f"{where}: a data URL must be base64 encoded (data:image/png;base64,...)")
    value = _WS.sub("", value)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInput(f"{where}: not valid base64 ({e}); send the image bytes base64-encoded or a data URL") from e
    if not data:
        raise InvalidInput(f"{where}: empty image")
    return data


class ImagePreprocessor:
    """Image bytes -> normalised ``(C, H, W)`` float32 tensor, as the manifest's ``preprocessing`` says.

    ``spec``: the manifest's :class:`~service.core.manifest.ImagePreprocessing`, or its JSON form (a builder's
    dict: ``{"type": "image", "size": [H, W], "mean": [..], "std": [..], ...}``), validated by that model.
    """

    modality = "image"
    inputs = ("pixel_values",)

    def __init__(self, spec: ImagePreprocessing | Mapping[str, Any], max_pixels: int) -> None:
        spec = spec if isinstance(spec, ImagePreprocessing) else ImagePreprocessing.model_validate(dict(spec))
        self.size = spec.size  # (H, W)
        self.channels = spec.channels
        self.mode = "L" if self.channels == 1 else "RGB"
        mean = np.asarray(spec.mean, dtype=np.float32)  # (1,) or (C,)
        std = np.asarray(spec.std, dtype=np.float32)  # (1,) or (C,), all > 0
        self.mean = np.broadcast_to(mean, (self.channels,)).reshape(-1, 1, 1).copy()  # (C, 1, 1)
        self.std = np.broadcast_to(std, (self.channels,)).reshape(-1, 1, 1).copy()  # (C, 1, 1)
        self.resample = _RESAMPLE[spec.interpolation]
        self.resize = spec.resize
        self.crop_pct = spec.crop_pct or 1.0
        self.max_pixels = int(max_pixels)
        # Pillow's own guard too (raises DecompressionBombError above 2x); ours below refuses above 1x.
        Image.MAX_IMAGE_PIXELS = self.max_pixels

    def decode(self, data: bytes, where: str = "image") -> Image.Image:
        """Open and check an encoded image; the pixel limit is checked on the header, before decoding."""
        if not data:
            raise InvalidInput(f"{where}: empty image (0 bytes); send JPEG, PNG or WebP bytes")
        try:
            im: Image.Image = Image.open(io.BytesIO(data), formats=list(ACCEPTED_IMAGE_FORMATS))
        except Image.DecompressionBombError as e:  # Pillow's own guard, at twice our limit
            size = re.search(r"\((\d+) pixels\)", str(e))  # Pillow's message gives the image's pixel count
            raise PayloadTooLarge(
                f"{where}: image has {size.group(1) + ' pixels, ' if size else ''}more than twice the limit of "
                f"{self.max_pixels} pixels (HYDRA_MAX_IMAGE_PIXELS); send a smaller image"
            ) from e
        except UnidentifiedImageError as e:
            for magic, name in _OTHER_FORMATS:
                if data.startswith(magic):
                    msg = f"{where}: {name} images are not accepted; send JPEG, PNG or WebP"
                    raise UnsupportedMediaType(msg) from e
            raise InvalidInput(f"{where}: not a decodable image; send JPEG, PNG or WebP bytes") from e
        except (OSError, ValueError, SyntaxError) as e:
            raise InvalidInput(f"{where}: unreadable image ({e})") from e
        w, h = im.size
        if w * h > self.max_pixels:
            raise PayloadTooLarge(
                f"{where}: image is {w}x{h} = {w * h} pixels, above the limit of {self.max_pixels} "
                "(HYDRA_MAX_IMAGE_PIXELS); send a smaller image"
            )
        if w < 1 or h < 1:
            raise InvalidInput(f"{where}: image has no pixels ({w}x{h})")
        try:
            im.load()
            ImageOps.exif_transpose(im, in_place=True)  # turned as its EXIF orientation says; no copy otherwise
        except Image.DecompressionBombError as e:
            raise PayloadTooLarge(f"{where}: image too large ({e})") from e
        except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt data
            raise InvalidInput(f"{where}: corrupt or truncated image ({e})") from e
        return im

    def to_tensor(self, im: Image.Image) -> torch.Tensor:
        """A decoded image -> ``(C, H, W)`` float32, converted, resized and normalised."""
        return self.normalize(self.pixels(im))

    def pixels(self, im: Image.Image) -> np.ndarray:
        """A decoded image converted to the model's colour and resized: uint8 ``(C, H, W)``, not yet normalised
        (what a training loop may keep and normalise per batch: :meth:`normalize` of it is :meth:`to_tensor`)."""
        if im.mode == "P" or im.mode == "PA":
            im = im.convert("RGBA")
        if im.mode.startswith("I") or im.mode == "F":
            im = _eight_bit(im)
        if im.mode != self.mode:
            im = im.convert(self.mode)
        arr = np.asarray(self._resized(im), dtype=np.uint8)  # (H, W) or (H, W, C)
        return np.ascontiguousarray(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))  # (C, H, W)

    def normalize(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 ``(C, H, W)`` of :meth:`pixels` -> the model's float32 input ``(C, H, W)``."""
        arr = pixels.astype(np.float32) * (1.0 / 255.0)
        return torch.from_numpy(np.ascontiguousarray((arr - self.mean) / self.std))

    def _resized(self, im: Image.Image) -> Image.Image:
        """``direct``: straight to ``size``. ``shorter_crop`` (timm's evaluation transform, ``resolve_data_config``):
        the shorter side to ``floor(size / crop_pct)`` keeping the aspect ratio, then the centre ``size`` crop
        (torchvision's ``Resize(int)`` and ``CenterCrop`` arithmetic)."""
        H, W = self.size
        if self.resize == "direct":
            return im if im.size == (W, H) else im.resize((W, H), resample=self.resample)
        w, h = im.size
        scale = math.floor(min(H, W) / self.crop_pct)  # timm: scale_size = floor(img_size / crop_pct)
        nw, nh = (scale, int(scale * h / w)) if w <= h else (int(scale * w / h), scale)
        if (nw, nh) != (w, h):
            im = im.resize((nw, nh), resample=self.resample)
        top, left = int(round((nh - H) / 2.0)), int(round((nw - W) / 2.0))
        return im.crop((left, top, left + W, top + H))

    def __call__(self, data: bytes, where: str = "image") -> torch.Tensor:
        """Encoded image bytes -> ``(C, H, W)`` float32."""
        try:
            return self.to_tensor(self.decode(data, where))
        except UnsupportedMediaType as e:
            raise UnsupportedMediaType(f"{where}: {e.message}" if not e.message.startswith(where) else e.message) from e
        except ServiceError:
            raise
        except Exception as e:  # Pillow internals on odd files (exotic modes, broken EXIF): the input's fault
            msg = f"{where}: cannot convert this image ({type(e).__name__}); send JPEG, PNG or WebP"
            raise InvalidInput(msg) from e

    def collate(self, items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``B`` prepared images -> ``{"pixel_values": (B, C, H, W)}``."""
        return {"pixel_values": torch.stack(items)}

    def example(self) -> bytes:
        """A PNG of the model's size (mid-grey), for warm-up."""
        buf = io.BytesIO()
        Image.new(self.mode, (self.size[1], self.size[0]), color=128 if self.channels == 1 else (128,) * 3).save(
            buf, format="PNG"
        )
        return buf.getvalue()


def _eight_bit(im: Image.Image) -> Image.Image:
    """A 16-bit greyscale image (PNG's ``I;16`` modes, or ``I`` with values in 0..65535) -> ``L``, scaled
    ``round(v / 257)`` so that 65535 is white: Pillow's ``convert("L")`` clips every value above 255 to white and
    turns a 16-bit photo into a silhouette. Anything else (32-bit integers beyond 16 bits, floats) is refused with a
    415: what its values mean is not in the file."""
    arr = np.asarray(im)
    if im.mode.startswith("I;16") or (im.mode == "I" and arr.size and arr.min() >= 0 and arr.max() <= 65535):
        eight = np.round(arr.astype(np.float64) / 257.0).astype(np.uint8)  # (H, W)
        return Image.fromarray(eight)  # uint8 (H, W): mode L
    raise UnsupportedMediaType(
        f"{im.mode} images ({'floating point' if im.mode == 'F' else '32-bit integer'} "
        "pixels) are not accepted; send 8- or 16-bit JPEG, PNG or WebP"
    )


class TextPreprocessor:
    """Text -> token ids with the artifact's tokenizer; :meth:`collate` pads a batch to its longest text.

    ``spec``: the manifest's :class:`~service.core.manifest.TextPreprocessing` (or the ``text`` part of a zero-shot
    artifact's image preprocessing), or its JSON form ``{"type": "text", "max_length": 48, "tokenizer":
    "tokenizer"}``: ``tokenizer`` is a directory of the artifact holding Hugging Face tokenizer files.
    """

    modality = "text"
    inputs = ("input_ids", "attention_mask")

    def __init__(self, spec: TextPreprocessing | ClipTextPreprocessing | Mapping[str, Any], root: str | Path) -> None:
        if not isinstance(spec, (TextPreprocessing, ClipTextPreprocessing)):
            spec = TextPreprocessing.model_validate(dict(spec))
        self.max_length = spec.max_length
        if self.max_length < 2:
            raise ValueError(f"preprocessing.max_length must be >= 2, got {self.max_length}")
        tok_dir = Path(root) / spec.tokenizer
        if not tok_dir.is_dir():
            raise FileNotFoundError(f"{tok_dir}: tokenizer directory named by preprocessing.tokenizer is missing")
        self._fast = None
        self._hf: Any = None  # a transformers tokenizer (callable) when the fast one is absent
        if (tok_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
            saved_padding = tok.padding
            tok.no_padding()  # the saved file may pad to a fixed length; we pad per batch
            tok.enable_truncation(self.max_length)
            self._fast = tok
            self.pad_id = self._pad_id(tok_dir, tok, saved_padding)
        else:  # slow tokenizer files only (vocab.txt, ...): the heavier transformers path
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
            self.pad_id = int(self._hf.pad_token_id or 0)

    @staticmethod
    def _pad_id(tok_dir: Path, tok: Any, saved_padding: dict[str, Any] | None) -> int:
        """The pad token's id: tokenizer_config's ``pad_token``, else tokenizer.json's padding, else [PAD]/<pad>."""
        cfg = tok_dir / "tokenizer_config.json"
        if cfg.is_file():
            pad = json.loads(cfg.read_text()).get("pad_token")
            pad = pad.get("content") if isinstance(pad, dict) else pad
            if isinstance(pad, str) and tok.token_to_id(pad) is not None:
                return int(tok.token_to_id(pad))
        if saved_padding is not None:
            return int(saved_padding["pad_id"])
        for name in ("[PAD]", "<pad>"):
            if tok.token_to_id(name) is not None:
                return int(tok.token_to_id(name))
        return 0

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (with special tokens, truncated to ``max_length``)."""
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts)]
        out = self._hf(texts, truncation=True, max_length=self.max_length, padding=False)
        return [list(ids) for ids in out["input_ids"]]

    def __call__(self, text: str, where: str = "text") -> list[int]:
        return self.encode([text])[0]

    def collate(self, items: list[list[int]]) -> dict[str, torch.Tensor]:
        """``B`` id lists -> ``{"input_ids": (B, T), "attention_mask": (B, T)}`` int64, T = longest."""
        T = max(len(ids) for ids in items)
        ids = torch.full((len(items), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), T), dtype=torch.long)
        for i, row in enumerate(items):
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def example(self) -> str:
        return "warm-up " * (self.max_length // 2)


def make_preprocessor(
    spec: ImagePreprocessing | TextPreprocessing | Mapping[str, Any], root: str | Path, max_image_pixels: int
) -> ImagePreprocessor | TextPreprocessor:
    """The preprocessor of a manifest's ``preprocessing`` block (typed, or its JSON form)."""
    if isinstance(spec, ImagePreprocessing):
        return ImagePreprocessor(spec, max_image_pixels)
    if isinstance(spec, TextPreprocessing):
        return TextPreprocessor(spec, root)
    kind = spec.get("type")
    if kind == "image":
        return ImagePreprocessor(spec, max_image_pixels)
    if kind == "text":
        return TextPreprocessor(spec, root)
    raise ValueError(f"preprocessing.type {kind!r} is not 'image' or 'text'")
