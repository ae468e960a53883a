"""Hostile input: each request gets the contract's error code and a message that says what is wrong, and the
server stays ready and answers a good request right after. (Bodies of 100 MB are sent to a real server in
test_live_server.py.)"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image

from tests.service.core.test_preprocess import huge_png_header
from tests.service.helpers import assert_error, b64, noise_images, png

NO_ZS_MODEL = "no zero-shot model is loaded"


def _noise_png(size: int = 64) -> bytes:
    return png(noise_images(1, size=size, seed=3)[0], size=(size, size))


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(noise_images(1, size=64, seed=4)[0]).save(buf, format=fmt)
    return buf.getvalue()


def _corrupt_png() -> bytes:
    data = bytearray(_noise_png())
    for i in range(60, len(data) - 20):  # keep the signature and IHDR, scramble the pixel data
        data[i] ^= 0x5A
    return bytes(data)


def _json(body: Any) -> dict[str, Any]:
    return {"json": body}


def _raw(content: bytes, ctype: str = "application/json") -> dict[str, Any]:
    return {"content": content, "headers": {"content-type": ctype}}


def _files(*parts: tuple[str, bytes, str], **data: str) -> dict[str, Any]:
    return {"files": [("file", p) for p in parts], "data": data}


IMG = b64(png(1))
ZS = {"image": IMG}  # a zero-shot body without labels

# (id, path, request kwargs (built lazily), status, code, message fragments)
CASES: list[tuple[str, str, Callable[[], dict[str, Any]], int, str, list[str]]] = [
    # images
    (
        "corrupt-png",
        "/predict",
        lambda: _json({"image": b64(_corrupt_png())}),
        400,
        "invalid_input",
        ["image: corrupt or truncated image"],
    ),
    (
        "truncated-png",
        "/predict",
        lambda: _json({"image": b64(_noise_png()[:200])}),
        400,
        "invalid_input",
        ["image: corrupt or truncated image"],
    ),
    (
        "truncated-jpeg",
        "/predict",
        lambda: _json({"images": [IMG, b64(_encoded("JPEG")[:300])]}),
        400,
        "invalid_input",
        ["images[1]: ", "image ("],
    ),
    (
        "truncated-webp",
        "/predict",
        lambda: _files(("a.webp", _encoded("WEBP")[:100], "image/webp")),
        400,
        "invalid_input",
        ["file: unreadable image"],
    ),
    (
        "decompression-bomb",
        "/predict",
        lambda: _json({"image": b64(huge_png_header(30_000, 30_000))}),
        413,
        "payload_too_large",
        ["image: image has 900000000 pixels", "HYDRA_MAX_IMAGE_PIXELS"],
    ),
    (
        "bomb-multipart",
        "/predict",
        lambda: _files(("b.png", huge_png_header(50_000, 40_000), "image/png")),
        413,
        "payload_too_large",
        ["file: image has 2000000000 pixels", "HYDRA_MAX_IMAGE_PIXELS"],
    ),
    (
        "text-as-png",
        "/predict",
        lambda: _files(("a.png", b"just some text, not an image", "image/png")),
        400,
        "invalid_input",
        ["file: not a decodable image", "JPEG, PNG or WebP"],
    ),
    (
        "text-as-data-url",
        "/predict",
        lambda: _json({"image": "data:image/png;base64," + b64(b"<html>hi</html>")}),
        400,
        "invalid_input",
        ["image: not a decodable image"],
    ),
    (
        "gif",
        "/predict",
        lambda: _json({"image": b64(png(1, fmt="GIF"))}),
        415,
        "unsupported_media_type",
        ["GIF images are not accepted"],
    ),
    (
        "bad-base64",
        "/predict",
        lambda: _json({"image": "%%%not base64%%%"}),
        400,
        "invalid_input",
        ["image: not valid base64"],
    ),
    (
        "empty-file-part",
        "/predict",
        lambda: _files(("a.png", b"", "image/png")),
        400,
        "invalid_input",
        ["file: empty image (0 bytes)"],
    ),
    (
        "10000-images",
        "/predict",
        lambda: _json({"images": [IMG] * 10_000}),
        400,
        "invalid_input",
        ["images: 10000 inputs", "HYDRA_MAX_ITEMS"],
    ),
    (
        "10000-file-parts",
        "/predict",
        lambda: _files(*[("a.png", b"x", "image/png")] * 10_000),
        400,
        "invalid_input",
        ["multipart body refused", "HYDRA_MAX_ITEMS"],
    ),
    # bodies
    ("0-byte-json", "/predict", lambda: _raw(b""), 400, "invalid_input", ["empty request body"]),
    (
        "0-byte-multipart",
        "/predict",
        lambda: _raw(b"", "multipart/form-data; boundary=x"),
        400,
        "invalid_input",
        ["file: no file parts"],
    ),
    (
        "multipart-no-boundary",
        "/predict",
        lambda: _raw(b"abc", "multipart/form-data"),
        400,
        "invalid_input",
        ["multipart body refused"],
    ),
    (
        "no-content-type",
        "/predict",
        lambda: {"content": b'{"text": "a"}'},
        415,
        "unsupported_media_type",
        ["(none)", "application/json"],
    ),
    (
        "xml",
        "/predict",
        lambda: _raw(b"<text>a</text>", "application/xml"),
        415,
        "unsupported_media_type",
        ["application/xml"],
    ),
    (
        "nested-json",
        "/predict",
        lambda: _raw(b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        400,
        "invalid_input",
        ["malformed JSON", "recursion limit"],
    ),
    (
        "nested-objects",
        "/predict",
        lambda: _raw(b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        400,
        "invalid_input",
        ["malformed JSON"],
    ),
    (
        "non-utf8-json",
        "/predict",
        lambda: _raw(b'{"text": "caf\xe9 \xff"}'),
        400,
        "invalid_input",
        ["malformed JSON", "UTF-8"],
    ),
    (
        "utf16-json",
        "/predict",
        lambda: _raw('{"text": "a"}'.encode("utf-16")),
        400,
        "invalid_input",
        ["malformed JSON", "UTF-8"],
    ),
    ("lone-surrogate", "/predict", lambda: _raw(b'{"text": "\\ud800 x"}'), 400, "invalid_input", ["malformed JSON"]),
    ("json-array", "/predict", lambda: _raw(b"[1, 2, 3]"), 422, "invalid_input", ["invalid request"]),
    ("json-string", "/predict", lambda: _raw(b'"text"'), 422, "invalid_input", ["invalid request"]),
    # texts
    (
        "1mb-text",
        "/predict",
        lambda: _json({"text": "a" * 1_000_000}),
        400,
        "invalid_input",
        ["text: 1000000 characters", "HYDRA_MAX_TEXT_CHARS"],
    ),
    (
        "1mb-text-in-list",
        "/predict",
        lambda: _json({"texts": ["ok", "é" * 1_000_000]}),
        400,
        "invalid_input",
        ["texts[1]: 1000000 characters"],
    ),
    (
        "10000-texts",
        "/predict",
        lambda: _json({"texts": ["a"] * 10_000}),
        400,
        "invalid_input",
        ["texts: 10000 inputs", "HYDRA_MAX_ITEMS"],
    ),
    (
        "control-chars-only",
        "/predict",
        lambda: _json({"text": "\x00\x01\x07\x1b\x7f"}),
        400,
        "invalid_input",
        ["text: empty text", "control characters"],
    ),
    (
        "invisible-only",
        "/predict",
        lambda: _json({"texts": ["ok", "\u200b\u200e\ufeff \u2060"]}),
        400,
        "invalid_input",
        ["texts[1]: empty text"],
    ),
    ("whitespace-only", "/predict", lambda: _json({"text": " \t\n\u3000"}), 400, "invalid_input", ["empty text"]),
    # wrong types, unknown fields
    *[
        (
            f"type-{k}-{type(v).__name__}-{i}",
            "/predict",
            (lambda base=base, k=k, v=v: _json({**base, k: v})),
            422,
            "invalid_input",
            [k],
        )
        for i, (base, k, v) in enumerate(
            [
                ({}, "text", 1),
                ({}, "text", ["a"]),
                ({}, "text", {"a": 1}),
                ({}, "text", True),
                ({}, "texts", "a"),
                ({}, "texts", [1]),
                ({}, "texts", [["a"]]),
                ({}, "texts", {}),
                ({}, "image", 1),
                ({}, "image", [IMG]),
                ({}, "images", IMG),
                ({}, "images", [1]),
                ({"text": "a"}, "model", 1),
                ({"text": "a"}, "model", ["tiny-bert"]),
                ({"text": "a"}, "top_k", "3"),
                ({"text": "a"}, "top_k", 2.5),
                ({"text": "a"}, "top_k", True),
                ({"text": "a"}, "top_k", None),
                ({"text": "a"}, "top_k", [3]),
                ({"text": "a"}, "return_members", "yes"),
                ({"text": "a"}, "return_members", 1),
                ({"text": "a"}, "return_members", None),
            ]
        )
    ],
    (
        "unknown-field",
        "/predict",
        lambda: _json({"text": "a", "colour": "red"}),
        422,
        "invalid_input",
        ["colour: unknown field"],
    ),
    (
        "10000-unknown-fields",
        "/predict",
        lambda: _json({"text": "a", **{f"f{i}": i for i in range(10_000)}}),
        422,
        "invalid_input",
        ["f0: unknown field", "(and 9995 more)"],
    ),
    (
        "unknown-form-field",
        "/predict",
        lambda: _files(("a.png", png(1), "image/png"), colour="red"),
        422,
        "invalid_input",
        ["colour: unknown field"],
    ),
    (
        "form-top_k-text",
        "/predict",
        lambda: _files(("a.png", png(1), "image/png"), top_k="many"),
        422,
        "invalid_input",
        ["top_k"],
    ),
    (
        "text-and-image",
        "/predict",
        lambda: _json({"text": "a", "image": IMG}),
        422,
        "invalid_input",
        ["exactly one of text, texts, image, images"],
    ),
    # top_k
    (
        "top_k-0",
        "/predict",
        lambda: _json({"text": "a", "top_k": 0}),
        422,
        "invalid_input",
        ["top_k: Input should be greater than or equal to 1"],
    ),
    ("top_k-negative", "/predict", lambda: _json({"text": "a", "top_k": -5}), 422, "invalid_input", ["top_k"]),
    ("top_k-inf", "/predict", lambda: _raw(b'{"text": "a", "top_k": 1e999}'), 422, "invalid_input", ["top_k"]),
    # zero-shot labels and templates: refused before the (missing) zero-shot model is looked for
    ("labels-missing", "/zero-shot", lambda: _json(ZS), 422, "invalid_input", ["labels: Field required"]),
    ("labels-empty", "/zero-shot", lambda: _json({**ZS, "labels": []}), 422, "invalid_input", ["labels", "at least 2"]),
    ("labels-one", "/zero-shot", lambda: _json({**ZS, "labels": ["cat"]}), 422, "invalid_input", ["at least 2"]),
    (
        "labels-duplicated",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["cat", "dog", "cat"]}),
        422,
        "invalid_input",
        ["labels: duplicate labels"],
    ),
    (
        "labels-10000",
        "/zero-shot",
        lambda: _json({**ZS, "labels": [f"l{i}" for i in range(10_000)]}),
        400,
        "invalid_input",
        ["labels: 10000 given", "HYDRA_MAX_LABELS"],
    ),
    (
        "label-empty",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["cat", ""]}),
        400,
        "invalid_input",
        ["labels[1]: empty label"],
    ),
    (
        "label-control",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["\x00", "cat"]}),
        400,
        "invalid_input",
        ["labels[0]: empty label"],
    ),
    (
        "label-1mb",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["cat", "x" * 1_000_000]}),
        400,
        "invalid_input",
        ["labels[1]: 1000000 characters"],
    ),
    ("labels-not-strings", "/zero-shot", lambda: _json({**ZS, "labels": [1, 2]}), 422, "invalid_input", ["labels[0]"]),
    ("labels-a-string", "/zero-shot", lambda: _json({**ZS, "labels": "cat,dog"}), 422, "invalid_input", ["labels"]),
    (
        "template-no-placeholder",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["a", "b"], "template": "a photo"}),
        422,
        "invalid_input",
        ["template must contain the placeholder {label}"],
    ),
    (
        "template-attribute",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["a", "b"], "template": "{label.__class__.__mro__}"}),
        422,
        "invalid_input",
        ["template may only hold the placeholder {label}"],
    ),
    (
        "template-positional",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["a", "b"], "template": "{label} {0}"}),
        422,
        "invalid_input",
        ["found {0}"],
    ),
    (
        "template-unbalanced",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["a", "b"], "template": "{label} }"}),
        422,
        "invalid_input",
        ["not a valid format string"],
    ),
    (
        "template-type",
        "/zero-shot",
        lambda: _json({**ZS, "labels": ["a", "b"], "template": 3}),
        422,
        "invalid_input",
        ["template"],
    ),
    (
        "zs-image-and-images",
        "/zero-shot",
        lambda: _json({**ZS, "images": [IMG], "labels": ["a", "b"]}),
        422,
        "invalid_input",
        ["exactly one of image, images"],
    ),
    (
        "zs-form-labels-empty",
        "/zero-shot",
        lambda: _files(("a.png", png(1), "image/png"), labels="[]"),
        422,
        "invalid_input",
        ["labels: 0 given"],
    ),
    (
        "zs-form-labels-dup",
        "/zero-shot",
        lambda: _files(("a.png", png(1), "image/png"), labels="cat,cat"),
        422,
        "invalid_input",
        ["duplicate"],
    ),
    (
        "zs-form-labels-10000",
        "/zero-shot",
        lambda: _files(("a.png", png(1), "image/png"), labels=",".join(f"l{i}" for i in range(10_000))),
        400,
        "invalid_input",
        ["labels: 10000 given"],
    ),
    (
        "zs-form-template",
        "/zero-shot",
        lambda: _files(("a.png", png(1), "image/png"), labels="a,b", template="{label!r}"),
        422,
        "invalid_input",
        ["template may only hold the placeholder {label}, found {label!r}"],
    ),
    (
        "zs-form-labels-bad-json",
        "/zero-shot",
        lambda: _files(("a.png", png(1), "image/png"), labels="[1, 2"),
        400,
        "invalid_input",
        ["labels: malformed JSON list"],
    ),
]


def assert_hostile_error(r, status: int, code: str, fragments: list[str]) -> None:
    """The contract's error body (:func:`assert_error`), with a short message that does not mention models."""
    msg = assert_error(r, status, code, *fragments)["error"]["message"]
    assert len(msg) < 2000
    assert NO_ZS_MODEL not in msg  # validation comes before the model is looked for


