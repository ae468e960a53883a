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
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import bench_fusion
from offline.families import get_adapter
from offline.method.fusion import fuse

METHODS = ("single", "member", "hydra", "hydra_unfused", "deep_ensemble")
BACKENDS = ("eager", "onnx", "aoti")  # the serving backends: torch eager, ONNX Runtime, an AOTInductor package
COMPILED_METHODS = ("single", "hydra", "deep_ensemble")  # what the compiled backends time (fp32, CPU)
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
            return {
                "input_ids": torch.randint(0, cfg.vocab_size, (b, TEXT_SEQ), generator=g),
                "attention_mask": torch.ones(b, TEXT_SEQ, dtype=torch.long),
            }

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

    return {
        "single": n([models["base"]]),
        "member": n(models["pruned"][:1]),
        "hydra": n([models["fused"]]),
        "hydra_unfused": n(models["pruned"]),
        "deep_ensemble": n(models["dense"]),
    }


def _to(models: Models, device: str) -> None:
    for m in [models["base"], *models["pruned"], models["fused"], *models["dense"]]:
        m.to(device)


class _ImageLogits(nn.Module):
    """A dense image model as the exporters take it: named positional inputs, the logits out (as the fused
    model's forward)."""

    def __init__(self, model: nn.Module, run: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.run = model, run

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.run(self.model, {"pixel_values": pixel_values})


class _TextLogits(_ImageLogits):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.run(self.model, {"input_ids": input_ids, "attention_mask": attention_mask})


def compiled_methods(
    models: Models, backend: str, folder: Path, progress: Callable[[str], None] = print
) -> dict[str, Callable[[dict[str, torch.Tensor]], Any]]:
    """Single, fused Hydra and the Deep Ensemble in a compiled serving ``backend`` (``onnx``: ONNX Runtime with the
    server's session options; ``aoti``: an AOTInductor package), fp32 on the CPU, loaded by the server's own
    backend classes. The Deep Ensemble is M loaded instances of the dense model's export, run one after another:
    M separate copies of the weights in memory, the cost of M different models of the layout."""
    from offline.models.export import export_aoti, export_onnx
    from service.core.backends import AotiBackend, OnnxBackend

    x = models["make_input"](2)
    names = list(x)
    wrap = _ImageLogits if "pixel_values" in x else _TextLogits
    exported = {"single": wrap(models["base"], models["run"]).eval(), "hydra": models["fused"]}
    runners: dict[str, list[Any]] = {}
    for key, model in exported.items():
        t0 = time.perf_counter()
        path = folder / f"{backend}-{key}.{'onnx' if backend == 'onnx' else 'pt2'}"
        if backend == "onnx":
            export_onnx(model, x, path, ["logits"])
        else:
            export_aoti(model, x, path, max_seq=512)
        n = len(models["dense"]) if key == "single" else 1
        runners[key] = [
            OnnxBackend(path, names, "cpu") if backend == "onnx" else AotiBackend(path, names) for _ in range(n)
        ]
        progress(f"{backend} {key}: exported and loaded in {time.perf_counter() - t0:.0f} s")
    return {
        "single": lambda b: runners["single"][0](b),
        "hydra": lambda b: runners["hydra"][0](b),
        "deep_ensemble": lambda b: [r(b) for r in runners["single"]],
    }


def peak_gflops(precision: str, n: int = 2048, repeats: int = 5) -> float:
    """The machine's matmul throughput with this process's threads: the best of ``repeats`` ``n x n`` GEMMs, in
    GFLOPS; every cost result carries it as its own reference. bf16: torch (oneDNN). fp32: the better of torch
    and ONNX Runtime (MLAS): on an AMD EPYC torch's fp32 GEMM reached 240 GFLOPS and ORT's about twice that,
    so torch alone would understate what the machine does."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = _best_of(lambda: torch.mm(a, b), repeats)
    if precision == "fp32":
        with contextlib.suppress(ImportError):
            best = min(best, _ort_matmul_seconds(n, repeats))
    return 2 * n**3 / best / 1e9


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _ort_matmul_seconds(n: int, repeats: int) -> float:
    """Seconds of one ``n x n`` fp32 MatMul in ONNX Runtime with the server's session options."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from service.core.backends import onnx_session

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "mm",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, [n, n]) for k in "ab"],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(model, f"{tmp}/mm.onnx")
        sess = onnx_session(f"{tmp}/mm.onnx")
    feed = {k: np.random.default_rng(0).standard_normal((n, n), dtype=np.float32) for k in "ab"}
    return _best_of(lambda: sess.run(None, feed), repeats)


