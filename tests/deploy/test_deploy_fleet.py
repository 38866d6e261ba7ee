"""The fleet manifests: the ``fleet`` overlay (N prefill and M decode pods, each role a Deployment scaled on
its own, decode pods finding every ready prefill pod through its headless Service and choosing the least
loaded) and the ``router`` component (``kpool-pd router`` finding vLLM servers of each role through a
headless Service of its own, re-resolved while it runs), rendered by kustomize, validated against
Kubernetes' schemas and read by the daemons' and the router's own parsers."""

from __future__ import annotations

import re
import subprocess

import pytest
from packaging.requirements import Requirement

from kpool_pd.decode_worker.prefill_choice import PrefillPolicy
from kpool_pd.router.main import build_parser as router_parser
from kpool_pd.router.settings import settings_from_args
from tests.support import deploy_daemons as dd
from tests.support import deploy_image as di
from tests.support import deploy_manifests as dm

FLEET = dm.Variant("fleet")
FLEET_ROUTER = dm.Variant("fleet", ("router",))
FLEET_AUTOSCALED = dm.Variant("fleet", ("monitoring", "autoscaling"))
README = dm.REPO / "README.md"


def _dns_target(text: str) -> tuple[str, int]:
    match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", text)
    assert match, f"{text!r} is not dns:///NAME:PORT"
    return match.group(1), int(match.group(2))


@pytest.mark.parametrize("variant", [FLEET, FLEET_ROUTER, FLEET_AUTOSCALED], ids=lambda v: v.id)
def test_the_fleet_renders_and_passes_strict_schema_validation(variant, tmp_path):
    rendered = tmp_path / "fleet.yaml"
    rendered.write_text(dm.render_text(variant))
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(rendered)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    objects = dm.render(variant)
    checked = re.findall(r"passed for resource (\S+) against version", proc.stdout + proc.stderr)
    assert len(checked) == len([o for o in objects if o["kind"] not in dm.CUSTOM_KINDS])


def test_prefill_and_decode_are_separate_deployments_scaled_on_their_own():
    objects = dm.render(FLEET)
    prefill = dm.find(objects, "Deployment", "kpool-pd-prefill")
    decode = dm.find(objects, "Deployment", "kpool-pd-decode")
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (8, 4)
    for workload, other in ((prefill, decode), (decode, prefill)):  # neither's selector takes the other's pods
        assert not dm.selects(workload["spec"]["selector"]["matchLabels"], other["spec"]["template"]["metadata"]["labels"])
    budgets = {b["metadata"]["name"]: b for b in dm.of_kind(objects, "PodDisruptionBudget")}
    assert len(budgets) == 2  # one per role
    # With autoscaling, each role has a ScaledObject of its own, and the Deployments leave it the replicas.
    scaled = dm.render(FLEET_AUTOSCALED)
    targets = sorted(o["spec"]["scaleTargetRef"]["name"] for o in dm.of_kind(scaled, "ScaledObject"))
    assert targets == ["kpool-pd-decode", "kpool-pd-prefill"]
    assert all("replicas" not in w["spec"] for w in dm.workloads(scaled))


def test_decode_pods_find_every_ready_prefill_pod_and_choose_the_least_loaded(tmp_path):
    objects = dm.render(FLEET)
    decode = dm.find(objects, "Deployment", "kpool-pd-decode")
    role, settings = dd.daemon_settings(objects, decode, tmp_path)
    assert role == "decode"
    assert settings["prefill_policy"] is PrefillPolicy.LEAST_LOADED and settings["health_interval_s"] == 1.0
    name, port = _dns_target(settings["prefill"])
    service = dm.find(objects, "Service", name)
    assert dm.headless(service) and service["spec"]["publishNotReadyAddresses"] is False
    assert [w["metadata"]["name"] for w in dm.service_backends(objects, service)] == ["kpool-pd-prefill"]
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    prefill = dm.find(objects, "Deployment", "kpool-pd-prefill")
    assert dm.container_port(dm.containers(prefill)[0], service_port["targetPort"])["containerPort"] == port
    _, prefill_settings = dd.daemon_settings(objects, prefill, tmp_path)
    assert prefill_settings["port"] == port


def test_the_router_finds_vllm_servers_of_each_role_through_a_headless_service():
    objects = dm.render(FLEET_ROUTER)
    router = dm.find(objects, "Deployment", "kpool-pd-router")
    (container,) = dm.containers(router)
    assert container["command"] == ["kpool-pd", "router"]
    settings = settings_from_args(router_parser().parse_args(container["args"]))
    assert settings.listed("prefill") == settings.listed("decode") == ()
    for role in ("prefill", "decode"):
        (target,) = settings.discovered(role)
        name, port = _dns_target(target)
        service = dm.find(objects, "Service", name)
        assert dm.headless(service) and service["spec"]["publishNotReadyAddresses"] is False
        assert service["spec"]["selector"] == {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/component": role}
        assert [p["port"] for p in service["spec"]["ports"]] == [port]
        assert not dm.service_backends(objects, service)  # the vLLM servers are the user's, not kpool-pd's pods
    front = dm.find(objects, "Service", "kpool-pd-router")
    assert [w["metadata"]["name"] for w in dm.service_backends(objects, front)] == ["kpool-pd-router"]
    (front_port,) = front["spec"]["ports"]
    assert dm.container_port(container, front_port["targetPort"])["containerPort"] == settings.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert 0 < settings.discovery_s <= 10


def test_the_router_image_is_built_with_the_router_extra_and_its_packages_pinned():
    image = dm.find(dm.render(FLEET_ROUTER), "Deployment", "kpool-pd-router")["spec"]["template"]["spec"][
        "containers"][0]["image"]
    builds = re.findall(r"docker build -f (\S+) --build-arg EXTRAS=(\S+) -t (\S+) \.", README.read_text())
    assert [(f, extras) for f, extras, tag in builds if tag == image] == [("deploy/Dockerfile", "router")]
    pins = di.constraints(dm.DEPLOY / "constraints" / "cpu.txt")
    pyproject = __import__("tomllib").loads((dm.REPO / "pyproject.toml").read_text())
    for text in pyproject["project"]["optional-dependencies"]["router"]:
        requirement = Requirement(text)
        assert requirement.specifier.contains(pins[di.normalize(requirement.name)], prereleases=True)
