"""The typed model of ``manifest.json``: :class:`Manifest` and one model per block (docs/artifact.md).

Every block of the format is a frozen pydantic model here: the preprocessing (:class:`ImagePreprocessing` with
its :class:`ClipTextPreprocessing`, :class:`TextPreprocessing`), :class:`Uncertainty`, :class:`ModelSpec` (with
the zero-shot encoders' :class:`EncoderSpec`), the export records, the OOD block (:class:`OODSpec` and its
candidates) and the guarantees (:class:`GuaranteesSpec` and its parts). Free-form provenance stays plain JSON:
``metrics``, ``data``, ``build``, the fused architecture ``model.config`` and the split records (``ood.fit``,
``guarantees.calibration``), which keep the key order the builder wrote them in. A builder constructs a
:class:`Manifest` from these blocks (or from their JSON form: numpy scalars and arrays, tuples and paths are taken
as the plain JSON values they stand for), the server reads it back through the same models
(:mod:`service.core.artifact`), and reads attributes, never string keys.

*Closed* blocks refuse unknown keys (a typo is an error, not ignored); *open* blocks type their named fields and
keep further keys as written: build provenance, which nothing reads to serve. The document a manifest is written
as is :meth:`Manifest.to_dict`: unset optional fields are left out, never written as null.

Cross-field rules (checked by :class:`Manifest`): ``heads`` has one entry per member; a classification artifact
has labels and as many as its model's classes; a zero-shot artifact has a ``zero_shot`` block and image
preprocessing with a ``text`` part; a served logit or feature score has the OOD statistics it needs; every file
the manifest points to (weights, exports, OOD statistics, tokenizer) is listed in ``files`` once files are listed.

Imports only the standard library, pydantic and the score registry (:mod:`service.core.scores`): the server reads
artifacts without the builder's dependencies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from typing_extensions import Self

from service.core.families import FAMILIES
from service.core.scores import FEATURE_SCORES, LOGIT_SCORES, SCORES

__all__ = [
    "DEFAULT_TEMPLATE",
    "FEATURE_SCORES",
    "FORMAT_VERSION",
    "LOGIT_SCORES",
    "OOD_FILE",
    "OOD_SCORES",
    "STRATEGIES",
    "VERSION_PATTERN",
    "BaseModelInfo",
    "Bf16Check",
    "ClipTextPreprocessing",
    "ConformalSpec",
    "DriftSpec",
    "DualExport",
    "EncoderSpec",
    "Export",
    "FileEntry",
    "GuaranteesSpec",
    "ImagePreprocessing",
    "Manifest",
    "ModelSpec",
    "OODCandidate",
    "OODCut",
    "OODPValueSpec",
    "OODSpec",
    "Preprocessing",
    "SelectiveSpec",
    "SelectiveTarget",
    "Strategy",
    "TextPreprocessing",
    "Uncertainty",
    "ZeroShotSpec",
    "document_sha256",
    "plain_json",
]

FORMAT_VERSION: Final = 1
OOD_FILE = "ood.safetensors"  # the OOD statistics (.ood.ood_tensors), when the artifact has them
DEFAULT_TEMPLATE = "A photo of a {label}."  # the zero-shot prompt when neither the artifact nor a request names one
# the OOD scores a threshold can be calibrated on, in the registry's order (.scores: every list of score names is
# derived there); the logit scores need the artifact's OOD statistics (ood block), the feature scores those and the
# features output
OOD_SCORES = tuple(SCORES)
STRATEGIES = ("taylor", "circuit-acc", "circuit-ood", "circuit-avg", "random")
# a model version as the API shows it (URL path segment of the Open Inference Protocol): no slash, no space
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def plain_json(x: Any) -> Any:
    """Plain JSON types from what builders hand over (numpy arrays and scalars, paths, tuples); models are kept."""
    if isinstance(x, dict):
        return {str(k): plain_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_json(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist"):  # numpy / torch arrays and scalars
        return x.tolist()
    return x


def document_sha256(doc: Mapping[str, Any]) -> str:
    """Hex sha256 of a manifest's JSON form, canonical (sorted keys, no spaces, ASCII): the same for any layout."""
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ----------------------------------------------------------------------------- the base of every block
class _Record(BaseModel):
    """A manifest block whose fields are all known: unknown keys are refused (a typo is an error, not ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, data: Any) -> Any:
        return plain_json(data) if isinstance(data, dict) else data

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written into ``manifest.json`` (unset optional fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class _OpenRecord(_Record):
    """A descriptive block: its named fields are typed, further keys are kept as written (build provenance)."""

    model_config = ConfigDict(extra="allow", frozen=True)


PositiveInt = Annotated[int, Field(ge=1)]
Unit = Annotated[float, Field(gt=0, lt=1)]  # a level in (0, 1): alpha, delta, a target risk


# ----------------------------------------------------------------------------- preprocessing
class ClipTextPreprocessing(_Record):
    """The text side of a zero-shot artifact: prompts tokenised with ``tokenizer/``."""

    max_length: PositiveInt  # prompts are truncated to this many tokens
    tokenizer: str = "tokenizer"  # folder inside the artifact, loadable with AutoTokenizer / tokenizers
    padding: Literal["longest", "max_length"] = "longest"  # open_clip's own text tower pads to max_length


class ImagePreprocessing(_Record):
    """Image bytes -> ``(C, H, W)``: convert to ``channels``, resize (and crop) to ``size``, ``(u8 / 255 - mean) /
    std``."""

    type: Literal["image"] = "image"
    size: tuple[PositiveInt, PositiveInt]  # (H, W) the model takes
    mean: list[float] = Field(min_length=1)  # one value, or one per channel
    std: list[float] = Field(min_length=1)  # one value, or one per channel; all > 0
    interpolation: Literal["bilinear", "bicubic", "nearest", "lanczos"] = "bilinear"
    channels: Literal[1, 3] = 3  # 1 = grayscale (Pillow "L"), 3 = RGB
    # direct: straight to ``size``; shorter_crop: timm's evaluation transform (shorter side to size / crop_pct,
    # then the centre crop)
    resize: Literal["direct", "shorter_crop"] = "direct"
    crop_pct: float | None = Field(None, gt=0, le=1)  # shorter_crop: the share of the resized image kept
    text: ClipTextPreprocessing | None = None  # zero-shot artifacts only

    @model_validator(mode="after")
    def _per_channel(self) -> ImagePreprocessing:
        for name in ("mean", "std"):
            n = len(getattr(self, name))
            if n not in (1, self.channels):
                raise ValueError(f"{name} needs 1 or {self.channels} values, got {n}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be > 0, got {self.std}")
        return self


class TextPreprocessing(_Record):
    """Texts -> token ids with the artifact's tokenizer, truncated to ``max_length``, padded per batch."""

    type: Literal["text"] = "text"
    max_length: PositiveInt
    tokenizer: str = "tokenizer"  # folder inside the artifact


