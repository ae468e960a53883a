"""Cost of the fused Hydra model vs one dense model, one member, the members one by one and a deep ensemble.

Everything is measured side by side in one process, on random weights of a real
layout (timm ``vit_base_patch16_224`` or BERT-base), M members each keeping
``--keep`` of the heads per layer. Prints parameters, multiply-adds per input and
min / median latency, with ratios to three dense models.

    python benchmarks/bench_fusion.py --layout vit_b16 --batches 1 4 16 32 --precisions fp32 bf16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.families import get_adapter  # noqa: E402
from offline.fusion import fuse  # noqa: E402


def build(layout: str, members: int, keep: int, seed: int = 0):
    torch.manual_seed(seed)
    if layout == "vit_b16":
        import timm

        base = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000).eval()
        adapter = get_adapter("vit")
        H = 12

        def make_input(b: int):
            return {"pixel_values": torch.randn(b, 3, 224, 224)}

        def run_member(m, x):
            return m(x["pixel_values"])

    elif layout == "bert_base":
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(num_labels=2, attn_implementation="sdpa")
        base = BertForSequenceClassification(cfg).eval()
        adapter = get_adapter("bert")
        H = 12

        def make_input(b: int):
            return {"input_ids": torch.randint(0, 30522, (b, 128)), "attention_mask": torch.ones(b, 128, dtype=torch.long)}

        def run_member(m, x):
            return m(**x).logits

    else:
        raise SystemExit(f"unknown layout {layout}")
    g = torch.Generator().manual_seed(seed)
    L = adapter.num_layers(base)
    keeps = [[sorted(torch.randperm(H, generator=g)[:keep].tolist()) for _ in range(L)] for _ in range(members)]
    pruned = [adapter.prune(base, k).eval() for k in keeps]
    fused, _ = fuse(adapter, pruned)
    # a deep ensemble: M dense models of the same layout (weights differ; cost is what matters)
    dense = [base]
    for s in range(1, members):
        torch.manual_seed(seed + s)
        other = type(base)(base.config) if layout == "bert_base" else None
        if other is None:
            import timm

            other = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000)
        dense.append(other.eval())
    return base, pruned, fused, dense, make_input, run_member


def macs(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc, torch.inference_mode():
        fn()
    return fc.get_total_flops() // 2


def timeit(fn, repeats: int, warmup: int = 1) -> tuple[float, float]:
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts), statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="vit_b16", choices=["vit_b16", "bert_base"])
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--keep", type=int, default=8, help="heads kept per layer per member (of 12)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=0, help="timed runs per cell (0: 10 at batch<=4, 5 above)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base, pruned, fused, dense, make_input, run_member = build(args.layout, args.members, args.keep)
    n_params = {
        "single": sum(p.numel() for p in base.parameters()),
        "member": sum(p.numel() for p in pruned[0].parameters()),
        "hydra": sum(p.numel() for p in fused.parameters()),
        "hydra_unfused": sum(sum(p.numel() for p in m.parameters()) for m in pruned),
        "deep_ensemble": sum(sum(p.numel() for p in m.parameters()) for m in dense),
    }
    x1 = make_input(1)
    fns1 = {
        "single": lambda x: run_member(base, x),
        "member": lambda x: run_member(pruned[0], x),
        "hydra": lambda x: fused(**x),
        "hydra_unfused": lambda x: [run_member(m, x) for m in pruned],
        "deep_ensemble": lambda x: [run_member(m, x) for m in dense],
    }
    n_macs = {k: macs(lambda f=f: f(x1)) for k, f in fns1.items()}
    print(f"# {args.layout}, M={args.members}, {args.keep}/12 heads kept per member, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'method':<14} {'params (M)':>10} {'GMAC/input':>11} {'vs single':>9}")
    for k in fns1:
        print(f"{k:<14} {n_params[k] / 1e6:>10.1f} {n_macs[k] / 1e9:>11.2f} {n_macs[k] / n_macs['single']:>9.2f}")
    rows = []
    print(f"\n{'prec':<5} {'batch':>5} " + " ".join(f"{k + ' min/med ms':>26}" for k in fns1) + "  hydra/3dense(min, med)")
    for prec in args.precisions:
        for b in args.batches:
            x = make_input(b)
            reps = args.repeats or (10 if b <= 4 else 5)
            res = {}
            for k, f in fns1.items():
                if prec == "bf16":
                    def call(f=f):
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            return f(x)
                else:
                    def call(f=f):
                        return f(x)
                res[k] = timeit(call, reps)
                rows.append({"layout": args.layout, "method": k, "batch": b, "device": "cpu", "precision": prec,
                             "latency_ms_min": res[k][0], "latency_ms_median": res[k][1],
                             "params": n_params[k], "macs": n_macs[k]})
            r_min = res["hydra"][0] / res["deep_ensemble"][0]
            r_med = res["hydra"][1] / res["deep_ensemble"][1]
            cells = " ".join(f"{res[k][0]:>12.1f} / {res[k][1]:>9.1f}" for k in fns1)
            print(f"{prec:<5} {b:>5} {cells}  {r_min:.3f}, {r_med:.3f}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
