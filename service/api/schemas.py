"""Request and response bodies of the HTTP API (docs/api.md), as pydantic models for validation and OpenAPI.

Requests forbid unknown fields (the answer names the field). Limits that depend
on settings (``HYDRA_MAX_ITEMS``, ``HYDRA_MAX_TEXT_CHARS``, ``HYDRA_MAX_LABELS``)
are checked by :func:`check_limits` right after parsing. ``top_k`` must be >= 1;
above the number of labels it is clamped to it (so the default 5 works for any model).

Responses: the runtimes build each answer as :class:`PredictResponse` and its parts
(:func:`service.runtime.interface.build_predictions`), validated when built, so the body a
client gets and the schema the OpenAPI document shows cannot drift apart.
"""

from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator
from pydantic.config import JsonDict

from service.core.artifact import DEFAULT_TEMPLATE, OOD_SCORES
from service.core.errors import InvalidInput

__all__ = [
    "PredictRequest",
    "ZeroShotRequest",
    "FormOptions",
    "TopK",
    "Uncertainty",
    "OOD",
    "MemberPrediction",
    "Prediction",
    "Timing",
    "PredictResponse",
    "FeedbackEntry",
    "FeedbackRequest",
    "FeedbackResponse",
    "FeedbackResult",
    "MAX_FEEDBACK",
    "ModelInfo",
    "ModelsResponse",
    "HealthResponse",
    "ReadyResponse",
    "ErrorResponse",
    "ERROR_RESPONSES",
    "check_limits",
    "check_template",
]

_STRICT = ConfigDict(extra="forbid", str_strip_whitespace=False)


# OpenAPI: exactly one of the given properties is present and not null (null is read as absent)
def _one_of(*names: str) -> JsonDict:
    return {"oneOf": [{"required": [n], "properties": {n: {"not": {"type": "null"}}}} for n in names]}


# OpenAPI: what check_template accepts: text, {{ and }}, and at least one bare {label}
TEMPLATE_PATTERN = r"^(?:[^{}]|\{\{|\}\}|\{label\})*\{label\}(?:[^{}]|\{\{|\}\}|\{label\})*$"
# a character that is not whitespace, a control (Cc) or an invisible format character (zero-width, bidi marks, BOM):
# a text without one has nothing for a model to read
_VISIBLE = re.compile(r"[^\s\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff]")


def check_template(template: str) -> str:
    """A zero-shot prompt template: ``{label}`` at least once, no other field (``{{``/``}}`` for braces).

    Only the bare ``{label}`` field is allowed (no ``{label.attr}``, ``{0}``, conversions or format specs),
    so ``template.format(label=...)`` cannot fail or reach attributes. Raises ``ValueError`` saying what is wrong.
    """
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as e:  # "Single '}' encountered", "expected '}' before end of string"
        raise ValueError(f"template is not a valid format string ({e}); write literal braces as {{{{ and }}}}") from e
    for f, spec, conv in fields:
        if f != "label" or spec or conv:
            shown = "{" + f + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(
                f"template may only hold the placeholder {{label}}, found {shown}; "
                "write literal braces as {{ and }}"
            )
    if not fields:
        raise ValueError("template must contain the placeholder {label}")
    return template