Preprocessing = Annotated[ImagePreprocessing | TextPreprocessing, Field(discriminator="type")]


# ----------------------------------------------------------------------------- what the model is and answers
class Uncertainty(_Record):
    """How answers are calibrated: the ensemble's temperature and the OOD flag's score and threshold."""

    temperature: float = Field(gt=0)  # member logits are divided by it before the softmax
    ood_score: Literal[OOD_SCORES]  # type: ignore[valid-type]  # the score the flag thresholds (a tuple's names)
    ood_threshold: float  # inputs past it are flagged (below it for msp, above it otherwise)
    tpr: float = Field(0.95, gt=0, le=1)  # share of ID validation inputs the threshold lets through


class Strategy(_OpenRecord):
    """How the members' heads were chosen; further keys (budget, pool, ranking, scores) are provenance."""

    name: Literal["taylor", "circuit-acc", "circuit-ood", "circuit-avg", "random"]
    seeds: list[int]  # one pruning seed per member


class BaseModelInfo(_OpenRecord):
    """Where the weights came from: a name, and the local path and sha256 of the file when there was one."""

    name: str = Field(min_length=1)
    path: str | None = None
    sha256: str | None = None


class EncoderSpec(_OpenRecord):
    """One exported encoder of a zero-shot model: its inputs, in order, and its output."""

    inputs: list[str] = Field(min_length=1)
    output: str  # the (first) output's name
    shape: str  # that output's shape, in words
    outputs: list[str] | None = None  # every output, in order, when there is more than one


