"""Request parsing: a JSON or multipart inference request -> one typed :class:`ParsedRequest`.

Both inference endpoints take the same two media types (docs/api.md): ``application/json``
(any ``+json`` type too), validated by the endpoint's pydantic model of
:mod:`service.api.schemas` (unknown fields refused by name), with images as base64; and
``multipart/form-data``, with images as ``file`` parts and the options as form fields.
Anything else is 415 ``unsupported_media_type``. Whichever way a request came,
:func:`parse_request` gives the same :class:`ParsedRequest`, so the rest of the path
(limits, model, inputs, answer) is one for both endpoints and both media types.

A multipart form holds the uploaded parts until it is closed: :func:`parse_request` closes
it when parsing fails, :meth:`ParsedRequest.close` after the inputs are prepared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.error_bodies import format_validation_errors, validate_json_body
from service.api.schemas import FormOptions, PredictRequest, ZeroShotRequest, check_limits
from service.core.artifact import DEFAULT_TEMPLATE
from service.core.errors import InvalidInput, UnsupportedMediaType
from service.runtime import Query
from service.settings import Settings

__all__ = ["ParsedRequest", "check_labels", "normalise_label", "parse_json_body", "parse_labels", "parse_request"]

# the endpoint's task -> its JSON body, and the option fields its multipart form accepts besides `file`
JSON_BODIES: dict[str, type[PredictRequest] | type[ZeroShotRequest]] = {
    "classification": PredictRequest,
    "zero-shot": ZeroShotRequest,
}
FORM_FIELDS: dict[str, frozenset[str]] = {
    "classification": frozenset(
        {"model", "top_k", "return_members", "return_scores", "alpha", "ood_alpha", "risk", "adaptive"}
    ),
    "zero-shot": frozenset(
        {"model", "top_k", "return_members", "return_scores", "labels", "template", "alpha", "ood_alpha", "risk"}
        | {"adaptive"}
    ),
}
NO_FILES: dict[str, str] = {
    "classification": "file: no file parts; send one or more images as 'file' (curl -F file=@img.png)",
    "zero-shot": "file: no file parts; send one or more images as 'file'",
}


@dataclass
class ParsedRequest:
    """One inference request, whichever endpoint and media type it came by."""

    task: str  # the endpoint's: classification (/predict, OIP) or zero-shot (/zero-shot, OIP with labels)
    modality: str  # image or text
    field: str  # the inputs' name in error messages: text, texts, image, images, file (OIP: its input's name)
    items: list[Any]  # texts, base64 images (JSON), image bytes (multipart, OIP binary) or (C, H, W) tensors
    base64_encoded: bool
    model: str | None  # the model asked for, if any
    query: Query
    form: FormData | None = None  # the multipart form, open until close()
    # the items are model inputs already (the Open Inference Protocol's FP32 tensor): no decoding, no preprocessing
    preprocessed: bool = False

    def check_limits(self, settings: Settings) -> None:
        """Raise :class:`InvalidInput` naming the field when the request exceeds a configured limit."""
        check_limits(
            self.items,
            self.field,
            max_items=settings.max_items,
            max_chars=settings.max_text_chars if self.modality == "text" else None,
            labels=self.query.labels,
            max_labels=settings.max_labels,
            max_label_chars=settings.max_text_chars,
        )

    async def close(self) -> None:
        """Release the multipart form's uploaded parts (nothing for JSON)."""
        if self.form is not None:
            await self.form.close()


