"""The PostgreSQL deployment of the store (deploy/postgres, deploy/components/store-postgres) renders with the real
kustomize, is valid Kubernetes, and agrees with the server: the setting names, the Secret references, the labels
the NetworkPolicy admits, and no secret committed."""

from __future__ import annotations

import pytest

from service.settings import Settings
from tests.deploy.helpers import DEPLOY, by_kind, container, kustomize, kustomize_with_component, one

K8S = "1.37.0"


def _valid(doc: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate==1.37.0 (dev extra)")
    kv.validate(doc, K8S, strict=True)


def test_the_base_keeps_the_store_off():
    """Per-pod stores would split the answers between replicas: the base turns the store off."""
    (cm,) = by_kind(kustomize(DEPLOY / "overlays" / "cpu"), "ConfigMap")
    assert cm["data"]["HYDRA_STORE"] == "off" and Settings(store=cm["data"]["HYDRA_STORE"]).store is False


def test_the_component_points_every_replica_at_one_database(tmp_path):
    docs = kustomize_with_component(tmp_path, "components/store-postgres")
    (cm,) = by_kind(docs, "ConfigMap")
    assert cm["data"]["HYDRA_STORE"] == "on"
    env = {e["name"]: e for e in container(one(docs, "Deployment"))["env"]}
    assert env["HYDRA_STORE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "hydra-serve-store", "key": "url"}
    assert not by_kind(docs, "Secret"), "the URL holds a password: created in the cluster, never committed"
    names = {f"HYDRA_{n.upper()}" for n in Settings.model_fields}
    assert {"HYDRA_STORE", "HYDRA_STORE_URL"} <= names
    for doc in docs:
        if doc["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            _valid(doc)


def test_the_postgres_statefulset(tmp_path):
    docs = kustomize(DEPLOY / "postgres")
    assert {d["kind"] for d in docs} == {"StatefulSet", "Service", "NetworkPolicy"}
    for doc in docs:
        _valid(doc)
    sts = one(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "hydra-serve-postgres", "key": "password"}
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["resources"]["requests"] and c["resources"]["limits"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    data = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert env["PGDATA"]["value"].startswith(data["mountPath"] + "/")
    service = one(docs, "Service")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == "hydra-serve-postgres"
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert "@sha256:" in c["image"], "pinned by digest, as the server's images"
    # only the server's pods are admitted, and the server's pods carry the label the policy names
    (rule,) = one(docs, "NetworkPolicy")["spec"]["ingress"]
    (peer,) = rule["from"]
    server = one(kustomize(DEPLOY / "overlays" / "cpu"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= server.items()
    assert rule["ports"] == [{"port": "postgres", "protocol": "TCP"}]
