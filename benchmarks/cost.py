"""Cost benchmark: parameters, multiply-adds and latency of Single, one member, Hydra fused/unfused, Deep Ensemble.

All methods of one layout are built in one process and timed side by side. Layouts:

* ``vit_b16`` / ``bert_base``: timm ``vit_base_patch16_224`` and BERT-base (seq 128) with random
  weights, built by ``benchmarks/bench_fusion.build`` (8 / 6 of 12 heads kept per member).
* ``image`` / ``text``: the real settings' architectures (the ViT trained here on 28x28
  Fashion-MNIST; MiniLM-L6 with the settings' sequence length), random weights, the
  settings' head budgets (4 of 6 / 6 of 12 heads kept). Latency does not depend on weights.

Multiply-adds are counted by ``torch.utils.flop_counter.FlopCounterMode`` (MACs = FLOPs / 2)
at batch 1 (:func:`count_macs`: it also counts the in-place GEMMs torch's registry misses).
Latency rounds are *interleaved* (``bench_fusion.time_interleaved``): every repeat runs each
method once, in a rotated order, so that load from other processes on a shared machine hits all
methods alike. ``hydra`` is the fused model as served (``bench_fusion.methods``: the last layer
computes only the token the readout reads).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks import bench_fusion
from offline.families import get_adapter
from offline.fusion import fuse

METHODS = ("single", "member", "hydra", "hydra_unfused", "deep_ensemble")
LAYOUTS = ("vit_b16", "bert_base", "image", "text")
KEEP = {"vit_b16": 8, "bert_base": 6, "image": 4, "text": 6}  # heads kept per layer per member
TEXT_SEQ = 64  # sequence length of the text setting's layout (its max_length)

Models = dict[str, Any]  # bench_fusion.build's: base, pruned, fused, dense, make_input, run


def _build_small(layout: str, members: int, keep: int, seed: int = 0) -> Models:
    """``bench_fusion.build``'s dict for the real settings' architectures (random weights)."""
    torch.manual_seed(seed)
    if layout == "image":
        from timm.models.vision_transformer import VisionTransformer

        from offline.train import PRESETS

        arch = {**PRESETS["vit_full"]["arch"], "num_classes": 6}

        def new() -> nn.Module:
            return VisionTransformer(**arch).eval()

        adapter = get_adapter("vit")

        def make_input(b: int) -> dict[str, torch.Tensor]:
            return {"pixel_values": torch.randn(b, 1, 28, 28, generator=torch.Generator().manual_seed(b))}

        def run(m: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
            return m(x["pixel_values"])

    elif layout == "text":
        from transformers import BertConfig, BertForSequenceClassification

        from offline.train import minilm_path

        cfg = BertConfig.from_pretrained(minilm_path(), num_labels=2, attn_implementation="sdpa")

        def new() -> nn.Module:
            return BertForSequenceClassification(cfg).eval()

        adapter = get_adapter("bert")

        def make_input(b: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(b)
            return {"input_ids": torch.randint(0, cfg.vocab_size, (b, TEXT_SEQ), generator=g),
                    "attention_mask": torch.ones(b, TEXT_SEQ, dtype=torch.long)}

        def run(m: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
            return m(**x).logits

    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    base = new()
    heads = adapter.heads(base)
    g = torch.Generator().manual_seed(seed)
    keeps = [[sorted(torch.randperm(h, generator=g)[:keep].tolist()) for h in heads] for _ in range(members)]
    pruned = [adapter.prune(base, k).eval() for k in keeps]
    fused, _ = fuse(adapter, pruned)
    dense = [base]
    for s in range(1, members):
        torch.manual_seed(seed + s)
        dense.append(new())
    return {"base": base, "pruned": pruned, "fused": fused, "dense": dense, "make_input": make_input, "run": run}


def _inplace_addmm_flops(inp_shape, a_shape, b_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # (n, k) @ (k, m)


def _inplace_baddbmm_flops(inp_shape, a_shape, b_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # (b, n, k) @ (b, k, m)


def count_macs(fn: Callable[[], Any]) -> int:
    """Multiply-adds of one call of ``fn`` by ``FlopCounterMode`` (MACs = FLOPs / 2).

    Unlike ``bench_fusion.count_macs`` this also counts the in-place GEMMs ``addmm_`` / ``baddbmm_``
    (the fused model accumulates into its residual stream with them), which torch's registry misses.
    """
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    extra = {aten.addmm_: _inplace_addmm_flops, aten.baddbmm_: _inplace_baddbmm_flops}
    with FlopCounterMode(display=False, custom_mapping=extra) as fc, torch.inference_mode():
        fn()
    return fc.get_total_flops() // 2


def build(layout: str, members: int = 3, keep: int | None = None) -> Models:
    """Random-weight models of ``layout`` in ``bench_fusion.build``'s dict (vit_b16 / bert_base: built by it)."""
    keep = KEEP[layout] if keep is None else keep
    if layout in ("vit_b16", "bert_base"):
        return bench_fusion.build(layout, members, keep)
    return _build_small(layout, members, keep)


