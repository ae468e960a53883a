"""The deployment and the server agree: every HYDRA_* name is a real setting, values pass its validation,
ports and probe paths are the server's own.

Reads `service.settings.Settings` (pydantic-settings, prefix HYDRA_) and the app's routes; skips with a
reason only while those modules do not exist yet.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import pytest

from tests.deploy.helpers import DEPLOY, OVERLAYS, ROOT, container, kustomize, one, only_hydra_env, parse_dockerfile

NOT_SETTINGS = {"HYDRA_DATA_DIR"}  # used by the offline builder's data scripts, not by the server


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(DEPLOY / overlay))


@pytest.fixture(scope="module")
def settings_cls() -> type:
    try:
        from service.settings import Settings
    except ImportError as e:
        pytest.skip(f"service.settings.Settings not importable yet ({e}); the server issue adds it")
    return Settings


def _env_names(settings_cls: type) -> dict[str, str]:
    """Environment variable name -> field name, as pydantic-settings reads them."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    names = {}
    for field_name, info in settings_cls.model_fields.items():
        alias = info.validation_alias if isinstance(info.validation_alias, str) else None
        names[(alias or f"{prefix}{field_name}").upper()] = field_name
    return names


def _runtime_env() -> dict[str, str]:
    df = parse_dockerfile(ROOT / "Dockerfile")
    return df.env(df.stage("runtime"))


def _used_names() -> dict[str, set[str]]:
    """Every HYDRA_* variable the deployment sets or documents -> where."""
    used: dict[str, set[str]] = {}
    for overlay in OVERLAYS:
        for doc in _render(overlay):
            if doc["kind"] == "ConfigMap":
                for key in doc["data"]:
                    used.setdefault(key, set()).add(f"{overlay} ConfigMap")
            if doc["kind"] == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    for e in c.get("env", []):
                        used.setdefault(e["name"], set()).add(f"{overlay} env")
    for c in one(list(_render("kserve")), "InferenceService")["spec"]["predictor"]["containers"]:
        for e in c.get("env", []):
            used.setdefault(e["name"], set()).add("kserve InferenceService env")
    for key in _runtime_env():
        used.setdefault(key, set()).add("Dockerfile ENV")
    for text, where in (((DEPLOY / "README.md").read_text(), "deploy/README.md"),):
        for key in re.findall(r"\bHYDRA_[A-Z_]+[A-Z]\b", text):
            used.setdefault(key, set()).add(where)
    return {k: v for k, v in used.items() if k.startswith("HYDRA_")}


def _container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's `env` as the kubelet resolves it (secrets stand in as a test value)."""
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            out[e["name"]] = "test-value-from-the-secret"
        elif "resourceFieldRef" in e["valueFrom"]:
            ref = e["valueFrom"]["resourceFieldRef"]
            limit = c["resources"]["limits"][ref["resource"].split(".", 1)[1]]
            cores = float(limit[:-1]) / 1000 if str(limit).endswith("m") else float(limit)
            out[e["name"]] = str(math.ceil(cores / float(ref.get("divisor", "1"))))
    return out


def test_settings_use_the_hydra_prefix(settings_cls: type) -> None:
    assert settings_cls.model_config.get("env_prefix", "").upper() == "HYDRA_"
    for field in ("artifacts", "host", "port", "device", "backend", "precision", "api_key"):
        assert field in settings_cls.model_fields, field


