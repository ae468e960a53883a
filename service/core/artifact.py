"""The artifact contract, owned here: typed models of ``manifest.json``, its one writer and its validator.

The format is documented for users in ``docs/artifact.md``; this module is its definition in code.
:class:`Manifest` (with :class:`ImagePreprocessing` / :class:`TextPreprocessing`, :class:`Uncertainty`,
:class:`ModelSpec`, the export records) types every field; :func:`build_manifest` is the one constructor every
writer calls (the classifier and zero-shot builders, the test fixtures); :func:`write_manifest` adds the
``files`` table (sha256 and size of every file) and writes it; :func:`load_manifest` validates a manifest read
from disk through the same models, so a field the writer could not produce is refused at load time, naming the
field. :func:`verify_files` then checks every listed file against its hash.

Cross-field rules (checked by :class:`Manifest`): ``heads`` has one entry per member; a classification artifact
has labels and as many as its model's classes; a zero-shot artifact has a ``zero_shot`` block and image
preprocessing with a ``text`` part; every file the manifest points to (weights, exports, tokenizer) is listed in
``files`` once files are listed.

Imports only the standard library and pydantic: the server reads artifacts without the builder's dependencies.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "DEFAULT_TEMPLATE",
    "FORMAT_VERSION",
    "MANIFEST",
    "OOD_FILE",
    "OOD_SCORES",
    "ArtifactError",
    "BaseModelInfo",
    "Bf16Check",
    "ClipTextPreprocessing",
    "ConformalSpec",
    "DriftSpec",
    "DualExport",
    "Export",
    "FileEntry",
    "GuaranteesSpec",
    "ImagePreprocessing",
    "Manifest",
    "ModelSpec",
    "OODCandidate",
    "OODPValueSpec",
    "OODSpec",
    "Preprocessing",
    "SelectiveSpec",
    "SelectiveTarget",
    "Strategy",
    "TextPreprocessing",
    "Uncertainty",
    "ZeroShotSpec",
    "artifact_version",
    "build_manifest",
    "file_sha256",
    "list_files",
    "load_manifest",
    "parse_manifest",
    "verify_files",
    "write_manifest",
]

FORMAT_VERSION: Final = 1
MANIFEST = "manifest.json"
OOD_FILE = "ood.safetensors"  # the OOD statistics (.ood.ood_tensors), when the artifact has them
DEFAULT_TEMPLATE = "A photo of a {label}."  # the zero-shot prompt when neither the artifact nor a request names one
# the OOD scores a threshold can be calibrated on (.uncertainty.OOD_METRICS, .ood compute them; a test holds the two
# lists equal): the ensemble's probability scores, then logit and feature scores (docs/artifact.md)
OOD_SCORES = (
    "msp",
    "entropy",
    "mutual_information",
    "energy",
    "max_logit",
    "mahalanobis",
    "relative_mahalanobis",
    "mahalanobis_mi",
    "mahalanobis_energy",
    "mahalanobis_layers",
)
LOGIT_SCORES = ("energy", "max_logit")  # need the artifact's OOD statistics (ood block)
# need them and the features output
FEATURE_SCORES = ("mahalanobis", "relative_mahalanobis", "mahalanobis_mi", "mahalanobis_energy", "mahalanobis_layers")
STRATEGIES = ("taylor", "circuit-acc", "circuit-ood", "circuit-avg", "random")
# a model version as the API shows it (URL path segment of the Open Inference Protocol): no slash, no space
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ArtifactError(RuntimeError):
    """An artifact that cannot be used: missing or corrupt file, bad manifest. The message names the file."""


# ----------------------------------------------------------------------------- the models
class _Record(BaseModel):
    """A manifest block whose fields are all known: unknown keys are refused (a typo is an error, not ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written into ``manifest.json`` (unset optional fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class _OpenRecord(_Record):
    """A descriptive block: its named fields are typed, further keys are kept as written (build provenance)."""

    model_config = ConfigDict(extra="allow", frozen=True)


PositiveInt = Annotated[int, Field(ge=1)]


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
    outputs: list[Literal["logits", "features", "layer_features"]] = ["logits"]  # pydantic copies the default

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
        if value.get("arch") not in ("vit", "bert", "clip"):
            raise ValueError(f"config.arch must be vit, bert or clip, got {value.get('arch')!r}")
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
    fit: dict[str, Any] | None = None  # which ID inputs the statistics were fitted on (provenance)
    layers: list[int] | None = None  # mahalanobis_layers: the blocks whose pooled outputs it reads (0 = the first)


Unit = Annotated[float, Field(gt=0, lt=1)]  # a level in (0, 1): alpha, delta, a target risk


class ConformalSpec(_OpenRecord):
    """Prediction sets: the nonconformity score and its defaults; the sorted calibration scores are in the file."""

    method: Literal["lac", "aps", "raps"]
    k_reg: int = Field(1, ge=0)
    lam: float = Field(0.01, ge=0)
    alpha: Unit  # the answers' default miscoverage
    mondrian: bool = False  # class-conditional sets by default
    min_alpha: Unit  # 1 / (n + 1): below it a set is every label
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


class SelectiveSpec(_OpenRecord):
    """Answers with a risk bound: accept iff the OOD score passes ``ood_cut`` and the confidence (MSP) is at least
    the target's threshold; each target certified at level ``delta`` by Learn-then-Test on the calibration split."""

    delta: Unit
    p_value: Literal["binomial", "hb"] = "binomial"
    confidence: Literal["msp"] = "msp"
    default_risk: Unit
    ood_cut: dict[str, Any]  # {"score", "threshold"}: the build's validation threshold, fixed before the split
    targets: list[SelectiveTarget] = Field(min_length=1)


class DriftSpec(_OpenRecord):
    """The drift alarm: its false-alarm level and score bins (the edges are in the file)."""

    delta: Unit
    bins: int = Field(ge=2)
    seed: int = 0


class GuaranteesSpec(_OpenRecord):
    """What the calibration split certifies (docs/artifact.md, "guarantees"); its tensors are in ``file``."""

    file: str = "guarantees.safetensors"
    calibration: dict[str, Any]  # the split: size, source, index hash, class counts
    conformal: ConformalSpec
    ood: OODPValueSpec
    selective: SelectiveSpec
    drift: DriftSpec

    @model_validator(mode="after")
    def _targets(self) -> GuaranteesSpec:
        risks = [t.risk for t in self.selective.targets]
        if self.selective.default_risk not in risks:
            raise ValueError(f"guarantees.selective.default_risk {self.selective.default_risk} is not a target {risks}")
        return self


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
    family: Literal["vit", "bert", "clip"]
    task: Literal["classification", "zero-shot"]
    base_model: BaseModelInfo
    members: PositiveInt  # M
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

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if len(self.heads) != self.members:
            raise ValueError(f"heads lists {len(self.heads)} members, members is {self.members}")
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
        if self.family != "clip":
            raise ValueError(f"task zero-shot needs family clip, not {self.family}")
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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of ``manifest.json``."""
        return self.model_dump(mode="json", exclude_none=True)


# ----------------------------------------------------------------------------- writing
def build_manifest(
    *,
    name: str,
    family: str,
    task: str,
    base_model: dict[str, Any],
    heads: list[Any],
    strategy: dict[str, Any],
    labels: list[str] | None,
    preprocessing: ImagePreprocessing | TextPreprocessing | dict[str, Any],
    uncertainty: dict[str, Any],
    model: dict[str, Any],
    exports: dict[str, Any] | None = None,
    precision: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    build: dict[str, Any] | None = None,
    zero_shot: dict[str, Any] | None = None,
    head_index: str | None = None,
    ood: dict[str, Any] | None = None,
    version: str | None = None,
    guarantees: dict[str, Any] | None = None,
) -> Manifest:
    """The one constructor of a manifest (``members`` is ``len(heads)``); raises :class:`ArtifactError` naming the
    first bad field. ``files`` is added by :func:`write_manifest`."""
    fields = {
        "name": name,
        "family": family,
        "task": task,
        "base_model": base_model,
        "members": len(heads),
        "heads": heads,
        "head_index": head_index,
        "strategy": strategy,
        "labels": labels,
        "zero_shot": zero_shot,
        "preprocessing": preprocessing.to_dict() if isinstance(preprocessing, BaseModel) else preprocessing,
        "uncertainty": uncertainty,
        "model": model,
        "exports": exports or {},
        "precision": precision or {},
        "metrics": metrics or {},
        "data": data,
        "build": build,
        "ood": ood,
        "version": version,
        "guarantees": guarantees,
    }
    return parse_manifest(_jsonable(fields), "manifest")


def list_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest and hidden files, sorted."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def write_manifest(out: str | Path, manifest: Manifest | dict[str, Any]) -> Path:
    """Add ``files`` (sha256 and size of every file in ``out``) to ``manifest``, validate and write it."""
    out = Path(out)
    doc = manifest.to_dict() if isinstance(manifest, Manifest) else _jsonable(dict(manifest))
    doc["files"] = {
        p.relative_to(out).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size} for p in list_files(out)
    }
    doc = parse_manifest(doc, out).to_dict()
    path = out / MANIFEST
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _jsonable(x: Any) -> Any:
    """Plain JSON types from what builders hand over (numpy arrays and scalars, paths, tuples)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist"):  # numpy / torch arrays and scalars
        return x.tolist()
    return x


# ----------------------------------------------------------------------------- reading
def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))


