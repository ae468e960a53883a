#!/usr/bin/env bash
# Fetch the data sets that do not come with pip (see README "Models and data"):
# Fashion-MNIST from Debian's `dataset-fashion-mnist` package. Idempotent.
# Result: IDX gz files under $HYDRA_DATA_DIR/fashion-mnist (a link to the system copy when installed).
set -euo pipefail
DATA_DIR="${HYDRA_DATA_DIR:-$(pwd)/.cache/datasets}"
SYS=/usr/share/datasets/fashion-mnist
FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
mkdir -p "$DATA_DIR"

have() { local d=$1; for f in "${FILES[@]}"; do [ -s "$d/$f" ] || return 1; done; }

if have "$DATA_DIR/fashion-mnist"; then
  echo "fashion-mnist: $DATA_DIR/fashion-mnist"; exit 0
fi
if ! have "$SYS" && [ "$(id -u)" = 0 ]; then
  echo "fashion-mnist: installing Debian package dataset-fashion-mnist"
  apt-get update -qq >/dev/null || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null || true
fi
if have "$SYS"; then
  rm -rf "$DATA_DIR/fashion-mnist"
  ln -s "$SYS" "$DATA_DIR/fashion-mnist"
else
  echo "fashion-mnist: extracting Debian package dataset-fashion-mnist without root"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download dataset-fashion-mnist >/dev/null)
  dpkg-deb -x "$tmp"/dataset-fashion-mnist_*.deb "$tmp/root"
  rm -rf "$DATA_DIR/fashion-mnist"
  mv "$tmp/root$SYS" "$DATA_DIR/fashion-mnist"
  rm -rf "$tmp"
fi
have "$DATA_DIR/fashion-mnist" || { echo "fashion-mnist: files missing under $DATA_DIR/fashion-mnist" >&2; exit 1; }
echo "fashion-mnist: $DATA_DIR/fashion-mnist"
