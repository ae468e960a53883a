"""Every kustomization under deploy/ renders with the real kustomize and is valid Kubernetes.

Core kinds are validated offline against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
unknown fields fail) for the oldest and newest Kubernetes we support; the Prometheus Operator CRDs
(ServiceMonitor, PrometheusRule) against the part of their CRD schema that we use. Then the
deployment's own rules: probes, security, resources, selectors and references that must agree.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.helpers import (
    DEPLOY,
    OVERLAYS,
    ROOT,
    by_kind,
    container,
    kustomize,
    kustomize_with_component,
    one,
    parse_dockerfile,
)

K8S_VERSIONS = ("1.30.0", "1.37.0")  # deploy/README.md: Kubernetes 1.30 or newer
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
KINDS = {
    "ServiceAccount",
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "NetworkPolicy",
    "ServiceMonitor",
    "PrometheusRule",
}
DIGEST = re.compile(r"[a-z0-9.-]+(:\d+)?/[a-z0-9./_-]+@sha256:[0-9a-f]{64}")


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(DEPLOY / overlay))


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def docs(overlay: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_render(overlay)))


def k8s_validate(doc: dict[str, Any], version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    kv.validate(doc, version, strict=True)


# ------------------------------------------------------------------------------------------------ schemas


def test_renders_every_resource(docs: list[dict[str, Any]]) -> None:
    assert {d["kind"] for d in docs} == KINDS
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "duplicate resources"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_resources_match_kubernetes_schemas(docs: list[dict[str, Any]], version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {path}: {e.message}"
            )


@pytest.mark.parametrize(
    ("mutate", "what"),
    [
        (lambda d: container(d).update(livenesProbe={"httpGet": {"path": "/healthz", "port": "http"}}), "typo"),
        (lambda d: container(d)["ports"][0].update(containerPort="8000"), "string port"),
        (lambda d: container(d)["resources"]["limits"].update(cpu=[2]), "bad quantity"),
        (lambda d: d["spec"].pop("selector"), "missing selector"),
    ],
)
def test_schema_validation_catches_mistakes(mutate: Any, what: str) -> None:
    """The validator is not a no-op: each of these broken Deployments is rejected."""
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    deployment = copy.deepcopy(one(list(_render("base")), "Deployment"))
    k8s_validate(deployment, K8S_VERSIONS[-1])
    mutate(deployment)
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSIONS[-1], strict=True)


# The parts of the Prometheus Operator CRD schemas (monitoring.coreos.com/v1) that these manifests use;
# unknown fields are refused as the API server's structural schema would prune or refuse them.
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array"},
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _crd_schema(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Schema of a ``monitoring.coreos.com/v1`` resource of ``kind`` whose ``spec`` follows ``spec``."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


_SERVICE_MONITOR_SPEC = {
    "type": "object",
    "required": ["selector", "endpoints"],
    "additionalProperties": False,
    "properties": {
        "selector": _LABEL_SELECTOR,
        "namespaceSelector": {"type": "object"},
        "jobLabel": {"type": "string"},
        "targetLabels": {"type": "array", "items": {"type": "string"}},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "endpoints": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "port": {"type": "string"},
                    "targetPort": {"type": ["string", "integer"]},
                    "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]},
                    "interval": _DURATION,
                    "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array"},
                    "metricRelabelings": {"type": "array"},
                    "authorization": {"type": "object"},
                    "tlsConfig": {"type": "object"},
                    "params": {"type": "object"},
                },
            },
        },
    },
}
_PROMETHEUS_RULE_SPEC = {
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": _DURATION,
                    "rules": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["expr"],
                            "additionalProperties": False,
                            "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                            "properties": {
                                "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
                                "expr": {"type": ["string", "integer"]},
                                "for": _DURATION,
                                "keep_firing_for": _DURATION,
                                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                "annotations": {
                                    "type": "object",
                                    "additionalProperties": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        }
    },
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _crd_schema("ServiceMonitor", _SERVICE_MONITOR_SPEC),
    "PrometheusRule": _crd_schema("PrometheusRule", _PROMETHEUS_RULE_SPEC),
}


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate (dev extra)")
    validator = jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]])
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_prometheus_operator_resources_are_well_formed(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            assert not _crd_errors(doc), f"{doc['kind']}: {_crd_errors(doc)}"
    # Alerts without `for` fire on a single bad scrape; scrapeTimeout must fit inside the interval.
    for group in one(docs, "PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert "for" in rule and rule["labels"].get("severity") in ("warning", "critical"), rule["alert"]
    for ep in one(docs, "ServiceMonitor")["spec"]["endpoints"]:
        assert _seconds(ep["scrapeTimeout"]) <= _seconds(ep["interval"])


def test_crd_structure_check_catches_mistakes() -> None:
    docs = list(_render("base"))
    sm = copy.deepcopy(one(docs, "ServiceMonitor"))
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    assert _crd_errors(sm)
    rule = copy.deepcopy(one(docs, "PrometheusRule"))
    del rule["spec"]["groups"][0]["rules"][1]["expr"]
    assert _crd_errors(rule)
    rule = copy.deepcopy(one(docs, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][1]["for"] = "10 minutes"
    assert _crd_errors(rule)


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d)", duration))


# --------------------------------------------------------------------------------------- the Deployment


def _quantity(value: str | int) -> float:
    """Kubernetes quantity -> number (cores for CPU, bytes for memory)."""
    text = str(value)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


@pytest.mark.parametrize(("text", "value"), [("500m", 0.5), ("2", 2.0), ("64Mi", 64 * 2**20), ("4Gi", 4 * 2**30)])
def test_quantity(text: str, value: float) -> None:
    assert _quantity(text) == value


def _all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def test_pod_runs_non_root_with_a_read_only_root(docs: list[dict[str, Any]]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
    # The same numeric user as the image's USER, so files it owns (/artifacts, ~/.cache) line up.
    df = parse_dockerfile(ROOT / "Dockerfile")
    (user,) = df.stage("runtime").find("USER")
    uid, _, gid = user.args[0].partition(":")
    assert (sc["runAsUser"], sc["runAsGroup"]) == (int(uid), int(gid))
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    for c in _all_containers(pod):
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False, c["name"]
        assert csc["readOnlyRootFilesystem"] is True, c["name"]
        assert csc["capabilities"]["drop"] == ["ALL"] and not csc.get("privileged", False), c["name"]


def test_every_writable_path_is_a_volume(docs: list[dict[str, Any]]) -> None:
    """Read-only root: /tmp and every cache folder the image points libraries at are emptyDirs."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    c = container(one(docs, "Deployment"))
    writable = [m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty_dirs and not m.get("readOnly")]
    env = parse_dockerfile(ROOT / "Dockerfile").env(parse_dockerfile(ROOT / "Dockerfile").stage("runtime"))
    cache_vars = ["XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME", "TRITON_CACHE_DIR", "MPLCONFIGDIR"]
    for path in ["/tmp"] + [env[v] for v in cache_vars]:
        assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), f"{path} is not writable"
    assert all(v["emptyDir"].get("sizeLimit") for v in pod["volumes"] if "emptyDir" in v)


