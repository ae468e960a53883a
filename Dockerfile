# syntax=docker/dockerfile:1
# hydra-serve: the serving image (HTTP API: docs/api.md), built from one file in two variants.
#
#   CPU (default, Ubuntu base, CPU torch): docker build -t hydra-serve:0.1.0-cpu .
#   GPU (CUDA runtime base):               docker build --build-arg VARIANT=gpu -t hydra-serve:0.1.0-gpu .
#
# Artifacts are not baked in: mount them and list them in HYDRA_ARTIFACTS (default
# /artifacts/text,/artifacts/image, the layout `make artifacts` writes to artifacts/default).
# To bake artifacts in, name a folder of the build context (under artifacts/, see .dockerignore):
#   docker build --build-arg ARTIFACTS=artifacts/default -t hydra-serve:0.1.0-cpu-default .
# The artifacts alone, for the Kubernetes init container (deploy/base/deployment.yaml):
#   docker build --target artifacts --build-arg ARTIFACTS=artifacts/default -t hydra-serve-artifacts:default .

# cpu | gpu: picks the base image, the torch build and the onnxruntime extra (onnx | gpu). CPU by default: it runs
# anywhere, and a GPU image is only of use on a GPU node.
ARG VARIANT=cpu
# torch 2.14.1 from PyPI is built for CUDA 13.0 (cu130): keep the runtime base on the same major version.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04
# Folder of the build context copied to /artifacts; the default holds only a README.
ARG ARTIFACTS=deploy/docker/no-artifacts

# ---------------------------------------------------------------------------------------------
# OS + Python, shared by the build and runtime stages: the virtualenv built in one runs in the other.
FROM ${CUDA_IMAGE} AS os-gpu
FROM ${CPU_IMAGE} AS os-cpu
# os-gpu or os-cpu, both stages above (tagged there): DL3006 cannot see through the variable.
# hadolint ignore=DL3006
FROM os-${VARIANT} AS python
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
# Builder: a virtualenv with the pinned dependencies, then the package itself.
FROM python AS builder
ARG VARIANT
# More extras of pyproject.toml, comma-separated: batch-cluster for the Ray cluster of hydra-predict (deploy/batch/).
ARG EXTRAS=""
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependency files first: the multi-GB dependency layer is rebuilt only when pyproject.toml changes.
COPY pyproject.toml ./
COPY deploy/docker/requirements.py /tmp/requirements.py
# CPU: torch/torchvision from the PyTorch CPU index (no CUDA libraries), onnxruntime CPU (`onnx` extra).
# GPU: torch from PyPI (cu130), onnxruntime-gpu (`gpu` extra).
# Both: OpenTelemetry (`otel` extra), off unless HYDRA_OTEL=true.
RUN extra=gpu,otel \
 && if [ "$VARIANT" = cpu ]; then extra=onnx,otel; export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu; fi \
 && python /tmp/requirements.py pyproject.toml "$extra${EXTRAS:+,$EXTRAS}" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
# Then the source: only the server package (the offline builder and its dependencies stay out of the image).
COPY README.md ./
COPY service/ service/
# `-P`: the import check sees the installed package, not the source folder in the working directory. uvloop and
# httptools (runtime dependencies) are checked too: without them `python -m service` would fall back to asyncio and
# h11, the slower pure-Python HTTP layer (service/entrypoints/http_server.py).
RUN pip install --no-deps . \
 && python -P -c "import service.settings, service.main, uvloop, httptools"

# ---------------------------------------------------------------------------------------------
# Artifacts only (tiny image with `cp`): the init container copies /artifacts into the pod's volume.
FROM busybox:1.37.0 AS artifacts
ARG ARTIFACTS
COPY ${ARTIFACTS}/ /artifacts/
USER 10001:10001

# ---------------------------------------------------------------------------------------------
# Runtime (default target): the virtualenv, no compilers, non-root, read-only-root-filesystem friendly.
FROM python AS runtime
ARG VARIANT
ARG HYDRA_ARTIFACTS=/artifacts/text,/artifacts/image
RUN groupadd --gid 10001 hydra \
 && useradd --uid 10001 --gid 10001 --home-dir /home/hydra --create-home --shell /usr/sbin/nologin hydra \
 && install -d -o 10001 -g 10001 /home/hydra/.cache
COPY --from=builder /opt/venv /opt/venv
COPY --from=artifacts --chown=10001:10001 /artifacts /artifacts
# Every cache under /home/hydra/.cache: on Kubernetes that folder and /tmp are emptyDirs and the root is read-only.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/hydra \
    XDG_CACHE_HOME=/home/hydra/.cache \
    HF_HOME=/home/hydra/.cache/huggingface \
    TORCH_HOME=/home/hydra/.cache/torch \
    TRITON_CACHE_DIR=/home/hydra/.cache/triton \
    MPLCONFIGDIR=/home/hydra/.cache/matplotlib \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HYDRA_HOST=0.0.0.0 \
    HYDRA_PORT=8000 \
    HYDRA_ARTIFACTS=${HYDRA_ARTIFACTS}
LABEL org.opencontainers.image.title="hydra-serve" \
      org.opencontainers.image.description="Uncertainty-aware transformer inference (Hydra ensembles) over HTTP" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.hydra-serve.variant="${VARIANT}"
WORKDIR /home/hydra
USER 10001:10001
EXPOSE 8000
# Liveness only (/readyz gates traffic); the port follows HYDRA_PORT when it is overridden at run time.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('HYDRA_PORT', '8000'), timeout=4)"]
# The README's command.
CMD ["python", "-m", "service"]
