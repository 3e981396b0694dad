"""deploy/kubernetes: every manifest valid for the Kubernetes API, and its numbers eop's.

The schemas come bundled with kubernetes-validate (no network, no cluster).
Beyond the schema: the termination grace covers eop's stop deadline, the probes
ask paths the health endpoint serves on the port it listens on, credentials
come from the Secret, and compose.yaml agrees with the same rules.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from eop import cli
from eop.observe import health
from eop.runtime import shutdown
from eop.settings import SECRET_FIELDS, Settings

from .test_health import get

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _resource(kind: str, name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for doc in _load(path):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name} in {KUBERNETES}")


def _container(kind: str, name: str) -> dict[str, Any]:
    [container] = _resource(kind, name)["spec"]["template"]["spec"]["containers"]
    return container


def _settings() -> Settings:
    """The workers' settings: the ConfigMap over eop's defaults (and a pod IP)."""
    data = _resource("ConfigMap", "eop-settings")["data"]
    return Settings.from_env({**data, "EOP_METRICS_HOST": "10.0.0.7"})


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_is_valid_for_the_kubernetes_api(path: Path) -> None:
    """Strict: an unknown or misspelt field fails, not only a wrong type."""
    version = kubernetes_validate.latest_version()
    for doc in _load(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_misspelt_field() -> None:
    """The check above can fail: a probe under a misspelt key is refused."""
    doc = _load(KUBERNETES / "worker-deployment.yaml")[0]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe_"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_kustomization_lists_every_manifest_but_the_secret_example() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in MANIFESTS} - {"secret.example.yaml"}


def test_the_configmap_holds_valid_settings_and_no_secret() -> None:
    """Every EOP_ value parses and validates as eop would read it; none is a credential."""
    data = _resource("ConfigMap", "eop-settings")["data"]
    assert all(key.startswith("EOP_") for key in data)
    settings = _settings()
    assert settings.processes == 1
    assert settings.metrics_port > 0
    secret_vars = {f"EOP_{name.upper()}" for name in SECRET_FIELDS} | {"EOP_DATABASE_URL"}
    assert not secret_vars & set(data)


def test_the_termination_grace_covers_the_workers_stop_deadline() -> None:
    """SIGKILL comes after terminationGracePeriodSeconds: it must not come before eop's
    own bound on a stop (grace, acks, closing) plus the pull request under way."""
    spec = _resource("Deployment", "eop-worker")["spec"]["template"]["spec"]
    settings = _settings()
    needed = shutdown.deadline_s(settings) + settings.fetch_timeout_s
    assert spec["terminationGracePeriodSeconds"] > needed
    # The manifests keep eop's defaults, so the sum written beside the grace and in
    # docs/kubernetes.md is eop's own: a changed default shows up here.
    defaults = Settings()
    for name in ("shutdown_grace_s", "ack_give_up_s", "fetch_timeout_s"):
        assert getattr(settings, name) == getattr(defaults, name), name
    assert shutdown.STOP_MARGIN_S == 5
    text = (KUBERNETES / "worker-deployment.yaml").read_text()
    assert f"< {spec['terminationGracePeriodSeconds']}" in text
    assert f"= {needed:g}" in text
    assert f"= {needed:g} " in (ROOT / "docs" / "kubernetes.md").read_text()


async def test_the_probes_ask_paths_the_health_endpoint_serves_on_its_port() -> None:
    """The probe ports name the container port that EOP_METRICS_PORT opens; each probe
    path is answered by a real endpoint (200, or 503 for not ready), never 404."""
    container = _container("Deployment", "eop-worker")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    settings = _settings()
    probes = [container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")]
    for probe in probes:
        assert ports[probe["httpGet"]["port"]] == settings.metrics_port
    assert probes[1]["httpGet"]["path"] == "/healthz"
    assert probes[2]["httpGet"]["path"] == "/readyz"

    async def ping() -> None:
        return None

    readiness = health.Readiness(
        bound=lambda: False, draining=lambda: False, nats_connected=lambda: True, ping=ping
    )
    endpoints = health.Endpoints(host="127.0.0.1", port=0, registry=None, readiness=readiness)
    await endpoints.start()
    try:
        answers = {
            p["httpGet"]["path"]: (await get(endpoints.port, p["httpGet"]["path"]))[0]
            for p in probes
        }
    finally:
        await endpoints.close()
    assert answers == {"/healthz": 200, "/readyz": 503}  # no subscription bound yet


def test_the_metrics_endpoint_listens_on_the_pod_ip_not_everywhere() -> None:
    env = {e["name"]: e for e in _container("Deployment", "eop-worker")["env"]}
    assert env["EOP_METRICS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert Settings().metrics_host == "127.0.0.1"  # off the pod, the default stays local


@pytest.mark.parametrize(
    ("kind", "name"), [("Deployment", "eop-worker"), ("Job", "eop-db-upgrade")]
)
def test_credentials_come_from_the_secret_and_the_pods_run_as_the_images_user(
    kind: str, name: str
) -> None:
    template = _resource(kind, name)["spec"]["template"]["spec"]
    container = _container(kind, name)
    env = {e["name"]: e for e in container["env"]}
    ref = env["EOP_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "eop-credentials"
    assert "value" not in env["EOP_DATABASE_URL"]
    uid = int(re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]  # the Dockerfile names it
    assert template["securityContext"]["runAsNonRoot"] is True
    assert template["securityContext"]["runAsUser"] == uid
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]["memory"]


def test_the_job_and_the_deployment_run_commands_eop_has() -> None:
    parser = cli.build_parser()
    job = _container("Job", "eop-db-upgrade")["args"]
    assert job == ["db", "upgrade"]
    parser.parse_args(job)
    worker = _container("Deployment", "eop-worker")["args"]
    assert worker[0] == "worker"
    parser.parse_args(worker)


def test_the_disruption_budget_selects_the_workers() -> None:
    pdb = _resource("PodDisruptionBudget", "eop-worker")["spec"]
    labels = _resource("Deployment", "eop-worker")["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] == 1


def test_compose_serves_health_where_its_healthcheck_asks_and_waits_out_the_stop() -> None:
    """compose.yaml opts out of the local-only default (another container must reach the
    endpoint) and its stop_grace_period covers the same deadline."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    worker = compose["services"]["worker"]
    env = worker["environment"]
    settings = Settings.from_env({k: str(v) for k, v in env.items() if k != "EOP_DATABASE_URL"})
    assert settings.metrics_host == "0.0.0.0"
    assert f":{settings.metrics_port}/readyz" in " ".join(worker["healthcheck"]["test"])
    grace_s = int(worker["stop_grace_period"].rstrip("s"))
    assert grace_s > shutdown.deadline_s(settings) + settings.fetch_timeout_s
