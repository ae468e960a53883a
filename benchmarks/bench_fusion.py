"""Cost of the fused Hydra model vs one dense model, one member, the members one by one and a deep ensemble.

Everything is measured in one process on random weights of a real layout (timm
``vit_base_patch16_224`` at 224 px, or BERT-base at sequence length 128), M
members each keeping ``--keep`` of the 12 heads per layer. Prints parameters,
multiply-adds per input and min / median latency per method, in fp32 and under
CPU bf16 autocast, with ratios to the deep ensemble (three dense models run one
after another).

The methods are timed interleaved: each repetition runs every method once (in a
rotated order), so that load from other processes on a shared machine hits all
of them alike; ``paired`` ratios are the median over repetitions of
``hydra / deep_ensemble`` within the same repetition.

Methods:
    single            one dense model
    member            one pruned member
    hydra             the fused model (service.core.fused), as served: the last layer computes only the
                      first token, the only one the readout reads
    hydra_all_tokens  the fused model computing every token in every layer (the exact same
                      arithmetic as the members: the floor is its multiply-add ratio)
    hydra_unfused     the M pruned members run one after another
    deep_ensemble     M dense models run one after another
    hydra_ood         hydra returning its members' features too, plus every OOD score the server computes
                      (service.core.ood.ensemble_scores, Mahalanobis on statistics of the layout's shape): the
                      served flag's cost, reported as hydra_ood / hydra
    hydra_ood_layers  hydra_ood plus the pooled features of the first blocks (with_layer_features) and the
                      mahalanobis_layers score over three of them (the largest candidate of
                      offline.method.ood_fit.layer_candidates): the cost of the layer score,
                      reported as hydra_ood_layers / hydra
    single_bf16_weights, hydra_bf16_weights
                      copies of single / hydra with their matrix weights stored in bf16, as the server keeps them
                      in bf16 (service.core.backends.cast_gemm_weights; same outputs under bf16 autocast)

    python -m benchmarks.bench_fusion --layout vit_b16 --batches 1 4 16 32 --precisions fp32 bf16
    python -m benchmarks.bench_fusion --layout bert_base --batches 1 8 --precisions fp32 bf16

Results go to ``benchmarks/results/fusion_<layout>.txt`` (the printed tables, with
the command line) and ``.json`` (one row per method, batch and precision).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# as the server runs (service/entrypoints/app.py): large activations on transparent huge pages; set before torch
# allocates
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from torch import nn

from benchmarks import result_json
from benchmarks.harness import cpu_name  # noqa: F401 (the CPU named in every result; recipe.py and others import it here)
from offline.families import get_adapter
from offline.method.fusion import fuse
from offline.method.ood_fit import MAX_SCORE_LAYERS
from service.core.backends import cast_gemm_weights
from service.core.fused import CPU_MAX_ROWS
from service.core.hardware import cpu_bf16_flags
from service.core.ood import GaussianStats, LayerStats, OODStats, ensemble_scores

METHODS = (
    "single",
    "member",
    "hydra",
    "hydra_all_tokens",
    "hydra_unfused",
    "deep_ensemble",
    "hydra_ood",
    "hydra_ood_layers",
    "single_bf16_weights",
    "hydra_bf16_weights",
)
DEFAULT_METHODS = METHODS[:-4]  # the others are asked for with --methods
# copies of single / hydra with bf16 matrix weights: timed in bf16 only, the same products as their fp32 models
BF16_WEIGHTS = ("single_bf16_weights", "hydra_bf16_weights")
LAYOUTS = {  # heads kept per member by default, batch sizes by default
    "vit_b16": {"keep": 8, "batches": [1, 4, 16, 32]},
    "bert_base": {"keep": 6, "batches": [1, 8]},
}
SEQ_LEN = 128  # bert_base


def _dense(layout: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if layout == "vit_b16":
        import timm

        return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000).eval()
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(num_labels=2, attn_implementation="sdpa")).eval()


def build(layout: str, members: int, keep: int, seed: int = 0) -> dict[str, Any]:
    """Random-weight models of ``layout``: the base, ``members`` pruned copies, their fusion, ``members`` dense models.

    Returns ``{"base", "pruned", "fused", "dense", "make_input" (batch -> inputs), "run" (model, inputs -> logits)}``.
    """
    if layout not in LAYOUTS:
        raise SystemExit(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    base = _dense(layout, seed)
    if layout == "vit_b16":
        adapter = get_adapter("vit")

        def make_input(b: int) -> dict[str, torch.Tensor]:
            return {"pixel_values": torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(b))}

        def run(m: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
            return m(x["pixel_values"])

    else:
        adapter = get_adapter("bert")

        def make_input(b: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(b)
            ids = torch.randint(0, 30522, (b, SEQ_LEN), generator=g)
            return {"input_ids": ids, "attention_mask": torch.ones(b, SEQ_LEN, dtype=torch.long)}

        def run(m: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
            return m(**x).logits

    heads = adapter.heads(base)
    if not all(keep <= h for h in heads):
        raise SystemExit(f"--keep {keep} is more than the {min(heads)} heads of a layer")
    g = torch.Generator().manual_seed(seed)
    keeps = [[sorted(torch.randperm(h, generator=g)[:keep].tolist()) for h in heads] for _ in range(members)]
    pruned = [adapter.prune(base, k).eval() for k in keeps]
    fused, _ = fuse(adapter, pruned)
    # a deep ensemble: M dense models of the same layout (weights differ; cost is what matters)
    dense = [base] + [_dense(layout, seed + s) for s in range(1, members)]
    # the layer score's largest candidate (offline.method.ood_fit.layer_candidates): at most MAX_SCORE_LAYERS blocks
    classes, layers = fused.cfg["num_classes"], min(len(heads) - 1, MAX_SCORE_LAYERS)
    return {
        "base": base,
        "pruned": pruned,
        "fused": fused,
        "dense": dense,
        "make_input": make_input,
        "run": run,
        "ood_stats": random_ood_stats(members, classes, fused.dim, seed),
        "ood_layer_stats": random_ood_stats(members, classes, fused.dim, seed, layers),
    }


def random_ood_stats(members: int, classes: int, dim: int, seed: int, layers: int = 0) -> OODStats:
    """OOD statistics of the served scores' shapes (values are random: only their cost is measured); with
    ``layers`` > 0 also ``mahalanobis_layers``' statistics over the first ``layers`` blocks' pooled outputs."""
    g = torch.Generator().manual_seed(seed)

    def gaussians(n: int) -> GaussianStats:
        eye = torch.eye(dim, dtype=torch.float64).expand(n, dim, dim).clone()
        return GaussianStats(
            torch.randn(n, classes, dim, generator=g, dtype=torch.float64),
            eye,
            torch.zeros(n, dim, dtype=torch.float64),
            eye,
        )

    def norm(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)

    norms = {k: norm(members) for k in ("energy", "max_logit", "mahalanobis", "relative_mahalanobis")}
    layer_stats = (
        LayerStats(tuple(range(layers)), gaussians(members * layers), norm(members * layers), norm(layers + 1))
        if layers
        else None
    )
    return OODStats(gaussians(members), {**norms, "mutual_information": norm(1)}, layer_stats)


def methods(models: dict[str, Any]) -> dict[str, Callable[[dict[str, torch.Tensor]], Any]]:
    """The timed callables, by method name (see the module docstring)."""
    base, pruned, fused, dense, run = (models[k] for k in ("base", "pruned", "fused", "dense", "run"))

    def hydra(x: dict[str, torch.Tensor], first_token: bool = True) -> torch.Tensor:
        fused.first_token_readout = first_token
        try:
            return fused(**x)
        finally:
            fused.first_token_readout = True

    def hydra_ood(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fused.with_features = True
        try:
            logits, features = fused(**x)
        finally:
            fused.with_features = False
        return ensemble_scores(logits, features, models["ood_stats"])

    def hydra_ood_layers(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fused.with_features = fused.with_layer_features = True
        try:
            logits, features, layer_features = fused(**x)
        finally:
            fused.with_features = fused.with_layer_features = False
        return ensemble_scores(logits, features, models["ood_layer_stats"], layer_features=layer_features)

    low = {}  # the bf16-weight copies, made when first asked for (they double the memory of two models)

    def bf16_weights(key: str, x: dict[str, torch.Tensor]) -> Any:
        if key not in low:
            with torch.inference_mode(False):  # ordinary tensors, as the server loads them (not inference tensors)
                low[key] = cast_gemm_weights(copy.deepcopy(base if key == "single" else fused))
        return run(low[key], x) if key == "single" else low[key](**x)

    return {
        "hydra_ood": hydra_ood,
        "hydra_ood_layers": hydra_ood_layers,
        "single_bf16_weights": lambda x: bf16_weights("single", x),
        "hydra_bf16_weights": lambda x: bf16_weights("hydra", x),
        "single": lambda x: run(base, x),
        "member": lambda x: run(pruned[0], x),
        "hydra": hydra,
        "hydra_all_tokens": lambda x: hydra(x, first_token=False),
        "hydra_unfused": lambda x: [run(m, x) for m in pruned],
        "deep_ensemble": lambda x: [run(m, x) for m in dense],
    }


def count_macs(fn: Callable[[], Any]) -> int:
    """Multiply-adds of one call of ``fn`` (matmuls, convolutions and attention, as torch's FLOP counter sees them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_(self_shape, a_shape, b_shape, *args, **kwargs) -> int:  # GEMMs accumulating in place
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    def baddbmm_(self_shape, a_shape, b_shape, *args, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]

    inplace = {torch.ops.aten.addmm_: addmm_, torch.ops.aten.baddbmm_: baddbmm_}
    counter = FlopCounterMode(display=False, custom_mapping=inplace)
    # the math attention backend is made of matmuls that the counter sees (the fused CPU kernels are not counted)
    with counter as fc, torch.inference_mode(), sdpa_kernel([SDPBackend.MATH]):
        fn()
    return fc.get_total_flops() // 2


def _precision(prec: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if prec == "bf16" else contextlib.nullcontext()


def time_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int, prec: str
) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per call of each of ``fns``, wall clock and process CPU time.

    Every repetition calls each function once, in an order rotated per repetition.
    Returns ``{name: {"wall": [ms, ...], "cpu": [ms, ...]}}``.
    """
    names = list(fns)
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in names}
    with torch.inference_mode(), _precision(prec):
        for _ in range(warmup):
            for f in fns.values():
                f()
        for r in range(repeats):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                t0, c0 = time.perf_counter(), time.process_time()
                fns[k]()
                times[k]["cpu"].append((time.process_time() - c0) * 1e3)
                times[k]["wall"].append((time.perf_counter() - t0) * 1e3)
    return times


def _ratios(t: list[float], dense: list[float]) -> tuple[float, float]:
    """(min / min of the deep ensemble, median over repetitions of the paired ratio)."""
    return min(t) / min(dense), statistics.median(a / d for a, d in zip(t, dense, strict=True))


def render(meta: dict[str, Any], macs: dict[str, dict[str, float]], rows: list[dict[str, Any]]) -> list[str]:
    """The text report of a results file: model sizes, then one latency line per precision and batch."""
    names = [m for m in METHODS if m in macs]
    lines = _size_lines(meta, macs, names)
    cells = {(r["precision"], r["batch"], r["method"]): r for r in rows}
    keys = sorted({(r["precision"], r["batch"]) for r in rows}, key=lambda k: (k[0] != "fp32", k[1]))
    head = " ".join(f"{k:>21}" for k in names)
    ratio_head = f"{'ratio':<16} {'wall min, paired':>17} {'cpu min, paired':>16}  load"
    lines.append(f"{'prec':<5} {'batch':>5} {'reps':>4} {head}   {ratio_head}")
    for prec, b in keys:
        lines += _latency_lines(cells, names, prec, b)
    return lines


def _size_lines(meta: dict[str, Any], macs: dict[str, dict[str, float]], names: list[str]) -> list[str]:
    """The command lines and setup, then parameters and multiply-adds per input of every method."""
    unit = "image 224 px" if meta["layout"] == "vit_b16" else f"sequence of {SEQ_LEN} tokens"
    lines = [f"$ {c}" for c in meta["commands"]] + ([f"# note: {meta['note']}"] if meta.get("note") else [])
    lines.append(
        f"# {meta['layout']}, M={meta['members']}, {meta['keep']}/12 heads kept per member, torch {meta['torch']}, "
        f"{meta['threads']} threads, {meta['cpu']}"
        + (f" (native bf16: {meta['cpu_bf16']})" if "cpu_bf16" in meta else "")
        + (f"; fused CPU sub-batches of {meta['cpu_max_rows']} member rows" if meta.get("cpu_max_rows") else "")
    )
    lines.append(f"{'method':<17} {'params (M)':>10} {'GMAC/input':>11} {'vs 3 dense':>10}   (per {unit})")
    for k in names:
        ratio = macs[k]["macs"] / macs["deep_ensemble"]["macs"]
        lines.append(f"{k:<17} {macs[k]['params'] / 1e6:>10.1f} {macs[k]['macs'] / 1e9:>11.2f} {ratio:>10.3f}")
    return lines + [
        "",
        "Latency, ms, wall clock: min / median of the interleaved repetitions. Ratios to the deep ensemble:",
        "min/min and the median of per-repetition ratios (wall clock, then process CPU time of the 2 threads).",
        "load = 1-minute load average of the machine before / after the cell (2 cores; other jobs were running).",
    ]


def _ratio_text(name: str, r: dict[str, Any], ref: dict[str, Any]) -> str:
    """``name``, then the wall-clock and CPU-time ratios of cell ``r`` to cell ``ref``: min/min, paired median."""
    wall = _ratios(r["wall_ms"], ref["wall_ms"])
    cpu = _ratios(r["cpu_ms"], ref["cpu_ms"])
    return f"{name:<16} {wall[0]:>8.3f}, {wall[1]:.3f} {cpu[0]:>8.3f}, {cpu[1]:.3f}"


def _latency_lines(cells: dict[tuple, dict[str, Any]], names: list[str], prec: str, b: int) -> list[str]:
    """One precision and batch: the latency of every method, then the ratios to the deep ensemble (Hydra's
    variants), to the same model with fp32 weights (bf16 weights) and to Hydra (the OOD scores' cost)."""
    row = [cells.get((prec, b, k)) for k in names]
    have = [r for r in row if r is not None]
    lat = " ".join(f"{r['wall_ms_min']:>10.1f} / {r['wall_ms_median']:>8.1f}" if r else f"{'-':>21}" for r in row)
    indent = " " * (17 + len(lat))
    dense = cells[(prec, b, "deep_ensemble")]
    lines: list[str] = []
    for k in ("hydra", "hydra_all_tokens", "hydra_unfused"):
        r = cells.get((prec, b, k))
        if r is None:
            continue
        if not lines:  # the first line carries the cell's latencies and the machine's load
            load = f"{have[0]['load_before']:.1f} / {have[0]['load_after']:.1f}"
            prefix = f"{prec:<5} {b:>5} {have[0]['repeats']:>4} {lat}"
            lines.append(f"{prefix}   {_ratio_text(k, r, dense)}  {load}")
        else:
            lines.append(f"{indent}   {_ratio_text(k, r, dense)}")
    for k, ref in (("hydra_bf16_weights", "hydra"), ("single_bf16_weights", "single")):
        r = cells.get((prec, b, k))
        if r is not None and (prec, b, ref) in cells:  # relative to the same model with fp32 weights
            lines.append(f"{indent}   {_ratio_text(k[:6] + '/bf16w', r, cells[(prec, b, ref)])}")
    for ood_name in ("hydra_ood", "hydra_ood_layers"):  # the served scores' cost: relative to hydra
        ood = cells.get((prec, b, ood_name))
        if ood is not None:
            lines.append(f"{indent}   {_ratio_text(ood_name + '/hydra', ood, cells[(prec, b, 'hydra')])}")
    return lines


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="vit_b16", choices=sorted(LAYOUTS))
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--keep", type=int, default=0, help="heads kept per layer per member (0: layout default)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 4 16 32 (vit_b16), 1 8 (bert)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions per cell (each runs every method once)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-save", action="store_true", help="print only; do not write fusion_<layout>.txt/.json")
    ap.add_argument(
        "--cpu-max-rows",
        type=int,
        default=CPU_MAX_ROWS,
        help="the fused model's CPU sub-batch size in member rows (0: one pass; see service/core/fused.py)",
    )
    ap.add_argument(
        "--fresh", action="store_true", help="start the results file anew instead of merging these cells into it"
    )
    return ap


def main() -> None:
    args = _parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep = args.keep or LAYOUTS[args.layout]["keep"]
    batches = args.batches or LAYOUTS[args.layout]["batches"]
    names = [m for m in METHODS if m in {*args.methods, "hydra", "deep_ensemble"}]
    command = f"python {shlex.join(['benchmarks/bench_fusion.py', *sys.argv[1:]])}"
    meta = {
        "layout": args.layout,
        "members": args.members,
        "keep": keep,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_bf16": cpu_bf16(),
        "commands": [command],
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "cpu_max_rows": args.cpu_max_rows,
    }

    path = Path(args.out_dir) / f"fusion_{args.layout}.json"
    if path.exists() and not (args.fresh or args.no_save):  # fail before minutes of timing, not after
        check_mergeable(json.loads(path.read_text())["meta"], meta, path)

    models = build(args.layout, args.members, keep)
    models["fused"].cpu_max_rows = args.cpu_max_rows
    fns = {k: f for k, f in methods(models).items() if k in names}
    macs = _sizes(models, fns)
    n_head = len(render(meta, macs, []))
    print("\n".join(render(meta, macs, [])), flush=True)

    rows: list[dict[str, Any]] = []
    for prec in args.precisions:
        for b in batches:
            timed = {k: fns[k] for k in names if prec == "bf16" or k not in BF16_WEIGHTS}
            cell = _time_cell(timed, models["make_input"](b), prec, b, args, macs, command)
            rows += cell
            print("\n".join(render(meta, macs, cell)[n_head:]), flush=True)
    if not args.no_save:
        _save(path, meta, macs, rows, command, args.fresh)


def _sizes(models: dict[str, Any], fns: dict[str, Callable]) -> dict[str, dict[str, int]]:
    """Parameters and multiply-adds per input of every method in ``fns``."""
    n_params = {
        "single": sum(p.numel() for p in models["base"].parameters()),
        "member": sum(p.numel() for p in models["pruned"][0].parameters()),
        "hydra": sum(p.numel() for p in models["fused"].parameters()),
        "hydra_unfused": sum(sum(p.numel() for p in m.parameters()) for m in models["pruned"]),
        "deep_ensemble": sum(sum(p.numel() for p in m.parameters()) for m in models["dense"]),
    }
    for k in ("hydra_all_tokens", "hydra_ood", "hydra_ood_layers", "hydra_bf16_weights"):
        n_params[k] = n_params["hydra"]
    n_params["single_bf16_weights"] = n_params["single"]
    x1 = models["make_input"](1)
    low = BF16_WEIGHTS  # the same products as their fp32 models
    macs = {k: {"params": n_params[k], "macs": count_macs(lambda f=f: f(x1))} for k, f in fns.items() if k not in low}
    macs.update({k: dict(macs.get(k.split("_")[0], {"params": n_params[k], "macs": 0})) for k in low if k in fns})
    return macs


def _time_cell(
    fns: dict[str, Callable],
    x: Any,
    prec: str,
    b: int,
    args: argparse.Namespace,
    macs: dict[str, dict[str, int]],
    command: str,
) -> list[dict[str, Any]]:
    """One row per method of ``fns``, timed interleaved on the batch ``x`` (of ``b`` inputs) at ``prec``."""
    load_before = os.getloadavg()[0]
    times = time_interleaved({k: (lambda f=f, x=x: f(x)) for k, f in fns.items()}, args.repeats, args.warmup, prec)
    load_after = os.getloadavg()[0]
    cell = []
    for k in fns:
        wall, cpu = times[k]["wall"], times[k]["cpu"]
        cell.append(
            {
                "layout": args.layout,
                "method": k,
                "batch": b,
                "device": "cpu",
                "precision": prec,
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "wall_ms_min": min(wall),
                "wall_ms_median": statistics.median(wall),
                "wall_ms": wall,
                "cpu_ms": cpu,
                "load_before": load_before,
                "load_after": load_after,
                "command": command,
                **macs[k],
            }
        )
    return cell


def _save(
    path: Path, meta: dict[str, Any], macs: dict[str, Any], rows: list[dict[str, Any]], command: str, fresh: bool
) -> None:
    """Write ``fusion_<layout>.json`` and ``.txt``; unless ``fresh``, these cells replace the same cells of an
    earlier run of the file, whose other cells are kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not fresh:  # merge: these cells replace the same cells of an earlier run
        old = json.loads(path.read_text())
        check_mergeable(old["meta"], meta, path)
        if set(old["macs"]) >= set(macs):
            new_keys = {(r["precision"], r["batch"]) for r in rows}
            rows = [r for r in old["rows"] if (r["precision"], r["batch"]) not in new_keys] + rows
            meta["commands"] = [c for c in old["meta"]["commands"] if c != command] + [command]
            macs = {**old["macs"], **macs}
    rows.sort(key=lambda r: (r["precision"] != "fp32", r["batch"], METHODS.index(r["method"])))
    result_json.write(path, {"meta": meta, "macs": macs, "rows": rows})
    (path.parent / f"fusion_{meta['layout']}.txt").write_text("\n".join(render(meta, macs, rows)) + "\n")


MERGE_KEYS = ("layout", "members", "keep", "threads", "thp", "cpu", "cpu_bf16", "cpu_max_rows")


def check_mergeable(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Exit unless ``new`` cells may join the file ``path`` whose meta is ``old``: same layout, CPU and setup.

    Latencies from another CPU (one with native bf16 and one without differ 3x in bf16) are not comparable.
    """
    diff = {k: (old.get(k), new[k]) for k in MERGE_KEYS if old.get(k) != new[k]}
    if diff:
        raise SystemExit(
            f"{path} was measured under other settings {diff} (file, now): "
            "pass --out-dir for a separate file or --fresh to replace it"
        )


def cpu_bf16() -> str:
    """The CPU's native bf16 instructions (``avx512_bf16``, ``amx_bf16``) or ``none`` (bf16 is then emulated)."""
    flags = cpu_bf16_flags()
    return "unknown" if flags is None else ", ".join(flags) or "none"


if __name__ == "__main__":
    main()
