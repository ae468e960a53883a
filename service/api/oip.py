"""The Open Inference Protocol (KServe V2) REST routes, beside the HTTP API (docs/api.md, "Open Inference Protocol").

``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``; per model (``/v2/models/{name}``, or
``/v2/models/{name}/versions/{version}`` with the model's version): metadata, ``/ready`` and ``POST /infer``.

A model's inputs: ``text`` (BYTES, text models: UTF-8 texts), ``image`` (BYTES, image models: the encoded image
files, base64 in JSON data, raw bytes in binary data) or ``pixel_values`` (FP32 ``[B, C, H, W]``, already
preprocessed); exactly one of them. A zero-shot model also takes ``labels`` (BYTES, the candidate labels) and the
request parameter ``template``; without ``labels`` it answers over its fixed labels. Outputs: see :data:`OUTPUTS`;
``member_probabilities`` only when asked for by name in ``outputs``.

``infer`` runs the same path as ``/predict`` (:func:`service.api.dataplane.run_inference`: the same limits, model
choice, batcher and metrics; auth is the middleware's). Errors are the protocol's ``{"error": "..."}``
(:func:`service.api.error_bodies.error_response` under ``/v2``). The routes are left out of ``/openapi.json``: the
protocol
documents them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from service.api.dataplane import request_id, run_inference, server_state
from service.api.oip_codec import HEADER_LENGTH, InferRequest, Tensor, decode_request, encode_answer
from service.api.requests import ParsedRequest, check_labels, media_type
from service.api.schemas import check_template
from service.core.artifact import DEFAULT_TEMPLATE
from service.core.errors import InvalidInput, NotFound, NotReady, UnsupportedMediaType
from service.lifecycle import ServerState, not_ready_reason
from service.runtime import Outcome, Query, Runtime

__all__ = ["DEFAULT_OUTPUTS", "EXTENSIONS", "OUTPUTS", "install_oip_routes", "model_metadata"]

EXTENSIONS = ["binary_tensor_data"]
DATA_INPUTS = ("text", "image", "pixel_values")  # exactly one per request


@dataclass(frozen=True)
class OutputSpec:
    """One output: its datatype, its shape after the batch dimension, and its values from an outcome; ``guarantee``:
    only models with a calibration split have it."""

    datatype: str
    dims: Callable[[Runtime], list[int]]
    values: Callable[[Outcome], np.ndarray]
    guarantee: bool = False

    def available(self, rt: Runtime) -> bool:
        return not self.guarantee or rt.guarantees is not None


def _optional(key: str, dtype: Any, missing: Any) -> Callable[[Outcome], np.ndarray]:
    """A guarantee field per input (``missing`` where the request's labels have none: zero-shot sets)."""
    return lambda out: np.array(
        [missing if getattr(r, key) is None else getattr(r, key) for r in out.results], dtype=dtype
    )


def _sets(out: Outcome) -> np.ndarray:
    """``(B, C)`` bool: each input's prediction set over the answer's labels (all false where none holds)."""
    c = len(out.labels)
    return np.stack(
        [r.prediction_set if r.prediction_set is not None else np.zeros(c, dtype=bool) for r in out.results]
    ).astype(bool)


def _classes(rt: Runtime) -> int:
    """C in the metadata: the model's label count; -1 for a zero-shot model (its requests may bring labels)."""
    return -1 if rt.task == "zero-shot" else len(rt.labels)


def _column(key: str) -> Callable[[Outcome], np.ndarray]:
    return lambda out: np.array([getattr(r, key) for r in out.results], dtype=np.float32)  # (B,)


OUTPUTS: dict[str, OutputSpec] = {
    "probabilities": OutputSpec(
        "FP32", lambda rt: [_classes(rt)], lambda out: np.stack([r.probs for r in out.results]).astype(np.float32)
    ),  # (B, C)
    "member_probabilities": OutputSpec(
        "FP32",
        lambda rt: [rt.members, _classes(rt)],
        lambda out: np.stack([r.member_probs for r in out.results]).astype(np.float32),
    ),  # (B, M, C)
    "label": OutputSpec(
        "BYTES", lambda rt: [], lambda out: np.array([out.labels[r.prediction] for r in out.results], dtype=object)
    ),  # (B,)
    "msp": OutputSpec("FP32", lambda rt: [], _column("msp")),
    "entropy": OutputSpec("FP32", lambda rt: [], _column("entropy")),
    "mutual_information": OutputSpec("FP32", lambda rt: [], _column("mutual_information")),
    "disagreement": OutputSpec("FP32", lambda rt: [], _column("disagreement")),
    "ood_score": OutputSpec("FP32", lambda rt: [], _column("ood_score")),
    "ood_flag": OutputSpec(
        "BOOL", lambda rt: [], lambda out: np.array([r.ood_flag for r in out.results], dtype=bool)
    ),  # (B,)
    # the guarantees (docs/api.md "Guarantees"): at the request's parameters alpha, ood_alpha, risk
    "ood_p_value": OutputSpec("FP32", lambda rt: [], _optional("p_value", np.float32, np.nan), guarantee=True),
    "prediction_set": OutputSpec("BOOL", lambda rt: [_classes(rt)], _sets, guarantee=True),  # (B, C)
    "accept": OutputSpec("BOOL", lambda rt: [], _optional("accept", bool, False), guarantee=True),  # (B,)
    # true while the drift alarm suspends the guarantees above (HYDRA_DRIFT_POLICY abstain or mark)
    "suspended": OutputSpec("BOOL", lambda rt: [], _optional("suspended", bool, False), guarantee=True),  # (B,)
}
# sent when the request names no outputs: all the model has but the (B, M, C) member probabilities
DEFAULT_OUTPUTS = tuple(name for name in OUTPUTS if name != "member_probabilities")
LEVELS = ("alpha", "ood_alpha", "risk")  # request parameters of the guarantees


# ----------------------------------------------------------------------------------------------- metadata
def _tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


def input_metadata(rt: Runtime) -> list[dict[str, Any]]:
    """The inputs a model takes (``$metadata_tensor``); -1 is the batch dimension."""
    shape = rt.image_shape
    if shape is None:
        return [_tensor("text", "BYTES", [-1])]
    out = [_tensor("image", "BYTES", [-1]), _tensor("pixel_values", "FP32", [-1, *shape])]
    if rt.task == "zero-shot":
        out.append(_tensor("labels", "BYTES", [-1]))
    return out


def model_metadata(rt: Runtime) -> dict[str, Any]:
    """``$metadata_model_response`` of a model."""
    backend = rt.plan.backend if rt.plan is not None else "none"
    outputs = [
        _tensor(name, spec.datatype, [-1, *spec.dims(rt)]) for name, spec in OUTPUTS.items() if spec.available(rt)
    ]
    return {
        "name": rt.name,
        "versions": [rt.version],
        "platform": f"hydra-serve_{backend}",
        "inputs": input_metadata(rt),
        "outputs": outputs,
    }


def find_model(state: ServerState, name: str, version: str | None) -> Runtime:
    """The model of the path; 404 when no model has that name, or not that version."""
    rt = state.runtimes.get(name)
    if rt is None:
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise NotFound(f"unknown model {shown!r}; served: {sorted(state.runtimes)}")
    if version is not None and version != rt.version:
        raise NotFound(f"model {name!r} has no version {version[:64]!r}; it serves version {rt.version!r}")
    return rt


# ----------------------------------------------------------------------------------------------- inputs
def _elements(t: Tensor, batch_shape: str) -> list[Any]:
    """The elements of a BYTES tensor of shape ``[N]`` or ``[N, 1]``."""
    if t.datatype != "BYTES":
        raise InvalidInput(f"{t.name}: datatype must be BYTES, not {t.datatype}")
    if t.data.ndim not in (1, 2) or (t.data.ndim == 2 and t.data.shape[1] != 1):
        raise InvalidInput(f"{t.name}: shape must be {batch_shape} or {batch_shape[:-1]}, 1], not {list(t.data.shape)}")
    return list(t.data.reshape(-1))


def _texts(t: Tensor, batch_shape: str = "[B]") -> list[str]:
    """UTF-8 strings of a BYTES tensor (JSON data are strings already)."""
    out = []
    for i, x in enumerate(_elements(t, batch_shape)):
        if isinstance(x, bytes):
            try:
                x = x.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput(f"{t.name}[{i}]: not UTF-8 text") from None
        out.append(x)
    return out


def _pixels(rt: Runtime, t: Tensor) -> list[torch.Tensor]:
    """A preprocessed ``[B, C, H, W]`` FP32 tensor -> B ``(C, H, W)`` model inputs."""
    shape = rt.image_shape
    assert shape is not None
    if t.datatype != "FP32":
        raise InvalidInput(f"{t.name}: datatype must be FP32, not {t.datatype}")
    if t.data.ndim != 4 or tuple(t.data.shape[1:]) != shape:
        raise InvalidInput(f"{t.name}: shape must be [B, {', '.join(map(str, shape))}], not {list(t.data.shape)}")
    if not np.isfinite(t.data).all():
        raise InvalidInput(f"{t.name}: values must be finite (no NaN or infinity)")
    return list(torch.from_numpy(np.array(t.data, dtype=np.float32)).unbind(0))  # B x (C, H, W)


def _levels(params: dict[str, Any]) -> dict[str, Any]:
    """The guarantees' levels a request sets (parameters ``alpha``, ``ood_alpha``, ``risk``): numbers in (0, 1)."""
    out: dict[str, Any] = {}
    for key in LEVELS:
        if key in params:
            v = params[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise InvalidInput(f"parameters.{key}: must be a number in (0, 1), got {v!r}", status=422)
            out[key] = float(v)
    if "adaptive" in params:  # the adaptive prediction sets (docs/api.md "Feedback and live quality")
        out["adaptive"] = _flag(params, "adaptive")
    return out


def _query(rt: Runtime, tensors: dict[str, Tensor], params: dict[str, Any]) -> Query:
    """The zero-shot labels and template of a request (none: the model's own labels), and the guarantees'
    levels."""
    levels = _levels(params)
    if "labels" not in tensors:
        if rt.task == "zero-shot" and not rt.labels:
            raise InvalidInput(
                f"model {rt.name!r} has no fixed labels: send the candidate labels as the input 'labels'"
            )
        return Query(top_k=1, **levels)
    # the same mistakes as on /zero-shot, the same status (422): a template that is not one, too few or duplicate labels
    template = params.get("template", DEFAULT_TEMPLATE)
    if not isinstance(template, str):
        raise InvalidInput("parameters.template: must be a string", status=422)
    try:
        template = check_template(template)
    except ValueError as e:
        raise InvalidInput(f"parameters.template: {e}", status=422) from None
    labels = check_labels(_texts(tensors["labels"], "[L]"))
    return Query(top_k=1, labels=labels, template=template, **levels)


def parsed_request(rt: Runtime, req: InferRequest, tensors: dict[str, Tensor]) -> ParsedRequest:
    """The request's inputs as the shared inference path takes them (:class:`ParsedRequest`)."""
    allowed = [m["name"] for m in input_metadata(rt)]
    unknown = sorted(set(tensors) - set(allowed))
    if unknown:
        raise InvalidInput(f"inputs: {unknown} not taken by model {rt.name!r}; its inputs: {allowed}")
    given = [n for n in DATA_INPUTS if n in tensors]
    if len(given) != 1:
        choices = [n for n in allowed if n in DATA_INPUTS]
        raise InvalidInput(f"inputs: send exactly one of {choices} (got {given or 'none'})")
    t = tensors[given[0]]
    query = _query(rt, tensors, req.parameters or {})
    task = "zero-shot" if query.labels is not None else "classification"
    if t.name == "pixel_values":
        return ParsedRequest(task, rt.modality, t.name, _pixels(rt, t), False, rt.name, query, preprocessed=True)
    if t.name == "text":
        return ParsedRequest(task, rt.modality, t.name, _texts(t), True, rt.name, query)
    items = _elements(t, "[B]")  # images: base64 strings (JSON) or the files' bytes (binary data)
    base64_encoded = not any(isinstance(x, bytes) for x in items)
    return ParsedRequest(task, rt.modality, t.name, items, base64_encoded, rt.name, query)


def _flag(params: dict[str, Any], key: str, default: bool = False) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameters.{key}: must be true or false")
    return value


def requested_outputs(req: InferRequest, rt: Runtime) -> list[tuple[str, bool]]:
    """The outputs to send, in order, each with whether it goes as binary data."""
    binary = _flag(req.parameters or {}, "binary_data_output")
    if req.outputs is None:
        return [(name, binary) for name in DEFAULT_OUTPUTS if OUTPUTS[name].available(rt)]
    out: list[tuple[str, bool]] = []
    own = [name for name, spec in OUTPUTS.items() if spec.available(rt)]
    for o in req.outputs:
        if o.name not in own:
            raise InvalidInput(f"outputs: {o.name!r} is not an output of model {rt.name!r}; outputs: {own}")
        if any(o.name == name for name, _ in out):
            raise InvalidInput(f"outputs: {o.name!r} is asked for twice")
        params = o.parameters or {}
        if "classification" in params:
            raise InvalidInput("outputs: the classification extension is not supported; ask for 'label'")
        out.append((o.name, _flag(params, "binary_data", binary)))
    return out


def _check_body_names(rt: Runtime, req: InferRequest) -> None:
    if req.model_name is not None and req.model_name != rt.name:
        raise InvalidInput(f"model_name {req.model_name[:64]!r} differs from the path's model {rt.name!r}")
    if req.model_version not in (None, "", rt.version):
        raise InvalidInput(f"model_version {str(req.model_version)[:64]!r} differs from the model's {rt.version!r}")


def _check_media(request: Request) -> None:
    media = media_type(request)
    if media not in ("", "application/json", "application/octet-stream") and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type {media!r} is not accepted; send application/json")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not accepted; send the body uncompressed")


# ----------------------------------------------------------------------------------------------- handlers
async def server_metadata(request: Request) -> dict[str, Any]:
    return {"name": "hydra-serve", "version": request.app.version, "extensions": EXTENSIONS}


async def live() -> dict[str, bool]:
    return {"live": True}


async def ready(request: Request) -> dict[str, bool]:
    reason = not_ready_reason(server_state(request))
    if reason is not None:
        raise NotReady(reason)
    return {"ready": True}


async def _metadata(request: Request, model_name: str, model_version: str | None) -> dict[str, Any]:
    return model_metadata(find_model(server_state(request), model_name, model_version))


async def _model_ready(request: Request, model_name: str, model_version: str | None) -> dict[str, Any]:
    """200 when the server is ready and this model healthy; else 503 (the kubelet's probes want a 5xx)."""
    state = server_state(request)
    rt = find_model(state, model_name, model_version)
    reason = not_ready_reason(state) if not state.ready or state.load_error else None
    if reason is None and not rt.healthy:
        reason = f"not ready: model {rt.name!r} is failing its batches; a probe batch runs until one succeeds"
    if reason is not None:
        raise NotReady(reason)
    return {"name": rt.name, "ready": True}


async def _infer(request: Request, model_name: str, model_version: str | None) -> Response:
    """Decode the request -> the shared inference path -> the requested outputs, JSON or binary."""
    rt = find_model(server_state(request), model_name, model_version)
    _check_media(request)
    req, tensors = decode_request(await request.body(), request.headers.get(HEADER_LENGTH))
    _check_body_names(rt, req)
    wanted = requested_outputs(req, rt)
    parsed = parsed_request(rt, req, tensors)
    rt, out = await run_inference(request, parsed)
    head: dict[str, Any] = {"model_name": rt.name, "model_version": rt.version, "id": req.id or request_id(request)}
    head.update(_answer_parameters(out))
    arrays = [(name, OUTPUTS[name].datatype, OUTPUTS[name].values(out), binary) for name, binary in wanted]
    body, json_length = encode_answer(head, arrays)
    if json_length is None:
        return Response(body, media_type="application/json")
    return Response(body, media_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)})


