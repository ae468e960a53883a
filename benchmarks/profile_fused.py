"""Where the time of one forward goes: torch.profiler's top operators, by input shape, per method.

Same models as ``bench_fusion.py`` (random weights, the ViT-B/16 or BERT-base layout); one warm-up
call, then one profiled call per method. Used to find why the fused model lost to the deep
ensemble at batch 32 in bf16 on a CPU with AMX (benchmarks/README.md, "A CPU with native bf16")::

    python -m benchmarks.profile_fused --layout bert_base --batch 32 --precision bf16 --cpu-max-rows 0

``--backend onnx`` profiles the models' ONNX exports in ONNX Runtime instead (fp32; the server's session options
with ORT's own profiler on): time per operator type, summed over the graph's nodes.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_fusion
from service.core.fused import CPU_MAX_ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="bert_base", choices=sorted(bench_fusion.LAYOUTS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--methods", nargs="+", default=["hydra", "deep_ensemble"], choices=bench_fusion.METHODS)
    ap.add_argument("--cpu-max-rows", type=int, default=CPU_MAX_ROWS, help="fused CPU sub-batch rows (0: one pass)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15, help="operators shown per method")
    ap.add_argument("--backend", default="eager", choices=["eager", "onnx"])
    ap.add_argument("--repeats", type=int, default=5, help="onnx: profiled calls (after one warm-up)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = bench_fusion.build(args.layout, 3, bench_fusion.LAYOUTS[args.layout]["keep"])
    models["fused"].cpu_max_rows = args.cpu_max_rows
    if args.backend == "onnx":
        profile_onnx(models, args)
        return
    fns = bench_fusion.methods(models)
    x = models["make_input"](args.batch)
    print(
        f"# {args.layout}, batch {args.batch}, {args.precision}, {torch.get_num_threads()} threads, "
        f"{bench_fusion.cpu_name()} (native bf16: {bench_fusion.cpu_bf16()}), cpu_max_rows {args.cpu_max_rows}"
    )
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


def profile_onnx(models: dict, args: argparse.Namespace) -> None:
    """Hydra and one dense model exported to ONNX, each run ``args.repeats`` times under ORT's profiler: per
    operator type, its share of the summed node time and ms per call."""
    import json
    import tempfile
    from collections import defaultdict

    from benchmarks.cost import _ImageLogits, _TextLogits
    from offline.models.export import export_onnx
    from service.core.backends import onnx_session

    x = models["make_input"](args.batch)
    wrap = _ImageLogits if "pixel_values" in x else _TextLogits
    print(f"# {args.layout}, batch {args.batch}, onnx fp32, {args.threads} threads, {bench_fusion.cpu_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("hydra", models["fused"]), ("single", wrap(models["base"], models["run"]).eval())):
            path = f"{tmp}/{name}.onnx"
            export_onnx(model, x, path, ["logits"])
            sess = onnx_session(path, threads=args.threads, profile_prefix=f"{tmp}/{name}")  # the server's options
            feed = {i.name: x[i.name].numpy() for i in sess.get_inputs()}
            for _ in range(1 + args.repeats):
                sess.run(None, feed)
            events = json.loads(open(sess.end_profiling()).read())
            by_op: dict[str, float] = defaultdict(float)
            for e in events:
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                    by_op[e["args"]["op_name"]] += e["dur"] / 1e3  # microseconds -> ms
            total = sum(by_op.values())
            print(
                f"\n== {name}: {total / (1 + args.repeats):.1f} ms of node time per call; top operator types "
                "(share, ms per call)"
            )
            for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"{op:28s} {100 * ms / total:5.1f} % {ms / (1 + args.repeats):8.2f}")


if __name__ == "__main__":
    main()
