"""The workloads of ``deploy/`` as the API server and the kubelet see them, beyond schema
validation: selectors, probes, extended resources, the ports each daemon listens on, Services
and the headless Service that decode pods resolve prefill pods through, and the pods' security
context."""

from __future__ import annotations

from tests import deploy_manifests as dm
from tests.deploy_daemons import EXTENDED_RESOURCES, all_settings, variants
from runtime import LIVENESS_SERVICE

DAEMON_PORTS = {"port": "grpc", "metrics_port": "metrics", "health_port": "health"}  # settings key -> port name
SERVICE_PORTS = {"grpc", "metrics"}  # what a Service exposes; probes reach the health port on the pod
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@variants
def test_selectors_match_template_labels(variant):
    objects = dm.render(variant)
    for workload in dm.workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]
        assert set(selector) == {"matchLabels"}, f"{workload['metadata']['name']}: use matchLabels only"
        assert dm.selects(selector["matchLabels"], labels), workload["metadata"]["name"]
        for spread in workload["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert dm.selects(spread["labelSelector"]["matchLabels"], labels)
    others = {w["metadata"]["name"]: w for w in dm.workloads(objects)}
    for obj in [*dm.of_kind(objects, "Service"), *dm.of_kind(objects, "PodDisruptionBudget")]:
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector) if obj["kind"] == "PodDisruptionBudget" else selector
        picked = [n for n, w in others.items() if dm.selects(selector, w["spec"]["template"]["metadata"]["labels"])]
        assert picked == [obj["metadata"]["name"]], f"{obj['kind']}/{obj['metadata']['name']} selects {picked}"


@variants
def test_each_container_has_three_grpc_probes_with_one_handler_each(variant):
    for workload in dm.workloads(dm.render(variant)):
        for container in dm.containers(workload):
            for kind in PROBES:
                assert kind in container, f"{container['name']}: no {kind}"
                assert dm.probe_handlers(container[kind]) == ["grpc"], f"{container['name']}.{kind}"
                # Readiness: grpc.health.v1's overall status (""), SERVING only while the node can take
                # requests. Startup and liveness: the liveness name, SERVING from warm-up to stop, so
                # that a node without a usable peer leaves the rotation without being restarted.
                expected = "" if kind == "readinessProbe" else LIVENESS_SERVICE
                assert container[kind]["grpc"].get("service", "") == expected, f"{container['name']}.{kind}"


@variants
def test_extended_resources_request_equals_limit(variant):
    expected = EXTENDED_RESOURCES.get(variant.overlay, set())
    for workload in dm.workloads(dm.render(variant)):
        for container in dm.containers(workload):
            requests = container["resources"]["requests"]
            limits = container["resources"]["limits"]
            assert {"cpu", "memory"} <= set(requests) and {"cpu", "memory"} <= set(limits), container["name"]
            extended = {k for k in {*requests, *limits} if "/" in k}
            assert extended == expected, container["name"]
            for name in extended:
                assert requests.get(name) == limits.get(name) == "1", f"{container['name']} {name}"


@variants
def test_every_port_the_daemons_listen_on_is_exposed_and_named(variant, tmp_path):
    objects = dm.render(variant)
    services = dm.of_kind(objects, "Service")
    for role, (workload, container, settings) in all_settings(variant, tmp_path).items():
        ports = {p["name"]: p for p in container["ports"]}
        assert len(ports) == len(container["ports"]), f"{role}: port names must be unique"
        for key, name in DAEMON_PORTS.items():
            assert settings[key] > 0, f"{role}: {key} is {settings[key]}: a fixed port is needed in a pod"
            assert name in ports and ports[name]["containerPort"] == settings[key], \
                f"{role} listens on {key}={settings[key]}; container ports: {container['ports']}"
            assert ports[name]["protocol"] == "TCP"
        assert {p["containerPort"] for p in container["ports"]} == {settings[k] for k in DAEMON_PORTS}, \
            f"{role}: a container port the daemon does not listen on"
        (service,) = [s for s in services if workload in dm.service_backends(objects, s)]
        assert {p["targetPort"] for p in service["spec"]["ports"]} == SERVICE_PORTS
        assert all(p.get("name") for p in service["spec"]["ports"])


@variants
def test_probe_ports_are_the_plaintext_health_port(variant, tmp_path):
    # The kubelet's gRPC probes speak no TLS: they ask the port that serves grpc.health.v1 alone.
    for role, (_, container, settings) in all_settings(variant, tmp_path).items():
        health_port = dm.container_port(container, "health")["containerPort"]
        for kind in PROBES:
            assert container[kind]["grpc"]["port"] == health_port == settings["health_port"], f"{role}.{kind}"


@variants
def test_service_target_ports_resolve_to_container_ports(variant):
    objects = dm.render(variant)
    for service in dm.of_kind(objects, "Service"):
        backends = dm.service_backends(objects, service)
        assert backends, f"Service {service['metadata']['name']} selects no workload"
        for port in service["spec"]["ports"]:
            for workload in backends:
                found = [dm.container_port(c, port["targetPort"]) for c in dm.containers(workload)]
                assert any(found), f"Service {service['metadata']['name']} targetPort {port['targetPort']}"


@variants
def test_statefulset_service_name_is_a_headless_service_selecting_it(variant):
    objects = dm.render(variant)
    for statefulset in dm.of_kind(objects, "StatefulSet"):
        service = dm.find(objects, "Service", statefulset["spec"]["serviceName"])
        assert service["spec"].get("clusterIP") == "None"
        assert not service["spec"].get("publishNotReadyAddresses", False), "unready prefill pods would be resolved"
        assert dm.service_backends(objects, service) == [statefulset]


@variants
def test_decode_workers_resolve_every_prefill_pod_through_the_headless_service(variant, tmp_path):
    objects = dm.render(variant)
    settings = all_settings(variant, tmp_path)
    prefill_workload, _, prefill = settings["prefill"]
    headless = dm.find(objects, "Service", prefill_workload["spec"]["serviceName"])
    service_port = [p["port"] for p in headless["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert settings["decode"][2]["prefill"] == f"dns:///{headless['metadata']['name']}:{service_port[0]}"
    assert service_port == [prefill["port"]]

@variants
def test_pods_run_unprivileged_with_a_memory_backed_dev_shm(variant):
    for workload in dm.workloads(dm.render(variant)):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in dm.containers(workload):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            added = set(context["capabilities"].get("add", []))
            assert added == ({"IPC_LOCK"} if variant.overlay == "rdma" else set()), added
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
            assert "emptyDir" in mounts["/tmp"], "a read-only root file system needs a writable /tmp"
