"""Build configuration: dataclasses filled from a YAML file, every value overridable by a flag.

``python offline/build.py --config FILE --out DIR [--section.key VALUE ...]``; ``--help``
lists every key with its default and meaning. Validation happens here, before
any model is loaded or trained, and stops with one line naming the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from offline.compute import DEVICES, PRECISIONS, resolve_device
from offline.families import ADAPTERS
from service.core.artifact import OOD_SCORES as SERVED_SCORES
from service.core.scores import ZERO_SHOT_SCORES as ZERO_SHOT_SERVED


def families() -> tuple[str, ...]:
    """The model families: one adapter each, registered in ``offline.families.ADAPTERS``."""
    return tuple(ADAPTERS)


STRATEGIES = ("taylor", "circuit-acc", "circuit-ood", "circuit-avg", "random")
MEMBER_DATA = ("same", "order", "bootstrap")  # what each member fine-tunes on (hydra.member_data)
OOD_SCORES = ("auto", *SERVED_SCORES)  # auto: the best mean recall on the OOD validation sets
# labels come per request: no class statistics; the feature scores are label-free (distances to the ID images)
ZERO_SHOT_SCORES = ("auto", *ZERO_SHOT_SERVED)
SETTINGS = ("fashion-mnist", "tweets", "image-folder", "text-file")
AUGMENT = ("none", "flip", "crop", "crop+flip")  # data.augment
CONFORMAL_SCORES = ("lac", "aps", "raps")  # guarantees.method (service.core.conformal.SCORES)
BASELINES = ("lora_ensemble", "batch_ensemble", "laplace")  # base.baselines (offline.pipelines.baselines)
BASELINE_MODULES = {"lora_ensemble": ("peft",), "batch_ensemble": ("torch_uncertainty",), "laplace": ("laplace",)}


class ConfigError(ValueError):
    """A configuration problem, reported as one line before heavy work starts."""


@dataclass
class BaseModelConfig:
    source: str = "train-vit"  # train-vit | minilm | timm:<name> | hf:<folder or hub name> | lit | openclip:<name|json>
    path: str | None = None  # local weights: timm .safetensors/.pth, HF model folder, or open_clip checkpoint
    arch: dict[str, Any] = field(default_factory=dict)  # train-vit: make_vit kwargs (embed_dim, depth, num_heads, ...)
    preset: str = "vit_fast"  # training preset: offline.train PRESETS (vit_*, bert_*) or lit_fast / lit_full
    steps: int | None = None  # override the preset's step budget
    max_length: int = 64  # text: tokenizer max length
    # folder keeping trained base models, one per (family, base, data) setting: builds that differ only in their
    # hydra / calibration / export settings reuse the base (and a stopped base training resumes); unset = the
    # artifact's own .checkpoints (resumable, removed when the build finishes)
    cache_dir: str | None = None
    seed: int | None = None  # training seed of the base model (new head, dropout, batch order); default the preset's
    # report a Deep Ensemble baseline of this many base models, trained alike with seeds seed, seed + 1, ... on the
    # same data (its row scores the same OOD statistics as Hydra's); 0 = none. Each extra base costs a base training
    deep_ensemble: int = 0
    # lit: a timm ViT checkpoint (.safetensors, e.g. offline.train.pretrain's backbone) the image tower starts from
    # instead of random weights; its architecture must be the preset's vision tower (base.arch)
    image_init: str | None = None
    # efficient-ensemble baselines the report adds beside Hydra, from the same base, data and member fine-tuning
    # budget (offline/pipelines/baselines.py): lora_ensemble, batch_ensemble, laplace (vit and bert builds on the CPU)
    baselines: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    setting: str = "fashion-mnist"  # fashion-mnist | tweets | image-folder | text-file
    path: str | None = None  # image-folder root or CSV/JSONL file (user data)
    ood_paths: dict[str, str] = field(default_factory=dict)  # user data: name -> folder/file of OOD test inputs
    ood_val_path: str | None = None  # user data: OOD validation inputs (circuits, threshold); kept apart from test
    labels: list[str] | None = None  # expected class names, checked against the data
    max_train: int = 6000  # training examples for the base model and members
    max_val: int = 1000  # ID validation examples (temperature, threshold, circuits)
    max_test: int = 2000  # ID test examples for the report
    max_ood: int = 1000  # examples per OOD set
    max_fit: int | None = None  # ID inputs held out from training for the OOD statistics; default: max_val
    # ID inputs held out from everything else for the guarantees (conformal sets, OOD p-values, risk rules, the drift
    # alarm); 0 = none. A user's data gives it at most the validation share (USER_EVAL_FRACTION)
    max_calibration: int = 2000
    seed: int = 0  # split seed
    # ID test inputs copied under every corruption of the modality at each of data.shift_severities for the report's
    # shift section (offline.method.corruptions: noise, blur, contrast, JPEG, rotation; typos, dropped words); 0 = no
    # shift section
    shift_inputs: int = 0
    shift_severities: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # of the corruptions' 1 to 5
    # images: training-time augmentation of the base and the members: none | flip | crop | crop+flip (random resized
    # crops of data.crop_scale..1 of the area, then flips); default: the training preset's flips (and hydra.augment)
    augment: str | None = None
    crop_scale: float = 0.35  # the smallest crop area of data.augment crop, as a fraction of the image
    # zero-shot builds: a user's own words for the same classes (class name -> word); the report adds every row
    # again with the prompts of these words, Hydra at its served temperature (rows "<method>@words")
    label_words: dict[str, str] = field(default_factory=dict)


@dataclass
class HydraConfig:
    members: int = 3  # M, the number of ensemble members
    strategy: str = "taylor"  # taylor | circuit-acc | circuit-ood | circuit-avg | random
    prune_per_layer: int | None = None  # heads each member prunes in every layer ...
    prune_total: int | None = None  # ... or in the whole model (exactly one of the two)
    pool: float | None = None  # candidate pool / budget (default: the paper's 100/48, at most 100/144 of the heads)
    seeds: list[int] | None = None  # pruning seeds, one per member (default 0..M-1)
    calib_samples: int = 256  # samples for Taylor gradients and circuit scoring
    mlp: str = "shared"  # shared (the paper's averaged MLP) | per_member
    finetune_steps: int = 0  # fine-tuning steps per member after pruning (0 = none)
    finetune_preset: str | None = None  # offline.train PRESETS entry for member fine-tuning (default: the base one)
    unfreeze: str = "attention+mlp+norm+head"  # which parts the member fine-tuning trains
    member_data: str = "same"  # member fine-tuning data: same (one batch order) | order (own order) | bootstrap
    reinit_head: bool = False  # re-initialise each member's classifier head (seeded per member) before fine-tuning
    label_smoothing: float | None = None  # member fine-tuning label smoothing (default: the preset's)
    lr: float | None = None  # member fine-tuning peak learning rate (default: the preset's)
    augment: bool | None = None  # images: random horizontal flips in member fine-tuning (default: the preset's)
    distill: float = 0.0  # weight of distillation from the unpruned base in member fine-tuning (0 = labels only)
    distill_temperature: float = 2.0  # the distillation softmax temperature ...
    distill_temperatures: list[float] | None = None  # ... or one per member (members learn at different temperatures)
    finetune_blocks: int = 0  # member fine-tuning trains only the last N transformer blocks and the head (0 = all)
    # the shared trunk: members prune and fine-tune only the blocks from k on, and the fused model runs blocks < k
    # once, before the member streams split (cost about (k + M (L - k) c) / L of Single); in [0, L); vit and bert
    # only; with k > 0, finetune_blocks 0 trains every block after the trunk, and at most L - k may be given
    shared_blocks: int = 0


@dataclass
class CalibrationConfig:
    temperature: bool = True  # fit a temperature on ID validation data
    ood_score: str = "auto"  # auto (best mean recall on the OOD validation sets), msp, energy, mahalanobis, ...
    tpr: float = 0.95  # fraction of ID validation inputs that must pass the OOD threshold


@dataclass
class GuaranteesConfig:
    # what the calibration split (data.max_calibration) certifies; docs/api.md "Guarantees"
    method: str = "lac"  # conformal nonconformity score of the prediction sets: lac | aps | raps
    k_reg: int = 1  # raps: the rank from which labels are penalised
    lam: float = 0.01  # raps: the penalty per rank
    alpha: float = 0.1  # the sets' default miscoverage (a request may ask for any alpha in (0, 1))
    mondrian: bool = False  # class-conditional sets: coverage at least 1 - alpha for every class
    # training-conditional sets: this artifact's coverage is at least 1 - alpha with probability >= 1 - set_delta
    # over the calibration draw (service.core.conformal.pac_rank); null: the marginal guarantee (on average over it)
    set_delta: float | None = 0.1
    ood_alpha: float = 0.05  # the OOD flag's default level: p_value <= ood_alpha (false alarms on ID <= ood_alpha)
    risks: list[float] = field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1])  # certified target error rates
    risk: float = 0.05  # the answers' default target (one of risks)
    delta: float = 0.1  # each risk rule holds with probability >= 1 - delta over the calibration draw
    p_value: str = "binomial"  # Learn-then-Test p-value: binomial | hb (Hoeffding-Bentkus)
    drift_delta: float = 0.01  # the drift alarm's delta: its guarantee holds w.p. 1 - delta; alarm level 1000 / delta
    drift_bins: int = 2048  # score bins written to the artifact (the server's drift alarm does not use them)


@dataclass
class ExportConfig:
    torchscript: bool = True  # write model.ts and check it against eager
    onnx: bool = True  # write model.onnx and check it against eager
    # compile model.pt2 ahead of time for the CPU (torch.export + AOTInductor; minutes on 2 cores) and check it
    aoti: bool = False
    tolerance: float = 1e-4  # max abs difference export vs eager (logits and features) before the build fails
    bf16_check: bool = True  # record bf16-vs-fp32 agreement for the server's precision=auto


@dataclass
class ComputeConfig:
    # where training, head scoring, calibration and evaluation run: auto (CUDA when available) | cpu | cuda | cuda:<i>
    device: str = "auto"
    # autocast of training and head scoring: auto (bf16 on CUDA and on a CPU with native bf16, i.e. avx512_bf16 or
    # amx_bf16; fp32 on other CPUs, which emulate bf16 slowly: offline.compute.resolve_precision) | fp32 | bf16
    precision: str = "auto"
    eval_precision: str = "fp32"  # autocast of calibration and evaluation: fp32 (what the fp32 server sees) | bf16
    workers: int = 0  # DataLoader processes decoding training batches (0 = the main process)


@dataclass
class BuildConfig:
    name: str = "hydra"  # model name used in API responses and metrics
    family: str = "vit"  # vit | bert | clip
    threads: int = 0  # torch threads (0 = torch default)
    base: BaseModelConfig = field(default_factory=BaseModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hydra: HydraConfig = field(default_factory=HydraConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    guarantees: GuaranteesConfig = field(default_factory=GuaranteesConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    build: ComputeConfig = field(default_factory=ComputeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {f.name: f.type for f in dataclasses.fields(BuildConfig)}


_FIELD = re.compile(r"(\w+)\s*:")  # a dataclass field's line: `name: type = default`


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source, the flag's help text: the ``# comment`` after the field, else the
    ``#`` lines right above it (a description too long for one line)."""
    out: dict[str, str] = {}
    try:
        src = inspect.getsource(cls)
    except OSError:
        return out
    above: list[str] = []
    for line in src.splitlines():
        line = line.strip()
        if line.startswith("#"):
            above.append(line.lstrip("#").strip())
            continue
        field_line = _FIELD.match(line)
        if field_line:
            after = line.split("#", 1)[1].strip() if "#" in line else ""
            out[field_line.group(1)] = after or " ".join(above)
        above = []
    return out


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(BuildConfig)
    return {name: hints[name] for name in _SECTIONS if dataclasses.is_dataclass(hints[name])}


