"""The Open Inference Protocol (KServe V2) REST bodies: the inference request in, the inference answer out.

Requests are JSON (``$inference_request``): ``inputs`` with ``name``, ``shape``, ``datatype`` and ``data`` (flat or
nested, row-major), optional ``outputs`` and ``parameters``. The binary tensor data extension is supported both
ways: with an ``Inference-Header-Content-Length`` header the body is that many bytes of JSON followed by the raw
data of every input whose ``parameters.binary_data_size`` says how many bytes it takes (BYTES elements: a 4-byte
little-endian length, then the bytes; numbers little-endian). Outputs are sent the same way when asked for
(``parameters.binary_data_output`` on the request, ``parameters.binary_data`` per output); the answer then has the
same header, and ``Content-Type: application/octet-stream``.

This module turns bytes into :class:`Tensor` s and back (:func:`decode_request`, :func:`encode_answer`); what the
tensors mean for a model (names, shapes, which output holds what) is :mod:`service.api.oip`. Errors raise
:class:`~service.core.errors.InvalidInput` naming the tensor at fault.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from service.api.error_bodies import validate_json_body
from service.core.errors import InvalidInput

__all__ = [
    "HEADER_LENGTH",
    "InferRequest",
    "OutputRequest",
    "Tensor",
    "TensorIn",
    "decode_request",
    "encode_answer",
]

HEADER_LENGTH = "inference-header-content-length"
# the protocol's datatypes this server reads and writes, as little-endian numpy dtypes (BYTES: Python objects)
DTYPES: dict[str, str] = {
    "BOOL": "?",
    "UINT8": "u1",
    "INT8": "i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
    "BYTES": "O",
}
_LENGTH = struct.Struct("<I")


class TensorIn(BaseModel):
    """``$request_input``: one input tensor, its data in JSON (``data``) or in binary (``binary_data_size``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    shape: list[int] = Field(max_length=8)
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None


class OutputRequest(BaseModel):
    """``$request_output``: an output asked for; ``parameters.binary_data``: send it as binary data."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """``$inference_request``. ``model_name`` / ``model_version`` (sent by some clients) must match the path's."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=256)
    model_name: str | None = None
    model_version: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorIn] = Field(min_length=1)
    outputs: list[OutputRequest] | None = None


@dataclass
class Tensor:
    """A decoded tensor: ``data`` of ``shape`` (BYTES: an object array of ``bytes`` from binary data, of ``str``
    from JSON)."""

    name: str
    datatype: str
    data: np.ndarray


def decode_request(body: bytes, header_length: str | None) -> tuple[InferRequest, dict[str, Tensor]]:
    """The request and its input tensors by name, from a JSON body or JSON + binary data."""
    raw = b""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidInput("Inference-Header-Content-Length is not an integer") from None
        if not 0 < n <= len(body):
            raise InvalidInput(f"Inference-Header-Content-Length {n} is not within the body's {len(body)} bytes")
        body, raw = body[:n], body[n:]
    req = _parse_json(body)
    tensors: dict[str, Tensor] = {}
    offset = 0
    for t in req.inputs:
        if t.name in tensors:
            raise InvalidInput(f"inputs: {t.name!r} is given twice")
        tensors[t.name], offset = _decode_tensor(t, raw, offset)
    if offset != len(raw):
        raise InvalidInput(f"{len(raw) - offset} bytes of binary data follow the inputs' (binary_data_size)")
    return req, tensors


def _parse_json(body: bytes) -> InferRequest:
    return validate_json_body(body, InferRequest, "an inference request (a JSON object with 'inputs')")


def _decode_tensor(t: TensorIn, raw: bytes, offset: int) -> tuple[Tensor, int]:
    """One input: its JSON data, or its bytes of the binary data at ``offset``; returns the offset after it."""
    if t.datatype not in DTYPES:
        raise InvalidInput(f"{t.name}: datatype {t.datatype!r} is not one of {sorted(DTYPES)}")
    if any(d < 0 for d in t.shape):
        raise InvalidInput(f"{t.name}: shape {t.shape} has a negative dimension")
    count = math.prod(t.shape)
    size = (t.parameters or {}).get("binary_data_size")
    if size is None:
        if t.data is None:
            raise InvalidInput(f"{t.name}: no data; send 'data' or binary data (parameters.binary_data_size)")
        data = _from_json(t, count)
    else:
        if t.data is not None:
            raise InvalidInput(f"{t.name}: both 'data' and parameters.binary_data_size are given; send one")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(raw):
            raise InvalidInput(f"{t.name}: binary_data_size {size!r} does not fit the {len(raw) - offset} bytes left")
        data = _from_binary(t, raw[offset : offset + size], count)
        offset += size
    return Tensor(t.name, t.datatype, data.reshape(t.shape)), offset