ModelOutput = Literal["logits", "features", "layer_features"]


class ModelSpec(_OpenRecord):
    """The fused model: its config (``service.core.registry.build_model``), weights file and input/output names."""

    config: dict[str, Any]  # the fused architecture; ``arch`` picks the class
    weights: str = "model.safetensors"  # safetensors file inside the artifact
    inputs: list[str] = Field(min_length=1)  # forward's inputs, in order
    output: str = "logits"
    shape: str = "(B, M, C)"  # the output's shape, in words
    # the graph's outputs in order: member logits, then (artifacts with feature scores) the members' penultimate
    # features (B, M, D), then (artifacts serving mahalanobis_layers) the layer features (B, M, L-1, d); the
    # TorchScript and ONNX exports carry the same outputs
    outputs: list[ModelOutput] = ["logits"]  # pydantic copies the default
    image_encoder: EncoderSpec | None = None  # zero-shot: the exported image encoder
    text_encoder: EncoderSpec | None = None  # zero-shot: the exported text encoder

    @field_validator("outputs")
    @classmethod
    def _logits_first(cls, value: list[str]) -> list[str]:
        order = ["logits", "features", "layer_features"]
        if value != order[: len(value)]:
            raise ValueError(f"outputs must be a prefix of {order} (each output needs the ones before), got {value}")
        return value

    @field_validator("config")
    @classmethod
    def _arch(cls, value: dict[str, Any]) -> dict[str, Any]:
        arches = sorted({f.arch for f in FAMILIES.values()})
        if value.get("arch") not in arches:
            raise ValueError(f"config.arch must be one of {', '.join(arches)}, got {value.get('arch')!r}")
        return value


class Export(_OpenRecord):
    """One exported graph of a classifier and how far it is from eager on the build's check inputs."""

    file: str
    max_abs_diff: float = Field(ge=0)
    tolerance: float = Field(gt=0)
    opset: int | None = None  # ONNX only


class DualExport(_OpenRecord):
    """The two exported encoders of a zero-shot model (image and text), each checked against eager."""

    image: str
    text: str
    max_abs_diff: dict[Literal["image", "text"], float]
    tolerance: float = Field(gt=0)
    opset: int | None = None  # ONNX only
    inputs: dict[Literal["image", "text"], list[str]] | None = None  # ONNX graph inputs actually present


class Bf16Check(_OpenRecord):
    """bf16 autocast vs fp32 on validation inputs: may the server serve this artifact in bf16?"""

    ok: bool
    argmax_agreement: float | None = Field(None, ge=0, le=1)


class ZeroShotSpec(_Record):
    """Zero-shot serving: the prompt template and the model's logit scale (exp'd) and bias."""

    template: str = DEFAULT_TEMPLATE
    logit_scale: float
    logit_bias: float | None = None
    embed_dim: PositiveInt


# ----------------------------------------------------------------------------- OOD statistics
class OODCandidate(_OpenRecord):
    """One OOD score the build considered, with its figures on the validation sets."""

    threshold: float  # at the configured share of ID validation inputs let through
    val_recall: dict[str, float] = Field(default_factory=dict)  # per OOD validation set, the share it flags
    val_mean_recall: float | None = None  # their mean: what the selection maximises
    id_val_flag_rate: float | None = None  # share of the ID validation inputs it flags (about 1 - tpr)


class OODSpec(_OpenRecord):
    """The OOD statistics the server scores with (``file``: safetensors) and how the served score was chosen."""

    file: str = OOD_FILE  # Gaussian statistics and per-member score norms (service.core.ood.ood_tensors)
    scores: list[Literal[OOD_SCORES]]  # type: ignore[valid-type]  # every score the server computes for this artifact
    selected: Literal[OOD_SCORES]  # type: ignore[valid-type]  # the served one (also uncertainty.ood_score)
    forced: bool = False  # true: set by the config (calibration.ood_score), not selected on validation data
    candidates: dict[str, OODCandidate] = Field(default_factory=dict)  # every candidate's validation figures
    # which ID inputs the statistics were fitted on (provenance: the record of data.id.fit, in its own key order)
    fit: dict[str, Any] | None = None
    layers: list[int] | None = None  # mahalanobis_layers: the blocks whose pooled outputs it reads (0 = the first)
    # mahalanobis_layers: how it combines its columns (service.core.ood.LAYER_REDUCTIONS; absent: "max"). The
    # statistics file carries the same choice, which is what the server applies
    layers_reduce: Literal["max", "mean", "members"] | None = None
    # mahalanobis_layers: the layer Gaussians are one per (member, layer) of all the ID fit inputs, not one per class
    # (absent: per class); the statistics file holds them either way, which is what the server applies
    layers_label_free: bool | None = None
    label_free: bool | None = None  # zero-shot: one Gaussian of the ID images, the same score for any labels