def media_type(request: Request) -> str:
    """The request's media type, lower case, without parameters ('' when there is no Content-Type)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def parse_request(request: Request, task: str, max_items: int) -> ParsedRequest:
    """Parse the body of an inference request for the endpoint of ``task``; raises naming what is wrong."""
    media = media_type(request)
    if media == "application/json" or media.endswith("+json"):
        return from_json(await parse_json(request, JSON_BODIES[task]), task)
    if media == "multipart/form-data":
        return await parse_multipart(request, task, max_items)
    raise UnsupportedMediaType(
        f"Content-Type {media or '(none)'!r} is not accepted; send application/json or multipart/form-data"
    )


async def parse_json(request: Request, model: type[BaseModel]) -> Any:
    """The body validated by ``model``: 400 for an empty or malformed body, 422 naming the fields that do not fit."""
    return validate_json_body(await request.body(), model, "one UTF-8 encoded JSON object")


def parse_json_body(body: bytes, task: str) -> ParsedRequest:
    """A JSON body of the endpoint of ``task`` (read already) as a :class:`ParsedRequest`, as :func:`parse_request`
    gives it for a JSON request."""
    return from_json(validate_json_body(body, JSON_BODIES[task], "one UTF-8 encoded JSON object"), task)


def from_json(req: PredictRequest | ZeroShotRequest, task: str) -> ParsedRequest:
    """A validated JSON body as a :class:`ParsedRequest` (images base64-encoded)."""
    items = req.items
    if isinstance(req, ZeroShotRequest):
        # a single image is `image` in error messages, whichever of `image` / `images` carried it
        field = "images" if len(items) > 1 else "image"
        query = options_query(req, check_labels(req.labels), req.template)
        return ParsedRequest(task, "image", field, items, True, req.model, query)
    field = next(k for k in ("text", "texts", "image", "images") if getattr(req, k) is not None)
    return ParsedRequest(task, req.modality, field, items, True, req.model, options_query(req))


async def parse_multipart(request: Request, task: str, max_items: int) -> ParsedRequest:
    """``file`` parts and option fields of a multipart form; unknown fields are refused by name.

    The form is closed here when the request is refused, else by :meth:`ParsedRequest.close`.
    """
    try:
        form = await request.form(max_files=max_items + 1, max_fields=64, max_part_size=1024 * 1024)
    except StarletteHTTPException as e:  # python-multipart / Starlette refused the body (limits, syntax)
        raise InvalidInput(
            f"multipart body refused: {e.detail}; send at most {max_items} 'file' parts (HYDRA_MAX_ITEMS), "
            "64 fields and 1 MiB per field"
        ) from None
    try:
        files, opts = await read_form(form, FORM_FIELDS[task])
        if not files:
            raise InvalidInput(NO_FILES[task])
        labels = None
        if task == "zero-shot":
            if opts.labels is None:
                raise InvalidInput("labels: required; send two or more labels", status=422)
            labels = check_labels(opts.labels)
    except BaseException:
        await form.close()
        raise
    query = options_query(opts, labels, opts.template)
    return ParsedRequest(task, "image", "file", files, False, opts.model, query, form)


def options_query(
    opts: PredictRequest | ZeroShotRequest | FormOptions,
    labels: list[str] | None = None,
    template: str = DEFAULT_TEMPLATE,
) -> Query:
    """The :class:`Query` of a request's options, from its JSON body or its multipart form; ``labels`` (checked) and
    ``template`` are the zero-shot endpoint's."""
    return Query(
        opts.top_k,
        opts.return_members,
        labels,
        template,
        opts.return_scores,
        opts.alpha,
        opts.ood_alpha,
        opts.risk,
        adaptive=opts.adaptive,
    )


async def read_form(form: FormData, allowed: frozenset[str]) -> tuple[list[bytes], FormOptions]:
    """The bytes of the ``file`` parts, in order, and the options of the other fields (validated)."""
    files: list[bytes] = []
    options: dict[str, Any] = {}
    labels: list[str] = []
    for key, value in form.multi_items():
        if key == "file":
            if not isinstance(value, UploadFile):
                raise InvalidInput("file: must be a file part (curl -F file=@image.png)")
            files.append(await value.read())
        elif key not in allowed:
            raise InvalidInput(f"invalid request: {key}: unknown field (not accepted here)", status=422)
        elif isinstance(value, UploadFile):
            raise InvalidInput(f"{key}: must be a plain form field, not a file")
        elif key == "labels":
            labels.append(value)
        elif key in options:
            raise InvalidInput(f"{key}: given more than once")
        else:
            options[key] = value
    if labels:
        options["labels"] = parse_labels(labels)
    try:
        opts = FormOptions.model_validate(options)
    except ValidationError as e:
        raise InvalidInput(format_validation_errors(e.errors(include_url=False)), status=422) from None
    return files, opts


def parse_labels(values: list[str]) -> list[str]:
    """Multipart ``labels``: one JSON list, or one field per label, or one comma-separated field."""
    if len(values) == 1:
        v = values[0].strip()
        if v.startswith("["):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise InvalidInput(f"labels: malformed JSON list ({e.msg})") from None
            if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
                raise InvalidInput("labels: the JSON value must be a list of strings")
            return parsed
        return [x.strip() for x in v.split(",")]
    return values


def normalise_label(label: str) -> str:
    """A zero-shot label as labels are compared for duplicates: case-folded, stripped, and every run of inner
    whitespace one space (``"Dress"``, ``" dress "`` and ``"dress"`` are one label; so are ``"t-shirt  top"`` and
    ``"T-shirt top"``)."""
    return " ".join(label.casefold().split())


def _shown(label: str) -> str:
    return repr(label if len(label) <= 64 else label[:64] + "...")


def check_labels(labels: list[str]) -> list[str]:
    """A request's zero-shot labels, refused with 422 (the same on JSON, multipart and the Open Inference Protocol)
    when fewer than two, or when two are the same label once normalised (:func:`normalise_label`): the message names
    both. The limits (count, length, a visible character) are :func:`service.api.schemas.check_limits`' (400)."""
    if len(labels) < 2:
        raise InvalidInput(f"labels: {len(labels)} given; send 2 or more", status=422)
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        key = normalise_label(label)
        if not key:  # blank: check_limits names it (empty label)
            continue
        j = seen.setdefault(key, i)
        if j != i:
            raise InvalidInput(
                f"labels: duplicate labels: labels[{i}] {_shown(label)} is labels[{j}] {_shown(labels[j])} "
                "(compared case-folded, stripped, inner whitespace collapsed); give each label once",
                status=422,
            )
    return labels
