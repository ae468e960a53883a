"""Smoke test of the pod's process, outside a container: `python -m service` (the image's CMD) with the
environment the image and an overlay give it, on tiny artifacts laid out as the ConfigMap expects.

Checks that the startup/readiness/liveness probes, the Dockerfile HEALTHCHECK and an authenticated
request behave as the manifests assume, and that SIGTERM ends the process within the grace period.
Only 127.0.0.1 is used (HYDRA_HOST is overridden from 0.0.0.0).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.harness import free_port
from tests.deploy.helpers import DEPLOY, ROOT, Dockerfile, container, kustomize, one, parse_dockerfile
from tests.fixtures.tiny_artifact import make_tiny_artifact

pytestmark = pytest.mark.slow


def _get(url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def _pod_env(docs: list[dict], c: dict, df: Dockerfile) -> dict[str, str]:
    """The process environment of the pod's container: the image's HYDRA_/HF_/TRANSFORMERS_ variables, the
    ConfigMap, the Secret (a stand-in key) and the CPU limit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    image_env = df.env(df.stage("runtime"))
    env.update({k: v for k, v in image_env.items() if k.startswith(("HYDRA_", "HF_", "TRANSFORMERS_"))})
    env.update(one(docs, "ConfigMap")["data"])
    cpu_limit = c["resources"]["limits"]["cpu"]
    for e in c["env"]:
        if "secretKeyRef" in e["valueFrom"]:
            env[e["name"]] = "smoke-test-key"
        else:  # resourceFieldRef limits.cpu, divisor 1
            env[e["name"]] = str(math.ceil(float(cpu_limit)))
    return env


def _tiny_artifacts(env: dict[str, str], c: dict, root: Path) -> list[str]:
    """Tiny artifacts where the ConfigMap says, under ``root``, a stand-in for the /artifacts volume."""
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "artifacts")
    paths = []
    for path in env["HYDRA_ARTIFACTS"].split(","):
        local = root / Path(path).relative_to(mount)
        family = "bert" if local.name == "text" else "vit"
        make_tiny_artifact(local, family, name=f"smoke-{local.name}", exports=("onnx",))
        paths.append(str(local))
    return paths


def _wait_started(base: str, c: dict, proc: subprocess.Popen) -> None:
    """Poll the startup probe's path as often and as long as the startup probe does."""
    startup = c["startupProbe"]
    deadline = time.monotonic() + startup["periodSeconds"] * startup["failureThreshold"]
    while time.monotonic() < deadline and proc.poll() is None:
        if _get(base + startup["httpGet"]["path"])[0] == 200:
            return
        time.sleep(0.5)
    pytest.fail(f"never ready (exit {proc.poll()}):\n{proc.stdout.read().decode() if proc.poll() else ''}")


def _check_serving(base: str, c: dict, df: Dockerfile, env: dict[str, str]) -> None:
    """The probes, /metrics and the image's HEALTHCHECK answer; a request needs the API key and is answered."""
    assert _get(base + c["livenessProbe"]["httpGet"]["path"])[0] == 200
    assert _get(base + c["readinessProbe"]["httpGet"]["path"])[0] == 200
    assert _get(base + "/metrics")[0] == 200
    (hc,) = df.stage("runtime").find("HEALTHCHECK")
    assert subprocess.run([sys.executable, *hc.args[1:]], env=env, timeout=30).returncode == 0

    buf = io.BytesIO()
    Image.new("L", (16, 16), 128).save(buf, format="PNG")
    body = json.dumps({"image": base64.b64encode(buf.getvalue()).decode(), "model": "smoke-image"}).encode()
    headers = {"content-type": "application/json"}
    assert _get(base + "/predict", headers, body)[0] == 401
    status, answer = _get(base + "/predict", {**headers, "authorization": "Bearer smoke-test-key"}, body)
    assert status == 200, answer
    assert json.loads(answer)["predictions"][0]["ood"]["metric"] == "msp"


@pytest.mark.parametrize("overlay", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_pod_process_with_the_overlay_environment(tmp_path: Path, overlay: str) -> None:
    if overlay == "gpu":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("the gpu overlay sets HYDRA_DEVICE=cuda: needs CUDA")
    docs = kustomize(DEPLOY / "overlays" / overlay)
    deployment = one(docs, "Deployment")
    c = container(deployment)
    df = parse_dockerfile(ROOT / "Dockerfile")
    env = _pod_env(docs, c, df)
    paths = _tiny_artifacts(env, c, tmp_path)
    port = free_port()
    env.update(HYDRA_ARTIFACTS=",".join(paths), HYDRA_HOST="127.0.0.1", HYDRA_PORT=str(port))
    env["PYTHONPATH"] = str(ROOT)

    (cmd,) = df.stage("runtime").find("CMD")
    assert cmd.args[0] == "python"
    proc = subprocess.Popen(
        [sys.executable, *cmd.args[1:]], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_started(base, c, proc)
        _check_serving(base, c, df, env)
    finally:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("SIGTERM did not stop the server within terminationGracePeriodSeconds")
    log = proc.stdout.read().decode()
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown: exit 0 or "killed by SIGTERM"
    # (143 in a container) are both a clean stop for Kubernetes; what matters is that shutdown completed.
    assert rc in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log, log
    assert time.monotonic() - t0 < 30