# ----------------------------------------------------------------------------- guarantees
class ConformalSpec(_OpenRecord):
    """Prediction sets: the nonconformity score and its defaults; the sorted calibration scores are in the file."""

    method: Literal["lac", "aps", "raps"]
    k_reg: int = Field(1, ge=0)
    lam: float = Field(0.01, ge=0)
    alpha: Unit  # the answers' default miscoverage
    mondrian: bool = False  # class-conditional sets by default
    # training-conditional sets: coverage >= 1 - alpha with probability >= 1 - delta over the calibration draw
    # (service.core.conformal.pac_rank); absent or null: the marginal guarantee
    delta: Unit | None = None
    min_alpha: Unit  # below it a set is every label: 1 / (n + 1), with delta 1 - delta^(1/n)
    min_alpha_per_class: list[float] = Field(default_factory=list)


class OODPValueSpec(_OpenRecord):
    """OOD p-values of the served score against the calibration split's ``n`` ID scores."""

    score: Literal[OOD_SCORES]  # type: ignore[valid-type]
    alpha: Unit  # the flag's default level: p_value <= alpha
    n: PositiveInt
    min_alpha: Unit
    label_free: bool = False  # zero-shot: valid for any labels


class SelectiveTarget(_OpenRecord):
    """One target risk: the certified confidence threshold (None: none certified, the target accepts nothing)."""

    risk: Unit
    certified: bool
    threshold: float | None = None
    calibration_accept_rate: float = Field(ge=0, le=1)
    calibration_risk: float | None = None
    n_accepted: int = Field(ge=0)
    p_value: float = Field(ge=0, le=1)


class OODCut(_OpenRecord):
    """The OOD cut of the risk rules: the build's validation threshold of the served score, fixed before the
    calibration split was looked at."""

    score: str
    threshold: float


class SelectiveSpec(_OpenRecord):
    """Answers with a risk bound: accept iff the OOD score passes ``ood_cut`` and the confidence (MSP) is at least
    the target's threshold; each target certified at level ``delta`` by Learn-then-Test on the calibration split."""

    delta: Unit
    p_value: Literal["binomial", "hb"] = "binomial"
    confidence: Literal["msp"] = "msp"
    default_risk: Unit
    ood_cut: OODCut
    targets: list[SelectiveTarget] = Field(min_length=1)


class DriftSpec(_OpenRecord):
    """The drift alarm: its false-alarm level and score bins (the edges are in the file)."""

    delta: Unit
    bins: int = Field(ge=2)
    seed: int = 0


class GuaranteesSpec(_OpenRecord):
    """What the calibration split certifies (docs/artifact.md, "guarantees"); its tensors are in ``file``."""

    file: str = "guarantees.safetensors"
    # the split: source, size, index hash, class counts (provenance: the record of data.id.calibration)
    calibration: dict[str, Any]
    conformal: ConformalSpec
    ood: OODPValueSpec
    selective: SelectiveSpec
    drift: DriftSpec

    @property
    def calibration_errors(self) -> int | None:
        """The served model's wrong top labels on the calibration split (``calibration.errors``; None: an artifact
        built before the builder counted them)."""
        errors = self.calibration.get("errors")
        return errors if isinstance(errors, int) and not isinstance(errors, bool) else None

    @model_validator(mode="after")
    def _targets(self) -> GuaranteesSpec:
        risks = [t.risk for t in self.selective.targets]
        if self.selective.default_risk not in risks:
            raise ValueError(f"guarantees.selective.default_risk {self.selective.default_risk} is not a target {risks}")
        return self