@dataclass(frozen=True)
class Grid:
    """The cells of one layout's cost run: every device, precision and batch, timed in each backend."""

    batches: Sequence[int] = (1, 4)  # inputs per call
    precisions: Sequence[str] = ("fp32", "bf16")  # fp32, or bf16 autocast
    devices: Sequence[str] = ("cpu",)  # cpu, cuda (skipped where there is none)
    repeats: int = 5  # timed interleaved rounds per cell
    warmup: int = 1  # untimed rounds first
    backends: Sequence[str] = ("eager",)  # BACKENDS: the compiled ones time COMPILED_METHODS on CPU in fp32


@dataclass
class _Layout:
    """One layout's models and the methods timed on them, with their sizes."""

    name: str
    models: Models
    fns: dict[str, Callable]  # eager methods
    compiled: dict[str, dict[str, Callable]]  # backend -> method -> callable (CPU, fp32)
    params: dict[str, int]
    macs: dict[str, int]  # multiply-adds per input
    members: int
    keep: int | None


def run_layout(
    layout: str,
    grid: Grid = Grid(),
    members: int = 3,
    keep: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Cost rows of ``layout``: one per (device, backend, precision, batch, method) of ``grid``, with params and
    MACs per input, the GFLOPS achieved and the share of the machine's matmul peak (:func:`peak_gflops`, measured
    here).

    Timing is ``bench_fusion.time_interleaved`` (every repetition runs each method once, order rotated); the
    compiled backends' methods (:func:`compiled_methods`, CPU fp32) join the eager fp32 cells, interleaved with
    them. On CUDA each call is wrapped in bf16 autocast (when asked) and a synchronize.
    """
    models = build(layout, members, keep)
    fns = {k: f for k, f in bench_fusion.methods(models).items() if k in METHODS}
    params = param_counts(models)
    x1 = models["make_input"](1)
    n_macs = {k: count_macs(lambda f=f: f(x1)) for k, f in fns.items()}
    peaks = {p: peak_gflops(p) for p in ("fp32", "bf16")}
    progress(f"{layout}: matmul peak {peaks['fp32']:.0f} GFLOPS fp32, {peaks['bf16']:.0f} bf16")
    with tempfile.TemporaryDirectory() as tmp:
        compiled = {be: compiled_methods(models, be, Path(tmp), progress) for be in grid.backends if be != "eager"}
        lay = _Layout(layout, models, fns, compiled, params, n_macs, members, keep)
        rows = _time_layout(lay, grid, progress)
    for r in rows:
        r["gflops"] = round(2 * r["macs"] * r["batch"] / (r["latency_ms_min"] / 1e3) / 1e9, 1)
        if r["device"] == "cpu":
            r["peak_gflops"] = round(peaks[r["precision"]], 1)
            r["peak_fraction"] = round(r["gflops"] / peaks[r["precision"]], 3)
    return rows


def _time_layout(lay: _Layout, grid: Grid, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """The rows of every cell of ``grid`` on ``lay``'s models (moved to each device in turn, then back to CPU)."""
    rows = []
    for device in grid.devices:
        if device == "cuda" and not torch.cuda.is_available():
            progress(f"{lay.name}: no CUDA device here, GPU timings skipped")
            continue
        _to(lay.models, device)
        for prec in grid.precisions:
            for b in grid.batches:
                res = _time_cell(lay, grid, device, prec, b)
                rows += _cell_rows(lay, grid, res, (device, prec, b))
                progress(
                    f"{lay.name} {device} {prec} b{b}: "
                    + ", ".join(
                        f"{'/'.join(k) if isinstance(k, tuple) else k} {v[0]:.1f}/{v[1]:.1f}" for k, v in res.items()
                    )
                    + " ms (min/median)"
                )
    _to(lay.models, "cpu")
    return rows