def assert_still_serving(client) -> None:
    assert client.get("/readyz").status_code == 200
    r = client.post("/predict", json={"image": b64(png(9))})
    assert r.status_code == 200 and r.json()["model"] == "tiny-vit"


@pytest.mark.parametrize(
    ("path", "make", "status", "code", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_request(client, path, make, status, code, fragments):
    r = client.post(path, **make())
    assert_hostile_error(r, status, code, fragments)
    assert_still_serving(client)


def test_case_ids_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


def test_valid_but_odd_inputs_are_answered(client):
    """Control characters inside real text, mixed scripts, emoji and bidi marks; a huge ``top_k`` (clamped)."""
    texts = [
        "Hello мир 世界 مرحبا नमस्ते 🙂",
        "tab\tnul\x00bell\x07 rtl\u202eoverride",
        "ｆｕｌｌ ｗｉｄｔｈ",
        "a" * 10_000,
    ]
    r = client.post("/predict", json={"texts": texts, "top_k": 10**30})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert len(preds) == len(texts) and all(len(p["top_k"]) == 4 for p in preds)
    r = client.post("/predict", json={"image": IMG, "top_k": 2**63})
    assert r.status_code == 200 and len(r.json()["predictions"][0]["top_k"]) == 4
    r = client.post("/predict", files=[("file", ("\xff/../../x.png", png(2), "image/png"))], data={"top_k": "9" * 40})
    assert r.status_code == 200
    # JSON with a charset parameter and a +json media type
    r = client.post(
        "/predict",
        content=json.dumps({"text": "ok"}).encode(),
        headers={"content-type": "application/vnd.api+json; charset=utf-8"},
    )
    assert r.status_code == 200
    # a zero-shot request valid in every respect reaches the model lookup (none loaded: 400 naming that)
    r = client.post("/zero-shot", json={**ZS, "labels": ["cat", "dog"], "template": "{{x}} a {label} {label}"})
    assert r.status_code == 400 and NO_ZS_MODEL in r.json()["error"]["message"]
    assert_still_serving(client)