def param_counts(models: Models) -> dict[str, int]:
    """Parameters of each method's models."""

    def n(ms: Sequence[nn.Module]) -> int:
        return sum(p.numel() for m in ms for p in m.parameters())

    return {"single": n([models["base"]]), "member": n(models["pruned"][:1]), "hydra": n([models["fused"]]),
            "hydra_unfused": n(models["pruned"]), "deep_ensemble": n(models["dense"])}


def _to(models: Models, device: str) -> None:
    for m in [models["base"], *models["pruned"], models["fused"], *models["dense"]]:
        m.to(device)


def run_layout(
    layout: str,
    batches: Sequence[int] = (1, 4),
    precisions: Sequence[str] = ("fp32", "bf16"),
    devices: Sequence[str] = ("cpu",),
    repeats: int = 5,
    warmup: int = 1,
    members: int = 3,
    keep: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Cost rows of ``layout``: one per (device, precision, batch, method), with params and MACs per input.

    Timing is ``bench_fusion.time_interleaved`` (every repetition runs each method once, order rotated);
    on CUDA each call is wrapped in bf16 autocast (when asked) and a synchronize.
    """
    models = build(layout, members, keep)
    fns = {k: f for k, f in bench_fusion.methods(models).items() if k in METHODS}
    params = param_counts(models)
    x1 = models["make_input"](1)
    n_macs = {k: count_macs(lambda f=f: f(x1)) for k, f in fns.items()}
    rows = []
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            progress(f"{layout}: no CUDA device here, GPU timings skipped")
            continue
        _to(models, device)
        for prec in precisions:
            for b in batches:
                x = {k: v.to(device) for k, v in models["make_input"](b).items()}
                if device == "cuda":
                    def call(f: Callable, x: dict = x, prec: str = prec) -> Any:
                        bf16 = prec == "bf16"
                        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                            out = f(x)
                        torch.cuda.synchronize()
                        return out

                    times = bench_fusion.time_interleaved({k: (lambda f=f, c=call: c(f)) for k, f in fns.items()},
                                                          repeats, warmup, "fp32")
                else:
                    times = bench_fusion.time_interleaved({k: (lambda f=f, x=x: f(x)) for k, f in fns.items()},
                                                          repeats, warmup, prec)
                # time_interleaved gives {name: {"wall": [ms, ...], "cpu": [ms, ...]}}: latency is wall clock
                res = {k: (min(v["wall"]), statistics.median(v["wall"])) for k, v in times.items()}
                for k in fns:
                    mn, med = res[k]
                    rows.append({"layout": layout, "method": k, "batch": b, "device": device, "precision": prec,
                                 "latency_ms_min": round(mn, 3), "latency_ms_median": round(med, 3),
                                 "params": params[k], "macs": int(n_macs[k]), "members": members,
                                 "keep": KEEP[layout] if keep is None else keep, "repeats": repeats,
                                 "threads": torch.get_num_threads(), "device_name": device_name(device)})
                progress(f"{layout} {device} {prec} b{b}: " + ", ".join(
                    f"{k} {res[k][0]:.1f}/{res[k][1]:.1f}" for k in fns) + " ms (min/median)")
    _to(models, "cpu")
    return rows


def rows_from_fusion(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Cost rows from a ``bench_fusion`` result (``results/fusion_<layout>.json``), same schema as :func:`run_layout`.

    ``bench_fusion`` measures the big layouts with the same interleaved timing and the same models, so its
    cells are imported instead of timed twice (``benchmarks/run.py --import-fusion``). Its extra method
    ``hydra_all_tokens`` is not a cost-table method and is left out.
    """
    meta = doc["meta"]
    rows = []
    for r in doc["rows"]:
        if r["method"] not in METHODS:
            continue
        rows.append({"layout": r["layout"], "method": r["method"], "batch": r["batch"], "device": r["device"],
                     "precision": r["precision"], "latency_ms_min": round(r["wall_ms_min"], 3),
                     "latency_ms_median": round(r["wall_ms_median"], 3), "params": r["params"], "macs": r["macs"],
                     "members": meta["members"], "keep": meta["keep"], "repeats": r["repeats"],
                     "threads": r["threads"], "device_name": f"{meta['cpu']}, {r['threads']} torch threads",
                     "load": [round(r["load_before"], 2), round(r["load_after"], 2)], "command": r["command"]})
    return rows


def ratios(rows: Sequence[dict[str, Any]], to: str = "single") -> list[dict[str, Any]]:
    """Per (layout, device, precision, batch, method): latency min and median divided by those of ``to``."""
    ref = {(r["layout"], r["device"], r["precision"], r["batch"]): r for r in rows if r["method"] == to}
    out = []
    for r in rows:
        k = (r["layout"], r["device"], r["precision"], r["batch"])
        if k not in ref:
            continue
        out.append({**{f: r[f] for f in ("layout", "device", "precision", "batch", "method")},
                    "ratio_min": r["latency_ms_min"] / ref[k]["latency_ms_min"],
                    "ratio_median": r["latency_ms_median"] / ref[k]["latency_ms_median"],
                    "macs_ratio": r["macs"] / ref[k]["macs"], "params_ratio": r["params"] / ref[k]["params"]})
    return out


def device_name(device: str) -> str:
    """Human name of ``device`` (CPU model and thread count, or the CUDA device name)."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{bench_fusion.cpu_name()}, {torch.get_num_threads()} torch threads"