def _answer_parameters(out: Outcome) -> dict[str, Any]:
    """The answer's own ``parameters``: the adaptive sets' level, and the drift alarm that suspends the guarantees
    (``{}`` when neither: an answer with split conformal sets and no alarm has no ``parameters``)."""
    params: dict[str, Any] = {}
    first = out.results[0] if out.results else None
    if first is not None and first.alpha_t is not None:  # one read per request: the same for every input
        params.update({"adaptive": True, "alpha_t": float(first.alpha_t)})
    if first is not None and first.suspended:
        params.update({"guarantees_suspended": True, "drift_alarm_at": first.alarm_at})
    return {"parameters": params} if params else {}


# each model route twice: the model's path, and its path with a version (the model's own, else 404)
async def metadata(request: Request, model_name: str) -> dict[str, Any]:
    return await _metadata(request, model_name, None)


async def metadata_version(request: Request, model_name: str, model_version: str) -> dict[str, Any]:
    return await _metadata(request, model_name, model_version)


async def model_ready(request: Request, model_name: str) -> dict[str, Any]:
    return await _model_ready(request, model_name, None)


async def model_ready_version(request: Request, model_name: str, model_version: str) -> dict[str, Any]:
    return await _model_ready(request, model_name, model_version)


async def infer(request: Request, model_name: str) -> Response:
    return await _infer(request, model_name, None)


async def infer_version(request: Request, model_name: str, model_version: str) -> Response:
    return await _infer(request, model_name, model_version)


def install_oip_routes(app: FastAPI) -> None:
    """Declare the protocol's routes on ``app`` (left out of the OpenAPI document). The path parameters are
    model names and versions, looked up among the loaded models; nothing reads a file by them."""
    app.get("/v2", include_in_schema=False)(server_metadata)
    app.get("/v2/health/live", include_in_schema=False)(live)
    app.get("/v2/health/ready", include_in_schema=False)(ready)
    model, version = "/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}"
    app.get(model, include_in_schema=False)(metadata)
    app.get(version, include_in_schema=False)(metadata_version)
    app.get(model + "/ready", include_in_schema=False)(model_ready)
    app.get(version + "/ready", include_in_schema=False)(model_ready_version)
    app.post(model + "/infer", include_in_schema=False)(infer)
    app.post(version + "/infer", include_in_schema=False)(infer_version)