def _flatten(value: Any) -> list[Any]:
    """Nested JSON lists (row-major) -> one flat list."""
    if not isinstance(value, list):
        return [value]
    out: list[Any] = []
    for v in value:
        out.extend(_flatten(v))
    return out


def _from_json(t: TensorIn, count: int) -> np.ndarray:
    flat = _flatten(t.data)
    if len(flat) != count:
        raise InvalidInput(f"{t.name}: {len(flat)} values for shape {t.shape} ({count} elements)")
    if t.datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise InvalidInput(f"{t.name}: BYTES data in JSON must be strings")
        arr = np.empty(count, dtype=object)
        arr[:] = flat
        return arr
    if t.datatype == "BOOL" and not all(isinstance(v, bool) for v in flat):
        raise InvalidInput(f"{t.name}: BOOL data must be true or false")
    if t.datatype != "BOOL" and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise InvalidInput(f"{t.name}: {t.datatype} data must be numbers")
    try:
        return np.asarray(flat, dtype=DTYPES[t.datatype])
    except (OverflowError, ValueError) as e:
        raise InvalidInput(f"{t.name}: values do not fit {t.datatype} ({e})") from None


def _from_binary(t: TensorIn, chunk: bytes, count: int) -> np.ndarray:
    if t.datatype == "BYTES":
        items = _split_bytes(t.name, chunk)
        if len(items) != count:
            raise InvalidInput(f"{t.name}: {len(items)} elements in the binary data for shape {t.shape}")
        arr = np.empty(count, dtype=object)
        arr[:] = items
        return arr
    dtype = np.dtype(DTYPES[t.datatype])
    if len(chunk) != count * dtype.itemsize:
        raise InvalidInput(f"{t.name}: {len(chunk)} bytes of binary data for {count} {t.datatype} values")
    return np.frombuffer(chunk, dtype=dtype).copy()


def _split_bytes(name: str, chunk: bytes) -> list[bytes]:
    """Binary BYTES: each element is a 4-byte little-endian length followed by that many bytes."""
    out: list[bytes] = []
    i = 0
    while i < len(chunk):
        if i + 4 > len(chunk):
            raise InvalidInput(f"{name}: binary BYTES data ends inside an element's length")
        (n,) = _LENGTH.unpack_from(chunk, i)
        if i + 4 + n > len(chunk):
            raise InvalidInput(f"{name}: binary BYTES element {len(out)} is longer than the data left")
        out.append(chunk[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def _to_binary(datatype: str, arr: np.ndarray) -> bytes:
    """An output's binary data: BYTES length-prefixed (UTF-8 strings), numbers little-endian, BOOL one byte each."""
    if datatype == "BYTES":
        parts = [x if isinstance(x, bytes) else str(x).encode() for x in arr.reshape(-1)]
        return b"".join(_LENGTH.pack(len(p)) + p for p in parts)
    return np.ascontiguousarray(arr, dtype=DTYPES[datatype]).tobytes()


def encode_answer(head: dict[str, Any], outputs: list[tuple[str, str, np.ndarray, bool]]) -> tuple[bytes, int | None]:
    """The answer: ``head`` (model_name, model_version, id) plus ``outputs`` ``(name, datatype, array, binary)``.
    Returns the body and, when some output is binary, the length of its JSON part (else None)."""
    entries, parts = [], []
    for name, datatype, arr, binary in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary:
            parts.append(_to_binary(datatype, arr))
            entry["parameters"] = {"binary_data_size": len(parts[-1])}
        else:
            entry["data"] = arr.reshape(-1).tolist()
        entries.append(entry)
    text = json.dumps({**head, "outputs": entries}, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    body = text.encode()
    if not parts:
        return body, None
    return body + b"".join(parts), len(body)