def _time_cell(lay: _Layout, grid: Grid, device: str, prec: str, b: int) -> dict[Any, tuple[float, float]]:
    """Min and median wall-clock ms per method of one cell; keys are method names, or ``(backend, method)`` for
    the compiled backends' methods (CPU fp32)."""
    x = {k: v.to(device) for k, v in lay.models["make_input"](b).items()}
    if device == "cuda":

        def call(f: Callable, x: dict = x, prec: str = prec) -> Any:
            bf16 = prec == "bf16"
            with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                out = f(x)
            torch.cuda.synchronize()
            return out

        times = bench_fusion.time_interleaved(
            {k: (lambda f=f, c=call: c(f)) for k, f in lay.fns.items()}, grid.repeats, grid.warmup, "fp32"
        )
    else:
        timed = {("eager", k): f for k, f in lay.fns.items()}
        if prec == "fp32":  # the compiled backends run fp32: timed beside eager fp32, interleaved
            timed.update({(be, k): f for be, fs in lay.compiled.items() for k, f in fs.items()})
        times = bench_fusion.time_interleaved(
            {k: (lambda f=f, x=x: f(x)) for k, f in timed.items()}, grid.repeats, grid.warmup, prec
        )
    # time_interleaved gives {name: {"wall": [ms, ...], "cpu": [ms, ...]}}: latency is wall clock
    return {k: (min(v["wall"]), statistics.median(v["wall"])) for k, v in times.items()}


def _cell_rows(
    lay: _Layout, grid: Grid, res: dict[Any, tuple[float, float]], cell: tuple[str, str, int]
) -> list[dict[str, Any]]:
    """One row per method of a timed cell ``(device, precision, batch)``."""
    device, prec, b = cell
    rows = []
    for key in res:
        backend, k = key if isinstance(key, tuple) else ("eager", key)
        mn, med = res[key]
        rows.append(
            {
                "layout": lay.name,
                "method": k,
                "batch": b,
                "device": device,
                "backend": backend,
                "precision": prec,
                "latency_ms_min": round(mn, 3),
                "latency_ms_median": round(med, 3),
                "params": lay.params[k],
                "macs": int(lay.macs[k]),
                "members": lay.members,
                "keep": KEEP[lay.name] if lay.keep is None else lay.keep,
                "repeats": grid.repeats,
                "threads": torch.get_num_threads(),
                "device_name": device_name(device),
            }
        )
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
        rows.append(
            {
                "layout": r["layout"],
                "method": r["method"],
                "batch": r["batch"],
                "device": r["device"],
                "precision": r["precision"],
                "latency_ms_min": round(r["wall_ms_min"], 3),
                "latency_ms_median": round(r["wall_ms_median"], 3),
                "params": r["params"],
                "macs": r["macs"],
                "members": meta["members"],
                "keep": meta["keep"],
                "repeats": r["repeats"],
                "threads": r["threads"],
                "device_name": f"{meta['cpu']}, {r['threads']} torch threads",
                "load": [round(r["load_before"], 2), round(r["load_after"], 2)],
                "command": r["command"],
            }
        )
    return rows


def ratios(rows: Sequence[dict[str, Any]], to: str = "single") -> list[dict[str, Any]]:
    """Per (layout, device, backend, precision, batch, method): latency min and median divided by those of ``to``
    in the same backend (rows without a backend are torch eager's)."""
    ref = {
        (r["layout"], r["device"], r.get("backend", "eager"), r["precision"], r["batch"]): r
        for r in rows
        if r["method"] == to
    }
    out = []
    for r in rows:
        k = (r["layout"], r["device"], r.get("backend", "eager"), r["precision"], r["batch"])
        if k not in ref:
            continue
        out.append(
            {
                **{f: r[f] for f in ("layout", "device", "precision", "batch", "method")},
                "backend": k[2],
                "ratio_min": r["latency_ms_min"] / ref[k]["latency_ms_min"],
                "ratio_median": r["latency_ms_median"] / ref[k]["latency_ms_median"],
                "macs_ratio": r["macs"] / ref[k]["macs"],
                "params_ratio": r["params"] / ref[k]["params"],
            }
        )
    return out


def device_name(device: str) -> str:
    """Human name of ``device`` (CPU model and thread count, or the CUDA device name)."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{bench_fusion.cpu_name()}, {torch.get_num_threads()} torch threads"