def _parse_value(text: str) -> Any:
    """Flag values are YAML scalars/lists: ``6``, ``0.5``, ``true``, ``null``, ``[0,1,2]``."""
    return yaml.safe_load(text)


def _merge(cfg: BuildConfig, data: dict[str, Any], origin: str) -> None:
    sections = _section_classes()
    for key, value in data.items():
        if key in sections:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{origin}: '{key}' must be a mapping, got {type(value).__name__}")
            sub = getattr(cfg, key)
            names = {f.name for f in dataclasses.fields(sub)}
            for k, v in value.items():
                if k not in names:
                    raise ConfigError(f"{origin}: unknown key '{key}.{k}'; known: {', '.join(sorted(names))}")
                setattr(sub, k, v)
        elif key in {f.name for f in dataclasses.fields(cfg)}:
            setattr(cfg, key, value)
        else:
            known = sorted(f.name for f in dataclasses.fields(cfg))
            raise ConfigError(f"{origin}: unknown key '{key}'; known: {', '.join(known)}")


def read_yaml_mapping(path: str | Path, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """The YAML mapping in the file ``path`` (empty: ``{}``); ``error`` naming the file when it does not exist, is
    not YAML or its top level is not a mapping. Every config file of the builder is read here."""
    p = Path(path)
    if not p.is_file():
        raise error(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise error(f"{p}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise error(f"{p}: the top level must be a mapping")
    return data


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> BuildConfig:
    """Read a YAML config, apply dotted overrides (``{"hydra.members": 5}``), validate."""
    cfg = BuildConfig()
    if path is not None:
        p = Path(path)
        data = read_yaml_mapping(p)
        _merge(cfg, data, str(p))
    nested: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        if "." in dotted:
            sec, key = dotted.split(".", 1)
            nested.setdefault(sec, {})[key] = value
        else:
            nested[dotted] = value
    _merge(cfg, nested, "command line")
    validate(cfg)
    return cfg


def _typed(where: str, hint: Any, value: Any) -> Any:
    """``value`` checked against the field's type (pydantic, strict: ``true`` is no integer, ``"x"`` no number;
    an integer is a valid float), converted; a :class:`ConfigError` naming the key and the expected type."""
    try:
        return TypeAdapter(hint).validate_python(value, strict=True)
    except ValidationError as e:
        want = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        msg = e.errors(include_url=False)[0]["msg"]
        raise ConfigError(f"{where}: {value!r} is not a valid {want} ({msg})") from None


def check_types(cfg: BuildConfig) -> None:
    """Every value of ``cfg`` against its field's type, before any range check (a string where a number belongs
    must be a one-line error, not a comparison failing somewhere later)."""
    for name, hint in typing.get_type_hints(BuildConfig).items():
        value = getattr(cfg, name)
        if not dataclasses.is_dataclass(hint):
            setattr(cfg, name, _typed(name, hint, value))
            continue
        for key, sub_hint in typing.get_type_hints(hint).items():
            setattr(value, key, _typed(f"{name}.{key}", sub_hint, getattr(value, key)))


def _check_ranges(cfg: BuildConfig) -> None:
    """The numeric ranges no type says."""
    h, d = cfg.hydra, cfg.data
    if h.pool is not None and not h.pool > 0:
        raise ConfigError(f"hydra.pool must be > 0 (the candidate pool / budget ratio) or null, got {h.pool!r}")
    if h.seeds is not None and len(set(h.seeds)) != len(h.seeds):
        raise ConfigError(f"hydra.seeds must differ (members differ by their pruning seed), got {h.seeds}")
    if not cfg.export.tolerance > 0:
        raise ConfigError(f"export.tolerance must be > 0, got {cfg.export.tolerance!r}")
    for key in ("max_train", "max_val", "max_test", "max_ood"):
        if getattr(d, key) < 1:
            raise ConfigError(f"data.{key} must be >= 1, got {getattr(d, key)}")
    if not isinstance(d.shift_inputs, int) or d.shift_inputs < 0:
        raise ConfigError(f"data.shift_inputs must be an integer >= 0 (0: no shift section), got {d.shift_inputs!r}")
    zero_shot = cfg.family in ADAPTERS and ADAPTERS[cfg.family].row.task == "zero-shot"
    if d.label_words and not zero_shot:
        raise ConfigError("data.label_words is for zero-shot builds (family clip): a classifier's labels are its own")
    if not all(isinstance(w, str) and w.strip() for w in d.label_words.values()):
        raise ConfigError("data.label_words: every class needs a word that is not empty")
    sev = d.shift_severities
    if not sev or sorted(set(sev)) != list(sev) or not set(sev) <= {1, 2, 3, 4, 5}:
        raise ConfigError(f"data.shift_severities must be distinct increasing severities of 1 to 5, got {sev!r}")
    if cfg.base.deep_ensemble == 1 or cfg.base.deep_ensemble < 0:
        raise ConfigError(f"base.deep_ensemble must be 0 (none) or >= 2 base models, got {cfg.base.deep_ensemble}")
    if h.calib_samples < 1 or h.finetune_steps < 0 or cfg.threads < 0:
        raise ConfigError("hydra.calib_samples must be >= 1, hydra.finetune_steps and threads >= 0")


def _check_compute(c: ComputeConfig) -> None:
    """The build device exists and the precisions are known (before any data or weights load)."""
    if c.device not in DEVICES and not c.device.startswith("cuda:"):
        raise ConfigError(f"build.device must be one of {DEVICES} or cuda:<index>, got {c.device!r}")
    for key in ("precision", "eval_precision"):
        if getattr(c, key) not in PRECISIONS:
            raise ConfigError(f"build.{key} must be one of {PRECISIONS}, got {getattr(c, key)!r}")
    if c.workers < 0:
        raise ConfigError(f"build.workers must be >= 0, got {c.workers}")
    try:
        resolve_device(c.device)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"build.device: {e}") from None


def _check_guarantees(g: GuaranteesConfig) -> None:
    if g.method not in CONFORMAL_SCORES:
        raise ConfigError(f"guarantees.method must be one of {CONFORMAL_SCORES}, got {g.method!r}")
    for name in ("alpha", "ood_alpha", "delta", "drift_delta", "risk"):
        if not 0 < getattr(g, name) < 1:
            raise ConfigError(f"guarantees.{name} must be in (0, 1), got {getattr(g, name)}")
    if g.set_delta is not None and not 0 < g.set_delta < 1:
        raise ConfigError(f"guarantees.set_delta must be in (0, 1) or null, got {g.set_delta}")
    if not g.risks or any(not 0 < r < 1 for r in g.risks) or len(set(g.risks)) != len(g.risks):
        raise ConfigError(f"guarantees.risks must be distinct target risks in (0, 1), got {g.risks}")
    if g.risk not in g.risks:
        raise ConfigError(f"guarantees.risk {g.risk} must be one of guarantees.risks {g.risks}")
    if g.p_value not in ("binomial", "hb"):
        raise ConfigError(f"guarantees.p_value must be 'binomial' or 'hb', got {g.p_value!r}")
    if g.k_reg < 0 or g.lam < 0:
        raise ConfigError(f"guarantees.k_reg and guarantees.lam must be >= 0, got {g.k_reg}, {g.lam}")
    if g.drift_bins < 2:
        raise ConfigError(f"guarantees.drift_bins must be >= 2, got {g.drift_bins}")


def _check_hydra(h: HydraConfig) -> None:
    """The pruning strategy, budget, members and their fine-tuning recipe."""
    if not isinstance(h.members, int) or h.members < 1:
        raise ConfigError(f"hydra.members must be an integer >= 1, got {h.members!r}")
    if h.strategy not in STRATEGIES:
        raise ConfigError(f"hydra.strategy must be one of {STRATEGIES}, got {h.strategy!r}")
    if (h.prune_per_layer is None) == (h.prune_total is None):
        raise ConfigError("give exactly one of hydra.prune_per_layer and hydra.prune_total")
    n = h.prune_per_layer if h.prune_per_layer is not None else h.prune_total
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"the pruning budget must be an integer >= 0, got {n!r}")
    if h.seeds is not None and len(h.seeds) != h.members:
        raise ConfigError(f"hydra.seeds lists {len(h.seeds)} seeds for {h.members} members")
    if h.mlp not in ("shared", "per_member"):
        raise ConfigError(f"hydra.mlp must be 'shared' or 'per_member', got {h.mlp!r}")
    if h.member_data not in MEMBER_DATA:
        raise ConfigError(f"hydra.member_data must be one of {MEMBER_DATA}, got {h.member_data!r}")
    if h.label_smoothing is not None and not 0 <= h.label_smoothing < 1:
        raise ConfigError(f"hydra.label_smoothing must be in [0, 1), got {h.label_smoothing!r}")
    if h.lr is not None and not h.lr > 0:
        raise ConfigError(f"hydra.lr must be > 0, got {h.lr!r}")
    _check_distillation(h)


def _check_distillation(h: HydraConfig) -> None:
    """The distillation weight, its temperatures (one per member when listed) and the partial fine-tuning."""
    if not 0 <= h.distill <= 1:
        raise ConfigError(f"hydra.distill must be in [0, 1], got {h.distill!r}")
    per_member = h.distill_temperatures
    if per_member is not None and len(per_member) != h.members:
        raise ConfigError(f"hydra.distill_temperatures lists {len(per_member)} temperatures for {h.members} members")
    temps = [h.distill_temperature, *(per_member or [])]  # a bad value is refused even where the list overrides it
    if not all(isinstance(t, (int, float)) and t > 0 for t in temps):
        raise ConfigError(f"distillation temperatures must be > 0, got {temps}")
    if not isinstance(h.finetune_blocks, int) or h.finetune_blocks < 0:
        raise ConfigError(f"hydra.finetune_blocks must be an integer >= 0, got {h.finetune_blocks!r}")
    if not isinstance(h.shared_blocks, int) or isinstance(h.shared_blocks, bool) or h.shared_blocks < 0:
        raise ConfigError(f"hydra.shared_blocks must be an integer >= 0, got {h.shared_blocks!r}")


def _check_calibration(c: CalibrationConfig, family: str) -> None:
    """The served OOD score (one a zero-shot build can serve, for a zero-shot family) and the threshold's TPR."""
    if c.ood_score not in OOD_SCORES:
        raise ConfigError(f"calibration.ood_score must be one of {OOD_SCORES}, got {c.ood_score!r}")
    if ADAPTERS[family].row.task == "zero-shot" and c.ood_score not in ZERO_SHOT_SCORES:
        raise ConfigError(
            f"calibration.ood_score {c.ood_score!r} needs class statistics; zero-shot "
            f"builds serve one of {ZERO_SHOT_SCORES}"
        )
    if not 0 < c.tpr < 1:
        raise ConfigError(f"calibration.tpr must be in (0, 1), got {c.tpr}")


def _check_data_source(d: DataConfig, strategy: str) -> None:
    """A known setting; a user's data and OOD sets exist, and OOD data is there for a strategy that scores on it."""
    if d.setting not in SETTINGS:
        raise ConfigError(f"data.setting must be one of {SETTINGS}, got {d.setting!r}")
    no_ood = d.setting in ("image-folder", "text-file") and not d.ood_paths and d.ood_val_path is None
    if no_ood and strategy in ("circuit-ood", "circuit-avg"):
        raise ConfigError(
            f"hydra.strategy {strategy} scores heads on OOD validation inputs and the data has none "
            "(data.ood_paths, data.ood_val_path): use taylor or circuit-acc, or give OOD data"
        )
    if d.setting in ("image-folder", "text-file"):
        if not d.path:
            raise ConfigError(f"data.path is required for data.setting={d.setting}")
        if not Path(d.path).exists():
            raise ConfigError(f"data.path {d.path} does not exist")
        for name, p in d.ood_paths.items():
            if not Path(p).exists():
                raise ConfigError(f"data.ood_paths.{name}: {p} does not exist")


def _check_data_sizes(d: DataConfig) -> None:
    """The split sizes and the augmentation."""
    for k in ("max_train", "max_val", "max_test", "max_ood"):
        if int(getattr(d, k)) < 1:
            raise ConfigError(f"data.{k} must be >= 1")
    if d.augment is not None and d.augment not in AUGMENT:
        raise ConfigError(f"data.augment must be one of {AUGMENT} or null, got {d.augment!r}")
    if not 0 < d.crop_scale <= 1:
        raise ConfigError(f"data.crop_scale must be in (0, 1], got {d.crop_scale}")
    if d.max_fit is not None and int(d.max_fit) < 0:
        raise ConfigError("data.max_fit must be >= 0 (0: fit the OOD statistics on the train split) or null")


def validate(cfg: BuildConfig) -> None:
    """Cheap checks that need no model or data loading; raise ConfigError with one clear line.

    The checks run in a fixed order (types, ranges, compute, family, hydra, calibration, guarantees, data), so a
    config with several problems always names the same one first.
    """
    check_types(cfg)
    _check_ranges(cfg)
    _check_compute(cfg.build)
    if cfg.family not in families():
        raise ConfigError(f"family must be one of {families()}, got {cfg.family!r}")
    _check_hydra(cfg.hydra)
    _check_calibration(cfg.calibration, cfg.family)
    _check_guarantees(cfg.guarantees)
    d = cfg.data
    _check_data_source(d, cfg.hydra.strategy)
    row = ADAPTERS[cfg.family].row
    modality = "image" if d.setting in ("fashion-mnist", "image-folder") else "text"
    if modality != row.modality:
        raise ConfigError(f"family {cfg.family} needs {row.modality} data, but data.setting is {d.setting}")
    if cfg.base.path is not None and not Path(cfg.base.path).exists():
        raise ConfigError(f"base.path {cfg.base.path} does not exist")
    bad = [b for b in cfg.base.baselines if b not in BASELINES]
    if bad:
        raise ConfigError(f"base.baselines: unknown baseline {bad[0]!r}; expected some of {BASELINES}")
    if cfg.base.baselines and not row.baselines:
        mine = " and ".join(f for f, a in ADAPTERS.items() if a.row.baselines)
        raise ConfigError(f"base.baselines: the baselines are built for the {mine} families, not {cfg.family}")
    for name in cfg.base.baselines:  # before hours of training, not after them
        missing = [m for m in BASELINE_MODULES[name] if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"base.baselines {name} needs the {missing[0]} package: pip install 'hydra-serve[baselines]'"
            )
    if cfg.base.baselines and resolve_device(cfg.build.device).type != "cpu":
        raise ConfigError("base.baselines: the baselines are trained and evaluated on the CPU; set build.device cpu")
    if cfg.hydra.shared_blocks and not row.shared_trunk:
        mine = " and ".join(f for f, a in ADAPTERS.items() if a.row.shared_trunk)
        raise ConfigError(f"hydra.shared_blocks: a shared trunk is for the {mine} families, not {cfg.family}")
    _check_data_sizes(d)


def check_trunk(cfg: BuildConfig, depth: int) -> None:
    """``hydra.shared_blocks`` lies in ``[0, depth)`` and leaves ``hydra.finetune_blocks`` room (one line; checked
    with the budget, :func:`check_budget`, before anything loads where the head counts are read from config files)."""
    h = cfg.hydra
    k = h.shared_blocks
    if not 0 <= k < depth:
        raise ConfigError(f"hydra.shared_blocks must be in [0, {depth}) for the base model's {depth} blocks, got {k}")
    if k and h.finetune_blocks > depth - k:
        raise ConfigError(
            f"hydra.finetune_blocks={h.finetune_blocks} would train blocks of the shared trunk (hydra.shared_blocks="
            f"{k} of {depth}): give at most {depth - k}, or 0 for every block after the trunk"
        )


def check_budget(cfg: BuildConfig, heads_per_layer: list[int]) -> None:
    """Refuse a budget that prunes more heads than the base model has, or a shared trunk that does not fit it (call
    once the head counts are known). With ``hydra.shared_blocks`` k, only the layers from k on are pruned."""
    h = cfg.hydra
    k = h.shared_blocks
    check_trunk(cfg, len(heads_per_layer))
    prunable = heads_per_layer[k:]
    if h.prune_per_layer is not None:
        bad = [i for i, n in enumerate(prunable, start=k) if h.prune_per_layer > n]
        if bad:
            raise ConfigError(
                f"hydra.prune_per_layer={h.prune_per_layer} exceeds the "
                f"{heads_per_layer[bad[0]]} heads of layer {bad[0]}"
            )
    elif h.prune_total > sum(prunable):
        if k:
            where = f"the {sum(prunable)} heads after the shared trunk (hydra.shared_blocks={k})"
        else:
            where = f"the model's {sum(prunable)} heads"
        raise ConfigError(f"hydra.prune_total={h.prune_total} exceeds {where}")


def _help(comment: str, default: Any) -> str:
    """A flag's help: its field's comment and the default (``%`` escaped: argparse formats help with it)."""
    return f"{comment} (default: {json.dumps(default)})".replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key`` flag per config value, with its comment as help."""
    for sec, cls in _section_classes().items():
        group = parser.add_argument_group(sec)
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            group.add_argument(
                f"--{sec}.{f.name}",
                dest=f"{sec}.{f.name}",
                default=argparse.SUPPRESS,
                metavar="VALUE",
                help=_help(comments.get(f.name, ""), default),
            )
    comments = _field_comments(BuildConfig)
    for f in dataclasses.fields(BuildConfig):
        if f.name in _SECTIONS and dataclasses.is_dataclass(typing.get_type_hints(BuildConfig)[f.name]):
            continue
        parser.add_argument(
            f"--{f.name}",
            dest=f.name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=_help(comments.get(f.name, ""), f.default),
        )


def overrides_from_args(ns: argparse.Namespace, skip: tuple[str, ...] = ("config", "out")) -> dict[str, Any]:
    return {k: _parse_value(v) for k, v in vars(ns).items() if k not in skip}
