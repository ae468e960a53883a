"""deploy/batch: hydra-predict as a KubeRay RayJob, rendered with the real kustomize and checked offline.

KubeRay's CRDs are not in kubernetes-validate's schemas. The RayJob is checked against a JSON schema of the fields
of KubeRay's ``ray.io/v1`` API that it uses (``RayJobSpec``, ``RayClusterSpec``, ``HeadGroupSpec``,
``WorkerGroupSpec``: names, types, the required ones, no unknown field), and each pod template in it (head, worker
groups, submitter) is validated as a Pod with kubernetes-validate (strict). Then the rules: the entrypoint is a
``hydra-predict --engine ray`` command line that ``service.batch.command.parse_args`` accepts, whose artifact, input and
output are on volumes every node mounts (the artifact read-only, as the server mounts it; the data on one
ReadWriteMany claim); the settings pass ``Settings``; the cluster fits the actors it is asked for; its Ray version
is the ``batch`` extra's, and the image is built with Ray's dashboard (the ``batch-cluster`` extra).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.helpers import DEPLOY, ROOT, by_kind, kustomize, one, only_hydra_env, parse_dockerfile

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ (the image runs 3.12)")

BATCH = DEPLOY / "batch"
K8S_VERSIONS = ("1.30.0", "1.37.0")
DIGEST = re.compile(r"[a-z0-9.-]+(:\d+)?/[a-z0-9./_-]+@sha256:[0-9a-f]{64}")

# ------------------------------------------------------------------------------ KubeRay's ray.io/v1 structure
# The fields of KubeRay's ray.io/v1 types (RayJobSpec, RayClusterSpec, HeadGroupSpec, WorkerGroupSpec): json names,
# required where the json tag has no omitempty. Pod templates are objects here; they are checked as Pods below.
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"metadata": {"type": "object"}, "spec": {}}}
_INT = {"type": "integer"}
_COUNT = {"type": "integer", "minimum": 0}
_STRING = {"type": "string"}


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    """A JSON schema of an object with exactly ``properties``, ``required`` of them required."""
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


_HEAD_GROUP = _closed(
    ["rayStartParams", "template"],
    serviceType={"type": "string"},
    headService={"type": "object"},
    enableIngress={"type": "boolean"},
    rayStartParams=_STR_MAP,
    template=_TEMPLATE,
)
_WORKER_GROUP = _closed(
    ["groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"],
    **{"groupName": {"type": "string", "minLength": 1}, "rayStartParams": _STR_MAP, "template": _TEMPLATE},
    **dict.fromkeys(("replicas", "minReplicas", "maxReplicas", "numOfHosts"), _INT),
    **{"scaleStrategy": {"type": "object"}, "suspend": {"type": "boolean"}},
)
_CLUSTER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["headGroupSpec"],
    "properties": {
        "headGroupSpec": _HEAD_GROUP,
        "workerGroupSpecs": {"type": "array", "items": _WORKER_GROUP},
        "rayVersion": {"type": "string"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "autoscalerOptions": {"type": "object"},
        "headServiceAnnotations": _STR_MAP,
        "suspend": {"type": "boolean"},
    },
}
RAYJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": _closed(
            [],
            **{"activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "rayClusterSpec": _CLUSTER},
            **{"backoffLimit": _COUNT, "ttlSecondsAfterFinished": _COUNT, "submitterPodTemplate": _TEMPLATE},
            **dict.fromkeys(("metadata", "clusterSelector"), _STR_MAP),
            **dict.fromkeys(("submitterConfig", "deletionStrategy"), {"type": "object"}),
            **dict.fromkeys(("managedBy", "entrypoint", "runtimeEnvYAML", "jobId", "entrypointResources"), _STRING),
            **dict.fromkeys(("entrypointNumCpus", "entrypointNumGpus"), {"type": "number"}),
            **dict.fromkeys(("shutdownAfterJobFinishes", "suspend"), {"type": "boolean"}),
            submissionMode={"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode"]},
        ),
    },
}


@functools.cache
def _render() -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(BATCH))


@pytest.fixture
def docs() -> list[dict[str, Any]]:
    return copy.deepcopy(list(_render()))


@pytest.fixture
def job(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayJob")


def rayjob_errors(doc: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate (dev extra)")
    validator = jsonschema.Draft202012Validator(RAYJOB_SCHEMA)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def pod_templates(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every pod template of the RayJob: the head, each worker group, the submitter."""
    cluster = job["spec"]["rayClusterSpec"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out |= {f"worker {g['groupName']}": g["template"] for g in cluster.get("workerGroupSpecs", [])}
    if "submitterPodTemplate" in job["spec"]:
        out["submitter"] = job["spec"]["submitterPodTemplate"]
    return out


def ray_nodes(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Ray nodes' pod specs (the head and each worker group); KubeRay runs Ray in the first container."""
    return {k: t["spec"] for k, t in pod_templates(job).items() if k != "submitter"}


def mounts(spec: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Mount path -> (volume mount, volume) of the Ray container of a pod spec."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in spec["containers"][0].get("volumeMounts", [])}


def entrypoint(job: dict[str, Any]) -> list[str]:
    return shlex.split(job["spec"]["entrypoint"])


def _quantity(value: str | int) -> float:
    text = str(value)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _under(path: str, folder: str) -> bool:
    return Path(path).is_relative_to(folder)


# --------------------------------------------------------------------------------------------- the tests


def test_renders_the_job_its_settings_and_its_volume(docs):
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PersistentVolumeClaim", "RayJob"]
    assert {d["metadata"]["namespace"] for d in docs} == {"hydra-serve"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_resources_and_pod_templates_match_kubernetes_schemas(docs, job, version):
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    for doc in docs:
        if doc["kind"] != "RayJob":
            kv.validate(doc, version, strict=True)
    for name, template in pod_templates(job).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hydra-predict"}, "spec": template["spec"]}
        try:
            kv.validate(pod, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name} pod invalid for Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_rayjob_has_kuberays_structure(job):
    assert not rayjob_errors(job), rayjob_errors(job)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda j: j["spec"].update(shutdownAfterJobsFinish=True),  # a typo
        lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"].pop("rayStartParams"),
        lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
        lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("maxReplicas"),
        lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replica=2),
        lambda j: j["spec"].update(submissionMode="K8sJob"),
        lambda j: j.update(apiVersion="ray.io/v1alpha1"),
    ],
)
def test_the_structure_check_catches_mistakes(job, mutate):
    mutate(job)
    assert rayjob_errors(job)


def test_the_job_ends_and_deletes_its_cluster(job):
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec.get("submissionMode", "K8sJobMode") == "K8sJobMode" and spec["submitterPodTemplate"]
    assert spec["activeDeadlineSeconds"] > 0
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    assert "command" not in submitter  # KubeRay fills in `ray job submit ... -- <entrypoint>`
    assert spec["submitterPodTemplate"]["spec"]["restartPolicy"] == "Never"
    assert spec["rayClusterSpec"].get("enableInTreeAutoscaling") is not True
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"] >= 1


def test_the_entrypoint_is_a_hydra_predict_command_line_on_ray(job):
    from service.batch.command import parse_args

    command, *argv = entrypoint(job)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"][command] == "service.batch.command:main"
    args = parse_args(argv)  # exits (SystemExit 2) on a flag the command does not have
    assert args.engine == "ray" and args.address == "auto"  # the cluster the job was submitted to
    assert args.no_progress  # no terminal in a pod: progress lines in the log only


def test_parse_args_refuses_a_wrong_entrypoint(job):
    """The check above would see a flag hydra-predict does not have, or a missing one."""
    from service.batch.command import parse_args

    _, *argv = entrypoint(job)
    with pytest.raises(SystemExit):
        parse_args([*argv, "--workers", "2"])
    i = argv.index("--out")
    with pytest.raises(SystemExit):
        parse_args(argv[:i] + argv[i + 2 :])  # --out is required


def test_every_ray_node_sees_the_artifact_the_input_and_the_output(job, docs):
    from service.batch.command import parse_args

    args = parse_args(entrypoint(job)[1:])
    claim = one(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes parts into --out
    base = one(kustomize(DEPLOY / "base"), "Deployment")["spec"]["template"]["spec"]
    (server_mount, server_volume) = mounts(base)["/artifacts"]
    for name, spec in ray_nodes(job).items():
        by_path = mounts(spec)
        # the artifact as the server mounts it: the same volume, copied by the same init container, read-only
        artifact_mount, artifact_volume = by_path["/artifacts"]
        assert artifact_mount["readOnly"] is True, name
        assert artifact_volume == server_volume and _under(str(args.artifact), "/artifacts"), name
        init = {c["name"]: c for c in spec["initContainers"]}
        assert init["artifacts"]["command"] == {c["name"]: c for c in base["initContainers"]}["artifacts"]["command"]
        # the input and the output on the shared claim, writable
        data = [(p, m, v) for p, (m, v) in by_path.items() if "persistentVolumeClaim" in v]
        assert len(data) == 1, name
        path, data_mount, data_volume = data[0]
        assert data_volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], name
        assert not data_mount.get("readOnly") and _under(str(args.out), path) and _under(str(args.input), path), name
    assert server_mount["readOnly"] is True


def test_the_images_are_the_projects_by_digest(job):
    dockerfile = parse_dockerfile(ROOT / "Dockerfile")
    images = set()
    for name, template in pod_templates(job).items():
        for c in template["spec"]["containers"]:
            assert DIGEST.fullmatch(c["image"]) and c["imagePullPolicy"] == "IfNotPresent", name
            images.add(c["image"])
        for c in template["spec"].get("initContainers", []):
            assert DIGEST.fullmatch(c["image"]) and "hydra-serve-artifacts@" in c["image"], name
    (image,) = images  # head, workers and submitter run one image: Ray's versions agree
    assert "/hydra-serve@" in image
    # that image is the Dockerfile's, built with an extra that brings Ray's dashboard (the job submission API)
    builder = dockerfile.stage("builder")
    assert "EXTRAS" in dockerfile.args(builder)
    (install,) = [i for i in builder.find("RUN") if "requirements.py" in i.raw]
    assert "$EXTRAS" in install.raw


def test_the_ray_version_is_the_batch_extras(job):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for extra in ("batch", "batch-cluster"):
        (req,) = [r for r in extras[extra] if r.startswith("ray[")]
        m = re.fullmatch(r"ray\[([a-z,]+)\]==([\d.]+)", req)
        assert m, req
        pins[extra] = (set(m.group(1).split(",")), m.group(2))
    assert pins["batch"][1] == pins["batch-cluster"][1] == job["spec"]["rayClusterSpec"]["rayVersion"]
    assert pins["batch-cluster"][0] >= {"data", "default"}  # default: the dashboard, which takes the job


def test_the_probes_are_rays_health_check_over_http(job):
    """The image has no wget (the probes older KubeRay injects): the probes are HTTP GETs of the dashboard agent's
    health route, on Ray's default agent port."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed (the batch extra)")
    ray_dir = Path(next(iter(spec.submodule_search_locations)))
    constants = (ray_dir / "_private" / "ray_constants.py").read_text()
    port = int(re.search(r"^DEFAULT_DASHBOARD_AGENT_LISTEN_PORT = (\d+)", constants, re.M).group(1))
    agent = (ray_dir / "dashboard" / "modules" / "reporter" / "healthz_agent.py").read_text()
    for name, spec in ray_nodes(job).items():
        c = spec["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["port"] == port and f'@routes.get("{get["path"]}")' in agent, (name, probe)


def test_the_settings_pass_validation_and_size_the_actors(job, docs, monkeypatch):
    from pydantic import ValidationError

    from service.batch.command import parse_args
    from service.settings import Settings

    config = one(docs, "ConfigMap")
    env = config["data"]
    assert env["HYDRA_STORE"] == "off"
    only_hydra_env(monkeypatch, env)
    try:
        settings = Settings(_env_file=None)
    except ValidationError as e:
        pytest.fail(f"Settings refuses deploy/batch/predict.env: {e}")
    known = {f"HYDRA_{f}".upper() for f in Settings.model_fields}
    assert {k for k in env if k.startswith("HYDRA_")} <= known
    # one value on every node (the driver hands it to the actors), referenced by every Ray container
    for name, spec in ray_nodes(job).items():
        c = spec["containers"][0]
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in c["envFrom"], name
        assert not any(e["name"].startswith("HYDRA_") for e in c.get("env", [])), name
    # the cluster fits the actors: each asks for HYDRA_THREADS CPUs (CPU device) and the head takes none
    assert settings.device == "cpu" and settings.threads is not None
    assert env["OMP_NUM_THREADS"] == str(settings.threads)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    fits = 0
    for group in cluster["workerGroupSpecs"]:
        c = group["template"]["spec"]["containers"][0]
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        assert limits["cpu"] == requests["cpu"] and limits["memory"] == requests["memory"], group["groupName"]
        fits += group["replicas"] * math.floor(_quantity(limits["cpu"]) / settings.threads)
    actors = parse_args(entrypoint(job)[1:]).actors
    assert 1 <= actors <= fits, f"--actors {actors}, room for {fits}"


def test_the_pods_run_as_the_images_user_without_privileges(job):
    for name, template in pod_templates(job).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False, name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert c["resources"]["limits"]["memory"], (name, c["name"])


def test_the_readme_runs_this_kustomization():
    text = (DEPLOY / "README.md").read_text()
    assert "kubectl apply -k deploy/batch" in text and "EXTRAS=batch-cluster" in text
    assert by_kind(list(_render()), "RayJob")[0]["metadata"]["name"] in text
