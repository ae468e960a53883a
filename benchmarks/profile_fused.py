"""Where the time of one forward goes: torch.profiler's top operators, by input shape, per method.

Same models as ``bench_fusion.py`` (random weights, the ViT-B/16 or BERT-base layout); one warm-up
call, then one profiled call per method. Used to find why the fused model lost to the deep
ensemble at batch 32 in bf16 on a CPU with AMX (benchmarks/README.md, "A CPU with native bf16")::

    python benchmarks/profile_fused.py --layout bert_base --batch 32 --precision bf16 --cpu-max-rows 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import bench_fusion  # noqa: E402
from service.fused import CPU_MAX_ROWS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="bert_base", choices=sorted(bench_fusion.LAYOUTS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--methods", nargs="+", default=["hydra", "deep_ensemble"], choices=bench_fusion.METHODS)
    ap.add_argument("--cpu-max-rows", type=int, default=CPU_MAX_ROWS, help="fused CPU sub-batch rows (0: one pass)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15, help="operators shown per method")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = bench_fusion.build(args.layout, 3, bench_fusion.LAYOUTS[args.layout]["keep"])
    models["fused"].cpu_max_rows = args.cpu_max_rows
    fns = bench_fusion.methods(models)
    x = models["make_input"](args.batch)
    print(f"# {args.layout}, batch {args.batch}, {args.precision}, {torch.get_num_threads()} threads, "
          f"{bench_fusion.cpu_name()} (native bf16: {bench_fusion.cpu_bf16()}), cpu_max_rows {args.cpu_max_rows}")
    for name in args.methods:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            fns[name](x)  # warm-up
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                fns[name](x)
        events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        print(f"\n== {name}: {total:.0f} ms self CPU time in all; top operators (calls, self ms, ms per call, shapes)")
        for e in events[: args.top]:
            ms = e.self_cpu_time_total / 1e3
            print(f"{e.key:28s} {e.count:5d} {ms:9.1f} {ms / e.count:8.2f}  {str(e.input_shapes)[:110]}")


if __name__ == "__main__":
    main()
