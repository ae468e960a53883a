"""deploy/build: the build as Kubernetes Jobs, one per stage of ``offline/build.py --stage``, validated offline.

The kustomization renders with the real kustomize and every resource is valid Kubernetes (strict schemas); the
Jobs agree with the builder (each runs a stage the builder has, the members Job has one completion per member
of the config it mounts, all share one volume); the config is a valid build config; ``run.sh`` applies the
stages in order and stops at a failed one (driven with a recording stand-in for kubectl); the builder image's
Dockerfile passes hadolint.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from offline.build import parse_args
from offline.config import load_config
from offline.pipelines.classifier_build import STAGES
from tests.deploy.helpers import DEPLOY, by_kind, kustomize, one, require_tool

BUILD = DEPLOY / "build"
K8S_VERSIONS = ("1.30.0", "1.37.0")
ORDER = ["base", "score", "members", "finish"]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return kustomize(BUILD)


def _jobs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {j["metadata"]["labels"]["hydra-serve.build/stage"]: j for j in by_kind(docs, "Job")}


def _config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(docs, "ConfigMap")["data"]["build.yaml"])


def test_renders_the_stages_and_matches_kubernetes_schemas(docs):
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Job", "Job", "Job", "Job", "PersistentVolumeClaim"]
    assert sorted(_jobs(docs)) == sorted(ORDER)
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    for version in K8S_VERSIONS:
        for doc in docs:
            kv.validate(doc, version, strict=True)


def test_every_job_runs_a_builder_stage_on_the_shared_volume(docs):
    claim = one(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # member pods on several nodes write at once
    config_map = one(docs, "ConfigMap")["metadata"]["name"]
    for stage, job in _jobs(docs).items():
        pod = job["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = parse_args([a.replace("$(MEMBER)", "0") for a in c["args"]])  # the builder's parser, as the kubelet
        # hands it the arguments (with the completion index expanded)
        assert args.stage in STAGES and args.stage == ("member" if stage == "members" else stage)
        assert args.out.startswith("/workspace/") and args.config == "/config/build.yaml"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["workspace"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert volumes["config"]["configMap"]["name"] == config_map  # kustomize's hashed name, on every Job
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/workspace", "/config"}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and pod["runtimeClassName"] == "nvidia"
        assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"] is True


def test_the_members_job_has_one_indexed_pod_per_member(docs):
    job = _jobs(docs)["members"]
    members = _config(docs)["hydra"]["members"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == members
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert "--member=$(MEMBER)" in c["args"]
    (env,) = [e for e in c["env"] if e["name"] == "MEMBER"]
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"  # the pod's completion index
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert parse_args([*c["args"][:-1], "--member=2"]).member == 2


def test_the_shipped_config_is_a_valid_build_config(docs, tmp_path):
    """Valid as it stands, with its input paths pointed at files that exist (here: empty stand-ins) and the
    device at the CPU (it asks for CUDA, which this machine may not have)."""
    path = tmp_path / "build.yaml"
    path.write_text(one(docs, "ConfigMap")["data"]["build.yaml"])
    (tmp_path / "photos").mkdir()
    (tmp_path / "vit.safetensors").write_bytes(b"")
    cfg = load_config(
        path,
        {"base.path": str(tmp_path / "vit.safetensors"), "data.path": str(tmp_path / "photos"), "build.device": "cpu"},
    )
    assert cfg.hydra.members == _config(docs)["hydra"]["members"] and cfg.build.precision == "auto"
    assert _config(docs)["build"]["device"] == "cuda"


KUBECTL_STUB = """#!/bin/sh
echo "$*" >> "$CALLS"
if [ "$1" = get ]; then
    case "$2" in
        job/hydra-build-$FAIL) echo Failed ;;
        *) echo Complete ;;
    esac
fi
"""


def _run_sh(tmp_path: Path, fail: str = "none") -> tuple[subprocess.CompletedProcess, list[str]]:
    stub = tmp_path / "kubectl"
    stub.write_text(KUBECTL_STUB)
    stub.chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "KUBECTL": str(stub), "POLL": "0", "CALLS": str(calls), "FAIL": fail}
    proc = subprocess.run(
        ["sh", str(BUILD / "run.sh"), str(BUILD)], env=env, capture_output=True, text=True, timeout=30
    )
    return proc, calls.read_text().splitlines()


def test_run_sh_applies_the_stages_in_order_and_waits_for_each(tmp_path):
    require_tool("sh")
    proc, calls = _run_sh(tmp_path)
    assert proc.returncode == 0, proc.stderr
    want = [f"apply -k {BUILD} -l hydra-serve.build/stage=setup"]
    for stage in ORDER:
        want += [
            f"apply -k {BUILD} -l hydra-serve.build/stage={stage}",
            f'get job/hydra-build-{stage} -o jsonpath={{.status.conditions[?(@.status=="True")].type}}',
        ]
    assert calls == want


def test_run_sh_stops_at_a_failed_stage(tmp_path):
    proc, calls = _run_sh(tmp_path, fail="members")
    assert proc.returncode == 1
    assert "stage members failed: " in proc.stderr and "logs job/hydra-build-members" in proc.stderr
    assert not any("stage=finish" in c for c in calls)  # the artifact stage never started


def test_the_builder_dockerfile_passes_hadolint_and_copies_what_exists():
    hadolint = require_tool("hadolint")
    dockerfile = BUILD / "Dockerfile"
    proc = subprocess.run(
        [hadolint, "--no-color", "--config", str(DEPLOY / "hadolint.yaml"), str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = DEPLOY.parent
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (root / src).exists(), src
