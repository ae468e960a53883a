#!/usr/bin/env bash
# Every GPU measurement in one go, on one CUDA GPU, in about 10 minutes:
#   1. the CUDA tests (pytest -m gpu);
#   2. a fast build on CUDA (image-fast: build.device cuda, bf16 autocast), its per-stage times in its manifest; its
#      base is the repository's own backbone, so the run needs the Fashion-MNIST files and no downloaded model;
#   3. the cost benchmark on CUDA, fp32 and bf16, both big layouts (ViT-B/16, BERT-base), batches 1, 4 and 32;
#   4. the server benchmarks with wrk (benchmarks/bench_server.py) on CUDA: that artifact and a ViT-B/16-sized one
#      (random weights, 224 x 224 JPEG inputs), each with HYDRA_WORKERS auto, 1, 2, 4 and 8, at 1 and 256
#      connections, beside the raw Hydra model and the raw Single model (benchmarks/single.py) on the same backend
#      and precision: the served / raw Single ratio that decides what `auto` should be on a GPU;
#   5. hydra-predict on CUDA against the raw model on that artifact (benchmarks/batch_scoring.py).
# The device reaches no package registry: wrk comes as Debian packages in .deb/ (`make wrk-debs` downloads them
# here); they are unpacked into .deb/root when wrk is not installed.
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

if [ "$DRY" = 0 ] && ! command -v wrk >/dev/null 2>&1; then
    compgen -G ".deb/*.deb" >/dev/null || { echo "wrk is not installed and .deb/ has no packages: make wrk-debs"; exit 2; }
    mkdir -p .deb/root
    for f in .deb/*.deb; do dpkg -x "$f" .deb/root; done
    export PATH="$PWD/.deb/root/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$PWD/.deb/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

run mkdir -p "$OUT"
TESTS=0
run "$PY" -m pytest -m gpu -q -rs --junitxml "$OUT/cuda-tests.xml" || TESTS=$?
ART=.cache/gpu/image-fast-cuda  # the artifact stays out of the results; its manifest and report go in
run "$PY" offline/build.py --config offline/configs/image-fast.yaml --out "$ART" --force --no-progress \
    --build.device cuda --build.precision auto --build.workers 4
run mkdir -p "$OUT/build-image-fast-cuda"
run cp -r "$ART/manifest.json" "$ART/report.md" "$ART/report.json" "$ART/plots" "$OUT/build-image-fast-cuda/"
run "$PY" -m benchmarks.run --only cost --layouts vit_b16 bert_base --devices cuda --precisions fp32 bf16 \
    --batches 1 4 32 --repeats 10 --out "$OUT" --no-readme
run "$PY" -m benchmarks.bench_server --artifact "$ART" --device cuda --workers auto 1 2 4 8 --no-floor \
    --connections 1 256 --seconds 6 --raw-seconds 1.5 --tag cuda --out "$OUT/server"
run "$PY" -m benchmarks.bench_server --tiny vit_b16 --device cuda --workers auto 1 2 4 8 --no-floor \
    --connections 1 256 --seconds 6 --raw-seconds 1.5 --tag cuda --out "$OUT/server"
run "$PY" -m benchmarks.batch_scoring --image "$ART" --settings image --device cuda --no-ray --no-memory \
    --inputs 20000 --out "$OUT/batch/summary.json"
run "$PY" -c "import json, torch; json.dump({'gpu': torch.cuda.get_device_name(0), 'torch': torch.__version__, 'cuda': torch.version.cuda}, open('$OUT/device.json', 'w'))"
echo "results in $OUT"
exit "$TESTS"