class _Options(BaseModel):
    model_config = _STRICT

    model: str | None = Field(None, min_length=1, description="artifact name; default: routed by input modality")
    top_k: int = Field(5, ge=1, strict=True, description="labels returned per input; clamped to the label count")
    return_members: bool = Field(False, strict=True, description="add each member's prediction")
    return_scores: bool = Field(False, strict=True, description="add every OOD score the model computes (ood.scores)")
    alpha: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="miscoverage of the prediction sets (conformal.set "
        "holds the true label with probability >= 1 - alpha); default: the model's",
    )
    ood_alpha: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="level of the OOD flag: flag = ood.p_value <= "
        "ood_alpha (at most this share of in-distribution inputs flagged)",
    )
    risk: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="target error rate of selective.accept: one of the "
        "model's certified targets (GET /v1/models); default: the model's",
    )

    adaptive: bool = Field(
        False,
        strict=True,
        description="conformal.set from the online (adaptive) method at its current level alpha_t, which the "
        "feedback labels move (docs/monitoring.md); needs the prediction store; default: the split conformal set",
    )

    @field_validator("alpha", "ood_alpha", "risk", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        """Numbers only: a string or a boolean is refused (422), not read as a number."""
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"must be a number in (0, 1), got {value!r}")
        return value

    @field_validator("top_k", mode="before")
    @classmethod
    def _integral_float(cls, value: Any) -> Any:
        """JSON's ``3.0`` is the integer 3 (JSON Schema says so); strings, booleans and ``2.5`` stay refused."""
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


class PredictRequest(_Options):
    """JSON body of ``POST /predict``: exactly one of ``text``, ``texts``, ``image``, ``images``."""

    model_config = ConfigDict(**_STRICT, json_schema_extra=_one_of("text", "texts", "image", "images"))

    text: str | None = Field(None, min_length=1, description="one text")
    texts: list[str] | None = Field(None, min_length=1, description="several texts, one prediction each")
    image: str | None = Field(None, min_length=1, description="one image: base64 or data URL (JPEG, PNG, WebP)")
    images: list[str] | None = Field(None, min_length=1, description="several images, base64 or data URLs")

    @model_validator(mode="after")
    def _exactly_one_input(self) -> PredictRequest:
        given = [k for k in ("text", "texts", "image", "images") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of text, texts, image, images (got {', '.join(given) if given else 'none'})"
            )
        return self

    @property
    def modality(self) -> Literal["text", "image"]:
        return "text" if self.text is not None or self.texts is not None else "image"

    @property
    def items(self) -> list[str]:
        for single, many in (("text", "texts"), ("image", "images")):
            if getattr(self, single) is not None:
                return [getattr(self, single)]
            if getattr(self, many) is not None:
                return list(getattr(self, many))
        return []


class ZeroShotRequest(_Options):
    """JSON body of ``POST /zero-shot``: ``image`` or ``images`` against ``labels``."""

    model_config = ConfigDict(**_STRICT, json_schema_extra=_one_of("image", "images"))

    image: str | None = Field(None, min_length=1, description="one image: base64 or data URL")
    images: list[str] | None = Field(None, min_length=1, description="several images")
    labels: list[str] = Field(
        ...,
        min_length=2,
        description="two or more distinct candidate labels",
        json_schema_extra={"uniqueItems": True, "items": {"type": "string", "minLength": 1}},
    )
    template: str = Field(
        DEFAULT_TEMPLATE,
        min_length=1,
        json_schema_extra={"pattern": TEMPLATE_PATTERN},
        description="prompt with a {label} placeholder; no other {field}; {{ and }} for literal braces",
    )

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        return check_template(value)

    @model_validator(mode="after")
    def _check(self) -> ZeroShotRequest:
        if (self.image is None) == (self.images is None):
            raise ValueError("give exactly one of image, images")
        return self

    @property
    def items(self) -> list[str]:
        return [self.image] if self.image is not None else list(self.images or [])