# ----------------------------------------------------------------------------- the manifest
class FileEntry(_Record):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


ClassifierHeads = list[list[int]]  # per layer, the kept head indices of the base model
ZeroShotHeads = dict[Literal["vision", "text"], list[list[int]]]  # per tower, per layer


class Manifest(_Record):
    """``manifest.json``: everything the server needs to load, check and serve one built model."""

    format_version: Literal[1] = FORMAT_VERSION
    name: str = Field(min_length=1)  # the model's name in API answers and metrics
    # the model's version in API answers and metrics; absent: build.version, else a hash of the manifest
    version: str | None = Field(None, pattern=VERSION_PATTERN)
    family: str  # a row of service.core.families.FAMILIES
    task: Literal["classification", "zero-shot"]
    base_model: BaseModelInfo
    members: PositiveInt  # M
    # the shared trunk: the first k blocks, whole and untrained in every member, run once before the member streams
    # split (model.config.shared_blocks says the same). Absent: k = 0. A top-level field on purpose: a server that
    # predates it refuses the artifact, naming the field, instead of building a model without the trunk
    shared_blocks: PositiveInt | None = None
    heads: list[ClassifierHeads | ZeroShotHeads]  # per member
    head_index: str | None = None  # zero-shot: how the joint (layer, head) pairs of strategy.ranking are numbered
    strategy: Strategy
    labels: list[str] | None = None  # class names in logit order (zero-shot: the build's fixed label set)
    zero_shot: ZeroShotSpec | None = None
    preprocessing: Preprocessing
    uncertainty: Uncertainty
    model: ModelSpec
    exports: dict[Literal["torchscript", "onnx", "aoti"], Export | DualExport] = Field(default_factory=dict)
    precision: dict[Literal["bf16"], Bf16Check] = Field(default_factory=dict)
    ood: OODSpec | None = None  # OOD statistics for logit and feature scores (absent: probability scores only)
    guarantees: GuaranteesSpec | None = None  # sets, OOD p-values, risk rules, drift reference (absent: none)
    metrics: dict[str, Any] = Field(default_factory=dict)  # the build's evaluation headline numbers per method
    data: dict[str, Any] | None = None  # which data the build used (provenance)
    build: dict[str, Any] | None = None  # the resolved build config, timings, versions (provenance)
    files: dict[str, FileEntry] | None = None  # every file of the artifact; written by write_manifest
    # the sha256 of the document this manifest was read from (from_document), which the model version hashes: an
    # artifact written before a field gained its default keeps its version
    _document_sha256: str | None = PrivateAttr(None)

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Manifest:
        """The manifest of a JSON document (``manifest.json`` as read), validated; it remembers the document's
        hash for :meth:`content_sha256`. Raises pydantic's ``ValidationError`` naming the first bad field."""
        manifest = cls.model_validate(doc)
        manifest._document_sha256 = document_sha256(doc)
        return manifest

    def content_sha256(self) -> str:
        """Hex sha256 of the document this manifest was read from, else of its JSON form (:meth:`to_dict`)."""
        return self._document_sha256 or document_sha256(self.to_dict())

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update`` it is no longer the document it was read from (its hash is its own)."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._document_sha256 = None
        return copy

    @field_validator("family")
    @classmethod
    def _family(cls, value: str) -> str:
        if value not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        row = FAMILIES[self.family]
        if self.task != row.task:
            raise ValueError(f"task {self.task} does not match family {self.family}, a {row.task} family")
        if self.model.config.get("arch") != row.arch:
            raise ValueError(
                f"model.config.arch {self.model.config.get('arch')!r} is not family {self.family}'s {row.arch!r}"
            )
        if len(self.heads) != self.members:
            raise ValueError(f"heads lists {len(self.heads)} members, members is {self.members}")
        trunk = self.model.config.get("shared_blocks", 0)
        if trunk != (self.shared_blocks or 0):
            raise ValueError(f"shared_blocks {self.shared_blocks} differs from model.config.shared_blocks {trunk}")
        if trunk and not row.shared_trunk:
            trunked = ", ".join(f.name for f in FAMILIES.values() if f.shared_trunk)
            raise ValueError(f"shared_blocks: a shared trunk is for the {trunked} families")
        if self.task == "classification":
            self._check_classifier()
        else:
            self._check_zero_shot()
        self._check_ood()
        if self.guarantees is not None and self.guarantees.ood.score != self.uncertainty.ood_score:
            raise ValueError(
                f"guarantees.ood.score {self.guarantees.ood.score!r} differs from uncertainty.ood_score "
                f"{self.uncertainty.ood_score!r}"
            )
        if self.files is not None:
            self._check_listed()
        return self

    def _check_ood(self) -> None:
        served = self.uncertainty.ood_score
        if served in LOGIT_SCORES + FEATURE_SCORES and (self.ood is None or served not in self.ood.scores):
            raise ValueError(f"uncertainty.ood_score {served!r} needs an ood block listing it (OOD statistics)")
        if self.ood is not None and self.ood.selected != served:
            raise ValueError(f"ood.selected {self.ood.selected!r} differs from uncertainty.ood_score {served!r}")
        needs_features = self.ood is not None and any(s in FEATURE_SCORES for s in self.ood.scores)
        if needs_features and "features" not in self.model.outputs:
            raise ValueError("ood.scores lists feature scores but model.outputs has no 'features'")
        if self.ood is not None and "mahalanobis_layers" in self.ood.scores:
            if "layer_features" not in self.model.outputs or not self.ood.layers:
                raise ValueError(
                    "ood.scores lists mahalanobis_layers: it needs model.outputs 'layer_features' and ood.layers"
                )

    def _check_classifier(self) -> None:
        if not self.labels:
            raise ValueError("a classification artifact needs its labels")
        n = self.model.config.get("num_classes")
        if n is not None and int(n) != len(self.labels):
            raise ValueError(f"{len(self.labels)} labels but the model has {n} classes")
        if any(not isinstance(h, list) for h in self.heads):
            raise ValueError("heads: a classifier lists per member, per layer, the kept heads")
        if any(isinstance(e, DualExport) for e in self.exports.values()):
            raise ValueError("exports: a classifier's export is one file (file, max_abs_diff, tolerance)")

    def _check_zero_shot(self) -> None:
        if self.zero_shot is None:
            raise ValueError("a zero-shot artifact needs its zero_shot block (template, logit_scale, embed_dim)")
        if not isinstance(self.preprocessing, ImagePreprocessing) or self.preprocessing.text is None:
            raise ValueError("a zero-shot artifact needs image preprocessing with a text part")
        if any(isinstance(e, Export) for e in self.exports.values()):
            raise ValueError("exports: a zero-shot artifact exports an image and a text encoder")

    def referenced_files(self) -> list[str]:
        """Files the manifest points to: weights, exports; for a tokenizer folder, the folder with a slash."""
        refs = [self.model.weights] + ([self.ood.file] if self.ood is not None else [])
        for e in self.exports.values():
            refs += [e.file] if isinstance(e, Export) else [e.image, e.text]
        prep = self.preprocessing
        tok = prep.tokenizer if isinstance(prep, TextPreprocessing) else (prep.text.tokenizer if prep.text else None)
        if tok is not None:
            refs.append(tok.rstrip("/") + "/")
        return refs

    def _check_listed(self) -> None:
        assert self.files is not None
        for ref in self.referenced_files():
            found = any(f.startswith(ref) for f in self.files) if ref.endswith("/") else ref in self.files
            if not found:
                raise ValueError(f"files: {ref!r} is referenced by the manifest but is not in the artifact")

    # ------------------------------------------------------------------------- what the server asks
    def export_file(self, kind: str) -> str | None:
        """The file of a classifier's export ``kind`` (``torchscript``, ``onnx``, ``aoti``); None without one."""
        exp = next((e for k, e in self.exports.items() if k == kind), None)
        return exp.file if isinstance(exp, Export) else None

    @property
    def bf16_ok(self) -> bool:
        """Whether the build found bf16 predictions agree with fp32 (``precision.bf16.ok``)."""
        check = self.precision.get("bf16")
        return check is not None and check.ok

    @property
    def recorded_version(self) -> str | None:
        """The version the manifest records: ``version``, else ``build.version`` (None: neither)."""
        if self.version is not None:
            return self.version
        recorded = (self.build or {}).get("version")
        return None if recorded is None else str(recorded)