def test_probes(docs: list[dict[str, Any]], overlay: str) -> None:
    c = container(one(docs, "Deployment"))
    port_names = {p["name"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Started = loaded and warmed: the startup probe waits on readiness, with a budget for warm-up.
    assert c["startupProbe"]["httpGet"]["path"] == "/readyz"
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= (600 if overlay.endswith("gpu") else 300), budget
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in port_names, probe
        assert c[probe]["timeoutSeconds"] < c[probe]["periodSeconds"], probe
    assert c["livenessProbe"]["failureThreshold"] >= 3, "one slow answer under load must not restart the pod"


def test_explicit_requests_and_limits(docs: list[dict[str, Any]], overlay: str) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    for c in _all_containers(pod):
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        for res in ("cpu", "memory"):
            assert _quantity(req[res]) <= _quantity(lim[res]), (c["name"], res)
    main = container(one(docs, "Deployment"))["resources"]
    gpu = overlay.endswith("gpu")
    assert ("nvidia.com/gpu" in main["limits"]) is gpu
    if gpu:
        assert main["limits"]["nvidia.com/gpu"] == main["requests"]["nvidia.com/gpu"] == "1"
        tolerations = pod["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        # on GPU nodes only, with the NVIDIA container runtime
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and pod["runtimeClassName"] == "nvidia"
    else:
        assert "nodeSelector" not in pod and "runtimeClassName" not in pod and "tolerations" not in pod
    if overlay.endswith("cpu"):  # Guaranteed QoS on CPU
        assert main["requests"] == main["limits"]
    env = {e["name"]: e for e in container(one(docs, "Deployment"))["env"]}
    for threads in ("HYDRA_THREADS", "OMP_NUM_THREADS"):  # as many threads as the CPU limit, not the node's cores
        assert env[threads]["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"


def test_service_monitoring_and_selectors(docs: list[dict[str, Any]]) -> None:
    deployment = one(docs, "Deployment")
    template = deployment["spec"]["template"]
    pod_labels = template["metadata"]["labels"]
    c = container(deployment)
    http = {p["name"]: p["containerPort"] for p in c["ports"]}
    service = one(docs, "Service")

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(service["spec"]["selector"], pod_labels)
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in http, port
    sm = one(docs, "ServiceMonitor")
    assert selects(sm["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in service_ports and ep["path"] == "/metrics"
    ann = template["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) in http.values()
    spread = template["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
    assert selects(spread, pod_labels)


def test_autoscaling_and_disruption_budget(docs: list[dict[str, Any]], overlay: str) -> None:
    deployment = one(docs, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = one(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    if not overlay.endswith("gpu"):
        assert hpa["spec"]["minReplicas"] >= 2, "one replica left during a drain or rollout"
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb.get("maxUnavailable") == 1 and "minAvailable" not in pdb
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    if overlay.endswith("gpu"):
        assert strategy == {"maxSurge": 0, "maxUnavailable": 1}, "a rollout must not need a spare GPU"
    else:
        assert strategy == {"maxSurge": 1, "maxUnavailable": 0}


def test_configuration_and_secret_references(docs: list[dict[str, Any]], overlay: str) -> None:
    c = container(one(docs, "Deployment"))
    (cm,) = by_kind(docs, "ConfigMap")
    assert [e["configMapRef"]["name"] for e in c["envFrom"]] == [cm["metadata"]["name"]]
    assert re.fullmatch(r"hydra-serve-[a-z0-9]{10}", cm["metadata"]["name"]), "content hash rolls pods on change"
    env = {e["name"]: e for e in c["env"]}
    ref = env["HYDRA_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "hydra-serve-api-key", "key": "api-key"}
    assert not by_kind(docs, "Secret"), "the API key is created in the cluster, never committed"
    assert not any("KEY" in k or "TOKEN" in k for k in cm["data"])
    expected_device = {"base": "auto", "overlays/cpu": "cpu", "overlays/gpu": "cuda"}[overlay]
    assert cm["data"]["HYDRA_DEVICE"] == expected_device
    assert cm["data"]["HYDRA_HOST"] == "0.0.0.0"


def test_artifacts_volume(docs: list[dict[str, Any]], overlay: str) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (init_mount,) = init["volumeMounts"]
    c = container(one(docs, "Deployment"))
    mount = next(m for m in c["volumeMounts"] if m["name"] == init_mount["name"])
    assert mount["readOnly"] is True
    assert init_mount["mountPath"] in " ".join(init["command"]), "the init container copies into its volume"
    (cm,) = by_kind(docs, "ConfigMap")
    for path in cm["data"]["HYDRA_ARTIFACTS"].split(","):
        assert path.startswith(mount["mountPath"].rstrip("/") + "/"), path
    images = [x["image"] for x in _all_containers(pod)]
    if overlay != "base":
        # registry and digest: a tag can be moved, and IfNotPresent would keep serving whatever a node has cached
        assert all(DIGEST.fullmatch(image) for image in images), f"overlay pins the images by digest: {images}"
    for c in _all_containers(pod):
        assert c["imagePullPolicy"] == "IfNotPresent" and c["image"] in images


def test_network_policy_opens_the_serving_port_only(docs: list[dict[str, Any]]) -> None:
    policy = one(docs, "NetworkPolicy")["spec"]
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}] and "http" in ports
    # the metrics Prometheus scrapes and the probes are served on that same port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    sm = one(docs, "ServiceMonitor")
    service_ports = {p["name"]: p["targetPort"] for p in one(docs, "Service")["spec"]["ports"]}
    assert all(service_ports[ep["port"]] == "http" for ep in sm["spec"]["endpoints"])


def test_pvc_component(tmp_path: Path) -> None:
    """The optional component swaps the init container for a ReadOnlyMany claim; the result still validates."""
    docs = kustomize_with_component(tmp_path, "components/artifacts-pvc")
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert not pod.get("initContainers")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "artifacts"]
    assert volume == {
        "name": "artifacts",
        "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"], "readOnly": True},
    }
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRDS:
            k8s_validate(doc, K8S_VERSIONS[-1])