class FormOptions(BaseModel):
    """Options sent as multipart form fields (strings, parsed leniently: ``top_k=3``, ``return_members=true``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1)
    top_k: int = Field(5, ge=1)
    return_members: bool = False
    return_scores: bool = False
    labels: list[str] | None = None
    template: str = Field(DEFAULT_TEMPLATE, min_length=1)
    alpha: float | None = Field(None, gt=0, lt=1)
    ood_alpha: float | None = Field(None, gt=0, lt=1)
    risk: float | None = Field(None, gt=0, lt=1)
    adaptive: bool = False

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        return check_template(value)


def check_limits(
    items: list[Any],
    field: str,
    *,
    max_items: int,
    max_chars: int | None = None,
    labels: list[str] | None = None,
    max_labels: int | None = None,
    max_label_chars: int | None = None,
) -> None:
    """Raise :class:`InvalidInput` naming the field when a request exceeds a configured limit.

    ``max_chars``: the items are texts (ones with no visible character, only whitespace, control or
    zero-width characters, are refused too).
    ``labels``: zero-shot labels, two or more, distinct, non-empty.
    """
    if not items:
        raise InvalidInput(f"{field}: no inputs given")
    if len(items) > max_items:
        raise InvalidInput(f"{field}: {len(items)} inputs, above the limit of {max_items} (HYDRA_MAX_ITEMS)")
    if max_chars is not None:
        for i, t in enumerate(items):
            where = field if len(items) == 1 and not field.endswith("s") else f"{field}[{i}]"
            if len(t) > max_chars:
                raise InvalidInput(
                    f"{where}: {len(t)} characters, above the limit of {max_chars} (HYDRA_MAX_TEXT_CHARS)"
                )
            if not _VISIBLE.search(t):
                raise InvalidInput(f"{where}: empty text (only whitespace or control characters); send some words")
    if labels is not None:
        if len(labels) < 2:
            raise InvalidInput(f"labels: {len(labels)} given; send two or more")
        if max_labels is not None and len(labels) > max_labels:
            raise InvalidInput(f"labels: {len(labels)} given, above the limit of {max_labels} (HYDRA_MAX_LABELS)")
        for i, lab in enumerate(labels):
            if not _VISIBLE.search(lab):
                raise InvalidInput(f"labels[{i}]: empty label (only whitespace or control characters)")
            if max_label_chars is not None and len(lab) > max_label_chars:
                raise InvalidInput(
                    f"labels[{i}]: {len(lab)} characters, above {max_label_chars} (HYDRA_MAX_TEXT_CHARS)"
                )
        if len(set(labels)) != len(labels):
            raise InvalidInput("labels: duplicate labels; give each label once")


# ----------------------------------------------------------------------------- responses
class TopK(BaseModel):
    label: str
    prob: float


class Uncertainty(BaseModel):
    msp: float = Field(description="max of the mean member probability (higher = more confident)")
    entropy: float = Field(description="entropy of the mean prediction, nats (total uncertainty)")
    expected_entropy: float = Field(description="mean of the member entropies, nats (aleatoric)")
    mutual_information: float = Field(description="entropy - expected_entropy, nats (epistemic, member disagreement)")
    disagreement: float = Field(description="fraction of members whose argmax differs from the ensemble's")


class OOD(BaseModel):
    flag: bool = Field(
        description="true when flagged OOD: p_value <= alpha (models with a calibration split), "
        "else the score past the threshold; either way exactly when the score is past `threshold` "
        "(above it; below it for msp)"
    )
    score: float = Field(description="the served score of this input")
    metric: Literal[OOD_SCORES] = Field(description="the served score's name")  # type: ignore[valid-type]
    threshold: float | None = Field(
        description="the threshold the flag applied: with a p-value, the score at which "
        "p_value <= alpha at this request's level; else the build's threshold fitted on "
        "validation data. Absent: no score is flagged at this level (alpha < 1 / (n + 1))"
    )
    p_value: float | None = Field(
        None,
        description="conformal p-value of the score against the calibration split's "
        "ID scores: (1 + #{s_i >= s}) / (n + 1)",
    )
    alpha: float | None = Field(None, description="the level the flag used (the request's ood_alpha or the model's)")
    reason: str | None = Field(None, description="only when flagged: the rule that fired, with its numbers")
    suspended: bool | None = Field(
        None,
        description="models with a calibration split: true while the model's drift alarm is on. The p-value's "
        "guarantee (at most alpha of in-distribution inputs flagged) assumes traffic like the calibration split, "
        "which the alarm has found it is not: the guarantee is suspended until the alarm clears",
    )
    scores: dict[str, float] | None = Field(None, description="only with return_scores: every score computed")


class ConformalSet(BaseModel):
    alpha: float = Field(
        description="miscoverage: the sets hold the true label of at least 1 - alpha of the model's "
        "in-distribution inputs (with delta: with probability >= 1 - delta over the calibration draw; "
        "without: on average over it)"
    )
    delta: float | None = Field(
        None,
        description="training-conditional sets: the coverage of this model's sets is at least 1 - alpha with "
        "probability >= 1 - delta over the draw of its calibration split (absent: the marginal guarantee)",
    )
    set: list[str] = Field(description="the labels of the set, most probable first; never empty (see filled)")
    size: int
    method: Literal["lac", "aps", "raps"] = Field(description="the nonconformity score")
    mondrian: bool = Field(description="class-conditional: coverage >= 1 - alpha for every class")
    below_min_alpha: bool = Field(
        description="alpha is below what the calibration split supports (1 / (n + 1); with delta "
        "1 - delta^(1/n); for some class, with mondrian): those labels are always in; marginal sets hold every label"
    )
    filled: bool = Field(
        False,
        description="no label passed the set's threshold at this alpha (the input is unlike "
        "the calibration inputs of every class), so the set is the prediction alone: sets are never "
        "empty, and a superset covers at least as often, so the guarantee holds",
    )
    adaptive: bool | None = Field(
        None, description="only with the request option adaptive: the set is the online method's, built at alpha_t"
    )
    alpha_t: float | None = Field(
        None, description="the adaptive set's level now (moved by feedback labels; alpha is its long-run target)"
    )
    suspended: bool = Field(
        False,
        description="true while the model's drift alarm is on: the coverage guarantee assumes traffic like the "
        "calibration split, which the alarm has found it is not, so it is suspended until the alarm clears (an "
        "adaptive set's long-run guarantee holds over any stream, but only as labels come back)",
    )


class Selective(BaseModel):
    accept: bool = Field(
        description="the rule of the target risk accepts this input: the certified rule, or the online rule for "
        "adaptive requests; never while the drift alarm is on but through the online rule (HYDRA_DRIFT_POLICY)"
    )
    risk: float = Field(
        description="the target: among accepted in-distribution inputs at most this error rate, "
        "with probability >= 1 - delta over the calibration draw (certified rule), or over the labelled stream "
        "in the long run (online rule)"
    )
    certified: bool = Field(
        description="the build's certificate for this target holds now: false when no rule met the target on the "
        "calibration split (that rule accepts nothing), and while the drift alarm is on (suspended)"
    )
    rule: Literal["certified", "online"] = Field(
        "certified",
        description="which rule decided: the certified one (fixed threshold, from the calibration split), or the "
        "online one of adaptive requests, whose threshold the feedback labels move",
    )
    suspended: bool = Field(
        False,
        description="true while the model's drift alarm is on: the certificate assumes traffic like the calibration "
        "split, which the alarm has found it is not (alarm_at says since when)",
    )
    alarm_at: int | None = Field(
        None, description="while the drift alarm is on: the input (counted since start-up) at which it went on"
    )
    threshold: float | None = Field(
        None,
        description="the deciding rule's confidence threshold: accepted inputs have confidence >= it (null: the "
        "rule accepts nothing)",
    )
    ood_threshold: float | None = Field(
        None,
        description="the rule's OOD cut, calibrated with it: accepted inputs "
        "have an OOD score at most it (at least it for msp). It is the build's "
        "validation threshold, not the flag's level: an unflagged input can be past it",
    )
    reason: str | None = Field(
        None,
        description="when not accepted: which of the rule's conditions failed, or that the drift alarm withholds it; "
        "with HYDRA_DRIFT_POLICY=mark also on accepted inputs while the alarm is on",
    )


class MemberPrediction(BaseModel):
    label: str
    confidence: float


class Prediction(BaseModel):
    label: str
    label_index: int
    confidence: float = Field(description="ensemble probability of the predicted label")
    top_k: list[TopK]
    uncertainty: Uncertainty
    ood: OOD
    conformal: ConformalSet | None = Field(None, description="models with a calibration split: the prediction set")
    selective: Selective | None = Field(None, description="models with a calibration split: the risk rule's decision")
    members: list[MemberPrediction] | None = Field(None, description="only with return_members")


class Timing(BaseModel):
    queue_ms: float
    inference_ms: float
    total_ms: float


class PredictResponse(BaseModel):
    id: str = Field(
        description="the request's ID: its X-Request-ID header, else one the server made (also sent back "
        "as X-Request-ID)"
    )
    model: str
    model_version: str = Field(description="the version of the model that answered (GET /v1/models)")
    predictions: list[Prediction]
    timing: Timing


MAX_FEEDBACK = 10_000  # items per feedback request (issue 32: a 10k-item batch is refused)


class FeedbackEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr = Field(description="the answer's id (its X-Request-ID)")
    index: int = Field(strict=True, description="the prediction's position in that answer (0 = first input)")
    label: StrictStr | StrictInt = Field(
        description="the true label: a name (one outside the model's labels marks the input foreign) or an index"
    )


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    feedback: list[FeedbackEntry] = Field(min_length=1, max_length=MAX_FEEDBACK)


class FeedbackResult(BaseModel):
    status: Literal["accepted", "duplicate", "unknown_id", "invalid_label"]


class FeedbackResponse(BaseModel):
    results: list[FeedbackResult] = Field(description="one per item, in order")


class ModelInfo(BaseModel):
    name: str
    version: str
    family: str
    task: str
    modality: str
    members: int
    labels: list[str]
    backend: str
    device: str
    precision: str
    max_batch: int
    uncertainty: dict[str, Any]
    guarantees: dict[str, Any] | None = None  # models with a calibration split: defaults, risk targets, drift test
    zero_shot: dict[str, Any] | None = None  # zero-shot models: the prompt template, embedding size, text cache


class BuildingModel(BaseModel):
    """A model ``make serve`` is still building: served once its build finishes."""

    name: str
    task: str
    modality: str
    status: Literal["building"] = "building"
    config: str = Field(description="the build config it comes from")
    elapsed_s: float = Field(description="seconds since its build (or its wait for the build before it) began")
    eta_s: float = Field(description="seconds left, as its builder estimates them")


class FailedModel(BaseModel):
    """A model whose build gave nothing to serve."""

    name: str
    status: Literal["failed"] = "failed"
    reason: str


class _NotYetServed(BaseModel):
    building: list[BuildingModel] = Field(default_factory=list, description="models still being built")
    failed: list[FailedModel] = Field(default_factory=list, description="models whose build failed")


class ModelsResponse(_NotYetServed):
    models: list[ModelInfo]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(_NotYetServed):
    status: Literal["ready"] = "ready"
    models: list[str]


class _ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: _ErrorDetail


def _example(code: str, description: str) -> dict[str, Any]:
    return {
        "model": ErrorResponse,
        "description": description,
        "content": {"application/json": {"example": {"error": {"code": code, "message": description}}}},
    }


# `responses=` for route declarations: the error codes a route can answer, for the OpenAPI docs.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _example("invalid_input", "malformed input: bad base64, undecodable image, empty text, ambiguous model"),
    401: _example("unauthorized", "missing or wrong bearer token (when HYDRA_API_KEY is set)"),
    403: _example("forbidden", "not allowed on this server (a drift reset needs HYDRA_API_KEY)"),
    404: _example("not_found", "no model of that name is loaded"),
    409: _example("conflict", "the prediction store is off (HYDRA_STORE=off): no feedback or live monitor"),
    413: _example("payload_too_large", "request body or image above the configured limit"),
    415: _example("unsupported_media_type", "send application/json or multipart/form-data; images JPEG/PNG/WebP"),
    422: _example("invalid_input", "the body does not match the schema; the message names the field"),
    500: _example("internal", "internal error; the server log has the details"),
    503: _example("overloaded", "queue full, retry after Retry-After seconds (or not_ready while loading)"),
}