def test_every_hydra_variable_is_a_setting(settings_cls: type) -> None:
    known = _env_names(settings_cls)
    used = _used_names()
    assert {"HYDRA_ARTIFACTS", "HYDRA_HOST", "HYDRA_PORT", "HYDRA_API_KEY", "HYDRA_DEVICE"} <= set(used)
    unknown = {k: sorted(v) for k, v in used.items() if k not in known and k not in NOT_SETTINGS}
    assert not unknown, f"not fields of service.settings.Settings: {unknown}; fields: {sorted(known)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmap_values_pass_settings_validation(
    settings_cls: type, overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod's environment (ConfigMap + Secret + image ENV) is accepted by Settings, as at start-up.

    Only the artifact paths may be refused here: /artifacts/... exists in the pod, not on this machine.
    """
    from pydantic import ValidationError

    docs = list(_render(overlay))
    env = {k: v for k, v in _runtime_env().items() if k.startswith("HYDRA_")}
    env.update(one(docs, "ConfigMap")["data"])
    env.update(_container_env(container(one(docs, "Deployment"))))
    only_hydra_env(monkeypatch, env)
    try:
        settings = settings_cls(_env_file=None)
    except ValidationError as e:
        others = [err for err in e.errors() if not err["loc"] or err["loc"][0] != "artifacts"]
        assert not others, f"{overlay}: Settings refuses the deployment's configuration: {others}"
        return
    assert str(settings.port) == env["HYDRA_PORT"] and settings.host == "0.0.0.0"
    assert settings.device == env["HYDRA_DEVICE"]
    assert settings.api_key is not None, "HYDRA_API_KEY from the Secret turns authentication on"


def test_ports_agree_with_the_server_default(settings_cls: type) -> None:
    default_port = settings_cls.model_fields["port"].default
    df = parse_dockerfile(ROOT / "Dockerfile")
    (expose,) = df.stage("runtime").find("EXPOSE")
    assert str(default_port) == _runtime_env()["HYDRA_PORT"] == expose.args[0]
    for overlay in OVERLAYS:
        docs = list(_render(overlay))
        c = container(one(docs, "Deployment"))
        (http,) = [p for p in c["ports"] if p["name"] == "http"]
        assert one(docs, "ConfigMap")["data"]["HYDRA_PORT"] == str(http["containerPort"]) == str(default_port)
        annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(default_port)


def test_probe_and_metrics_paths_are_server_routes() -> None:
    try:
        from service.entrypoints.app import app
    except ImportError as e:
        pytest.skip(f"service.entrypoints.app not importable yet ({e}); the server issue adds it")
    paths = {getattr(route, "path", None) for route in app.routes}
    docs = list(_render("base"))
    c = container(one(docs, "Deployment"))
    wanted = {c[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe")}
    wanted |= {ep["path"] for ep in one(docs, "ServiceMonitor")["spec"]["endpoints"]}
    assert wanted == {"/healthz", "/readyz", "/metrics"}
    # the endpoints the alerts filter on (deploy/base/prometheusrule.yaml) and KServe's probes
    wanted |= {"/predict", "/zero-shot", "/v2/models/{model_name}/infer", "/v2/health/ready", "/v2/health/live"}
    assert wanted <= paths, f"routes missing from service.main:app: {sorted(wanted - paths)}"


def test_grace_period_covers_the_servers_graceful_shutdown() -> None:
    """SIGTERM comes after preStop; the pod must outlive preStop + uvicorn's graceful timeout."""
    main = ROOT / "service" / "__main__.py"
    if not main.is_file():
        pytest.skip("service/entrypoints/cli.py not written yet (server issue)")
    found = re.search(r'"--graceful-timeout"[^)]*default=([\d.]+)', main.read_text())
    graceful = float(found.group(1)) if found else 0.0
    for overlay in OVERLAYS:
        pod = one(list(_render(overlay)), "Deployment")["spec"]["template"]["spec"]
        pre_stop = container(one(list(_render(overlay)), "Deployment"))["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + graceful + 5, overlay


def test_probe_paths_answer_without_the_api_key() -> None:
    """With HYDRA_API_KEY set (as the Deployment does), the kubelet's and Prometheus' requests carry no token:
    the probe and metrics paths must not answer 401, while the API does."""
    try:
        from fastapi.testclient import TestClient

        from service.entrypoints.app import create_app
        from service.settings import Settings
    except ImportError as e:
        pytest.skip(f"service.entrypoints.app not importable yet ({e}); the server issue adds it")
    client = TestClient(create_app(Settings(api_key="secret", artifacts=[])))  # no `with`: nothing is loaded
    c = container(one(list(_render("base")), "Deployment"))
    assert client.get(c["livenessProbe"]["httpGet"]["path"]).status_code == 200
    ready = client.get(c["readinessProbe"]["httpGet"]["path"])
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"  # not loaded, not 401
    assert client.get(c["startupProbe"]["httpGet"]["path"]).status_code == 503
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").status_code == 401