def parse_manifest(doc: dict[str, Any], where: str | Path = "manifest") -> Manifest:
    """Validate a manifest's JSON form through :class:`Manifest`; :class:`ArtifactError` names the first bad field."""
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = _where(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ArtifactError(f"{where}: manifest field {field or '(top level)'}: {msg}") from None


def load_manifest(root: str | Path) -> dict[str, Any]:
    """Read ``root/manifest.json`` and validate every field (:class:`Manifest`); return its JSON form."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest.json (is {root} an artifact directory?)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(doc, dict):
        raise ArtifactError(f"{path}: the manifest must be a JSON object")
    if "files" not in doc:
        raise ArtifactError(f"{path}: manifest field files: Field required (write it with write_manifest)")
    parse_manifest(doc, path)
    return doc


def verify_files(root: str | Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists exists with its size and sha256; raise naming the first bad file."""
    root = Path(root).resolve()
    for rel, meta in manifest["files"].items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise ArtifactError(f"{root}: manifest lists {rel!r}, which is outside the artifact")
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != meta["size"]:
            raise ArtifactError(f"{path}: size {path.stat().st_size} != {meta['size']} in the manifest (corrupt?)")
        digest = file_sha256(path)
        if digest != meta["sha256"]:
            raise ArtifactError(f"{path}: sha256 {digest[:12]}… != {meta['sha256'][:12]}… in the manifest (corrupt?)")


def artifact_version(manifest: dict[str, Any]) -> str:
    """The model version of a validated manifest: its ``version``, else ``build.version``, else the first 12 hex
    digits of the sha256 of the manifest itself (canonical JSON). The manifest holds the sha256 of every file, and
    :func:`verify_files` checks them at load, so the hash covers the weights, the exports, the tokenizer and every
    setting of the manifest (labels, temperature, OOD threshold): any change to what the model answers changes it."""
    recorded = manifest.get("version")
    if recorded is None and isinstance(manifest.get("build"), dict):
        recorded = manifest["build"].get("version")
    if recorded is not None:
        text = str(recorded)
        if not re.fullmatch(VERSION_PATTERN, text):
            raise ArtifactError(f"manifest build.version {text!r} is not a version (letters, digits, '.', '_', '-')")
        return text
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
