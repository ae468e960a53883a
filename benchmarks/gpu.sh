#!/usr/bin/env bash
# Every GPU measurement in one go, on one CUDA GPU, in about 10 minutes:
#   1. the CUDA tests (pytest -m gpu);
#   2. a fast build on CUDA (image-fast: build.device cuda, bf16 autocast), its per-stage times in its manifest; its
#      base is the repository's own backbone, so the run needs the Fashion-MNIST files and no downloaded model;
#   3. the cost benchmark on CUDA, fp32 and bf16, both big layouts (ViT-B/16, BERT-base), batches 1, 4 and 32;
#   4. the server benchmark on that artifact with HYDRA_DEVICE=cuda, at 1, 8 and 32 clients.
# Results go to benchmarks/results/gpu/<GPU name>/ (or $OUT), each file naming the GPU. A failing CUDA test is
# recorded (cuda-tests.xml) and the measurements still run; the script then exits with the tests' status.
#
#   benchmarks/gpu.sh              # run it (make bench-gpu does the same)
#   benchmarks/gpu.sh --dry-run    # print the commands only (tests/benchmarks/test_gpu_script.py checks them)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

if [ "$DRY" = 1 ]; then
    GPU="dry-run"
else
    GPU=$("$PY" -c 'import torch, sys; torch.cuda.is_available() or sys.exit("no CUDA device: benchmarks/gpu.sh needs one"); print(torch.cuda.get_device_name(0))')
fi
OUT=${OUT:-benchmarks/results/gpu/$(echo "$GPU" | tr -c 'A-Za-z0-9._-' '_' | sed 's/_*$//')}

run() {
    echo "+ $*"
    [ "$DRY" = 1 ] || "$@"
}

run mkdir -p "$OUT"
TESTS=0
run "$PY" -m pytest -m gpu -q -rs --junitxml "$OUT/cuda-tests.xml" || TESTS=$?
ART=.cache/gpu/image-fast-cuda  # the artifact stays out of the results; its manifest and report go in
run "$PY" offline/build.py --config offline/configs/image-fast.yaml --out "$ART" --force --no-progress \
    --build.device cuda --build.precision auto --build.workers 4
run mkdir -p "$OUT/build-image-fast-cuda"
run cp -r "$ART/manifest.json" "$ART/report.md" "$ART/report.json" "$ART/plots" "$OUT/build-image-fast-cuda/"
run "$PY" -m benchmarks.run --only cost --layouts vit_b16 bert_base --devices cuda --precisions fp32 bf16 \
    --batches 1 4 32 --repeats 20 --out "$OUT" --no-readme
run "$PY" -m benchmarks.bench_server --artifact "$ART" --device cuda --concurrency 1 8 32 \
    --requests 2000 --duration 20 --out "$OUT/server-image-fast-cuda.json"
run "$PY" -c "import json, torch; json.dump({'gpu': torch.cuda.get_device_name(0), 'torch': torch.__version__, 'cuda': torch.version.cuda}, open('$OUT/device.json', 'w'))"
echo "results in $OUT"
exit "$TESTS"
