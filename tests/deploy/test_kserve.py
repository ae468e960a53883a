"""deploy/kserve: the KServe InferenceService renders with the real kustomize and is well formed.

KServe's CRDs are not in kubernetes-validate's schemas. The InferenceService is checked field by field against the
models of the KServe Python SDK (``kserve.models``, generated from KServe's OpenAPI document, the same that the CRDs
come from) and of the Kubernetes Python client for the core types they embed (containers, probes, volumes): an
unknown field, a field in the wrong place or a value of the wrong kind fails. Its pod part is also validated as a
Pod with kubernetes-validate (strict). Then the rules: protocol v2, the serving image and port, probes on the
Open Inference Protocol's health routes (served, and open without the API key), images by digest, settings.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from typing import Any

import pytest

from tests.deploy.helpers import DEPLOY, ROOT, kustomize, one, parse_dockerfile

kserve_models = pytest.importorskip("kserve.models", reason="pip install kserve (dev extra)")
k8s_models = pytest.importorskip("kubernetes.client.models", reason="comes with kserve (dev extra)")

DIGEST = re.compile(r"[a-z0-9.-]+(:\d+)?/[a-z0-9./_-]+@sha256:[0-9a-f]{64}")
# the predictor's fields that are KServe's (ComponentExtensionSpec), not the pod's
COMPONENT_FIELDS = {
    "minReplicas",
    "maxReplicas",
    "scaleTarget",
    "scaleMetric",
    "scaleMetricType",
    "containerConcurrency",
    "timeout",
    "canaryTrafficPercent",
    "logger",
    "batcher",
    "labels",
    "annotations",
    "deploymentStrategy",
    "autoScaling",
    "storageUris",
    "workerSpec",
    "model",
    "storageContainerName",
}


@functools.cache
def _render() -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(DEPLOY / "kserve"))


@pytest.fixture
def isvc() -> dict[str, Any]:
    docs = list(_render())
    assert [d["kind"] for d in docs] == ["InferenceService"]
    return copy.deepcopy(docs[0])


def predictor_container(isvc: dict[str, Any]) -> dict[str, Any]:
    (c,) = isvc["spec"]["predictor"]["containers"]
    return c


# ------------------------------------------------------------------------------------ structure (KServe SDK)
_LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\(str, |Dict\[str, )(.+)[)\]]$")
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def _model(type_name: str) -> Any:
    return getattr(kserve_models, type_name, None) or getattr(k8s_models, type_name, None)


def structure_errors(value: Any, type_name: str, path: str = "") -> list[str]:
    """Every place where ``value`` does not fit the SDK model ``type_name`` (camelCase keys, as in YAML)."""
    if m := _LIST.match(type_name):
        if not isinstance(value, list):
            return [f"{path}: a list expected"]
        return [e for i, v in enumerate(value) for e in structure_errors(v, m[1], f"{path}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(value, dict):
            return [f"{path}: a map expected"]
        return [e for k, v in value.items() for e in structure_errors(v, m[1], f"{path}.{k}")]
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and (type_name == "bool") == isinstance(value, bool)
        return [] if ok else [f"{path}: {type_name} expected, got {value!r}"]
    model = _model(type_name)
    if model is None:  # object, quantities, int-or-string: any scalar or object
        return []
    if not isinstance(value, dict):
        return [f"{path}: an object ({type_name}) expected"]
    by_key = {json_key: attr for attr, json_key in model.attribute_map.items()}
    errors = []
    for key, v in value.items():
        if key not in by_key:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += structure_errors(v, model.openapi_types[by_key[key]], f"{path}.{key}")
    return errors


def test_renders_and_fits_the_kserve_sdk_models(isvc: dict[str, Any]) -> None:
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert isvc["metadata"]["namespace"] == "hydra-serve"
    assert structure_errors(isvc, "V1beta1InferenceService") == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["spec"]["predictor"].update(minReplica=1),  # typo
        lambda d: d["spec"].update(containers=d["spec"]["predictor"]["containers"]),  # wrong place
        lambda d: predictor_container(d)["readinessProbe"]["httpGet"].update(pth="/v2/health/ready"),
        lambda d: predictor_container(d).update(env={"PROTOCOL": "v2"}),  # a map where a list belongs
        lambda d: d["spec"]["predictor"].update(maxReplicas="6"),  # a string where an integer belongs
    ],
)
def test_structure_check_catches_mistakes(isvc: dict[str, Any], mutate: Any) -> None:
    mutate(isvc)
    assert structure_errors(isvc, "V1beta1InferenceService")


def test_pod_part_is_a_valid_pod(isvc: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    spec = {k: v for k, v in isvc["spec"]["predictor"].items() if k not in COMPONENT_FIELDS}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hydra-serve-predictor"}, "spec": spec}
    for version in ("1.30.0", "1.37.0"):
        kv.validate(pod, version, strict=True)


# ------------------------------------------------------------------------------------ the rules
def test_custom_predictor_speaks_v2_on_the_servers_port(isvc: dict[str, Any]) -> None:
    from service.settings import Settings

    c = predictor_container(isvc)
    assert c["name"] == "kserve-container"  # KServe's name for the serving container
    env = {e["name"]: e for e in c["env"]}
    assert env["PROTOCOL"]["value"] == "v2"  # how KServe learns a custom container's protocol
    (port,) = c["ports"]
    assert port["containerPort"] == Settings.model_fields["port"].default == int(env["HYDRA_PORT"]["value"])
    assert port["name"] in ("http1", "h2c") and port["protocol"] == "TCP"  # the names KServe / Knative accept
    assert env["HYDRA_HOST"]["value"] == "0.0.0.0"
    assert isvc["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])


def test_probes_are_the_protocols_health_routes(isvc: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient

    from service.entrypoints.app import create_app
    from service.settings import Settings

    c = predictor_container(isvc)
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= 300
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == c["ports"][0]["containerPort"], probe
        assert c[probe]["timeoutSeconds"] < c[probe]["periodSeconds"], probe
    # with the API key set (as here), the probes carry no token: the paths must answer without one
    client = TestClient(create_app(Settings(api_key="secret", artifacts=[])))  # nothing loaded
    assert client.get(c["livenessProbe"]["httpGet"]["path"]).json() == {"live": True}
    ready = client.get(c["readinessProbe"]["httpGet"]["path"])
    assert ready.status_code == 503 and "not ready" in ready.json()["error"]  # not loaded, not 401
    assert client.get("/v2/models/x/ready").status_code == 401


def test_images_by_digest_and_artifacts_as_in_base(isvc: dict[str, Any]) -> None:
    pod = isvc["spec"]["predictor"]
    containers = pod["initContainers"] + pod["containers"]
    for c in containers:
        assert DIGEST.fullmatch(c["image"]) and c["imagePullPolicy"] == "IfNotPresent", c["image"]
    (init,) = pod["initContainers"]
    base = one(kustomize(DEPLOY / "base"), "Deployment")["spec"]["template"]["spec"]
    assert init["command"] == base["initContainers"][0]["command"]
    c = predictor_container(isvc)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "artifacts")
    assert mount["readOnly"] and all(p.startswith(mount["mountPath"] + "/") for p in env["HYDRA_ARTIFACTS"].split(","))


def test_security_and_resources(isvc: dict[str, Any]) -> None:
    pod = isvc["spec"]["predictor"]
    sc = pod["securityContext"]
    df = parse_dockerfile(ROOT / "Dockerfile")
    (user,) = df.stage("runtime").find("USER")
    uid, _, gid = user.args[0].partition(":")
    assert sc["runAsNonRoot"] and (sc["runAsUser"], sc["runAsGroup"]) == (int(uid), int(gid))
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    for c in pod["initContainers"] + pod["containers"]:
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] and not csc["allowPrivilegeEscalation"] and csc["capabilities"]["drop"]
    c = predictor_container(isvc)
    assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed QoS on CPU
    env = {e["name"]: e for e in c["env"]}
    for threads in ("HYDRA_THREADS", "OMP_NUM_THREADS"):
        ref = env[threads]["valueFrom"]["resourceFieldRef"]
        assert (ref["containerName"], ref["resource"]) == (c["name"], "limits.cpu")
    assert env["HYDRA_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "hydra-serve-api-key", "key": "api-key"}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert {"/tmp", "/home/hydra/.cache"} <= writable


def test_settings_are_valid(isvc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from service.settings import Settings

    for key in list(os.environ):
        if key.startswith("HYDRA_"):
            monkeypatch.delenv(key)
    for e in predictor_container(isvc)["env"]:
        if e["name"].startswith("HYDRA_"):
            monkeypatch.setenv(e["name"], e.get("value", "4" if "resourceFieldRef" in e.get("valueFrom", {}) else "k"))
    try:
        settings = Settings(_env_file=None)
    except ValidationError as e:  # only the artifact paths, which exist in the pod, may be refused here
        assert all(err["loc"] and err["loc"][0] == "artifacts" for err in e.errors()), e
        return
    assert settings.log_format == "json" and settings.device == "cpu" and settings.api_key is not None
