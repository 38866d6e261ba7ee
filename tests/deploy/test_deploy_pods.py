"""The workloads of ``deploy/`` as the API server and the kubelet see them, beyond schema
validation: selectors, probes and their timeouts, the preStop hook, extended resources, the ports
each daemon listens on, Services, the headless Service that decode pods resolve prefill pods
through and the one clients balance over decode pods with, rollouts that keep capacity, placement
(GPU product, CUDA driver, one zone or fabric domain), and the pods' security context."""

from __future__ import annotations

from kpool_pd.runtime import LIVENESS_SERVICE
from tests.support import deploy_image as di
from tests.support import deploy_manifests as dm
from tests.support.deploy_daemons import EXTENDED_RESOURCES, all_settings, variants

DAEMON_PORTS = {"port": "grpc", "metrics_port": "metrics", "health_port": "health"}  # settings key -> port name
SERVICE_PORTS = {"grpc", "metrics"}  # what a Service exposes; probes reach the health port on the pod
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
CUDA_MAJOR = int(di.stage(dm.DEPLOY / "Dockerfile.cuda", None).base.split(":")[1].split(".")[0])


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
        # Each selects the one workload it is named after (kpool-pd-decode-headless: kpool-pd-decode's pods).
        name = obj["metadata"]["name"]
        want = [n for n in others if name == n or name.startswith(n + "-")]
        assert len(want) == 1 and picked == want, f"{obj['kind']}/{obj['metadata']['name']} selects {picked}"


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
            for name in extended:  # one GPU a pod; a DCP decode pod one per rank
                want = "2" if variant.overlay == "dcp" and container["name"] == "decode" else "1"
                assert requests.get(name) == limits.get(name) == want, f"{container['name']} {name}"


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
        # The Service named after the workload exposes gRPC and metrics; another one (the decode pods'
        # headless Service, for client-side balancing) a part of them.
        (service,) = [s for s in services if s["metadata"]["name"] == workload["metadata"]["name"]]
        assert dm.service_backends(objects, service) == [workload]
        assert {p["targetPort"] for p in service["spec"]["ports"]} == SERVICE_PORTS
        for other in [s for s in services if workload in dm.service_backends(objects, s)]:
            assert all(p.get("name") for p in other["spec"]["ports"])
            assert {p["targetPort"] for p in other["spec"]["ports"]} <= SERVICE_PORTS


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
def test_decode_workers_resolve_every_prefill_pod_through_the_headless_service(variant, tmp_path):
    objects = dm.render(variant)
    settings = all_settings(variant, tmp_path)
    prefill_workload, _, prefill = settings["prefill"]
    target = settings["decode"][2]["prefill"]
    assert target.startswith("dns:///"), f"decode pods must resolve every prefill pod, not dial {target}"
    name, _, port = target.removeprefix("dns:///").rpartition(":")
    headless = dm.find(objects, "Service", name)
    assert dm.headless(headless)
    assert not headless["spec"].get("publishNotReadyAddresses", False), "unready prefill pods would be resolved"
    assert dm.service_backends(objects, headless) == [prefill_workload]
    service_port = [p["port"] for p in headless["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert service_port == [int(port)] == [prefill["port"]]


@variants
def test_clients_can_balance_over_decode_pods_through_a_headless_service(variant, tmp_path):
    # gRPC keeps one connection per target: through the ClusterIP a client's calls all go to one pod.
    objects = dm.render(variant)
    decode_workload, _, decode = all_settings(variant, tmp_path)["decode"]
    (balanced,) = [s for s in dm.of_kind(objects, "Service") if dm.headless(s)
                   and dm.service_backends(objects, s) == [decode_workload]]
    assert not balanced["spec"].get("publishNotReadyAddresses", False), "draining decode pods would be resolved"
    (grpc_port,) = [p for p in balanced["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert grpc_port["port"] == decode["port"] and grpc_port.get("appProtocol") == "grpc"


@variants
def test_rollouts_keep_capacity_and_the_prefill_pods_need_no_stable_identity(variant):
    # Prefill pods are a Deployment: a pod on a dead node is replaced without a force-delete, and
    # decode workers find the new one by the headless Service (nothing uses a stable pod name).
    objects = dm.render(variant)
    assert not dm.of_kind(objects, "StatefulSet")
    for workload in dm.workloads(objects):
        strategy = workload["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0 and strategy["rollingUpdate"]["maxSurge"] >= 1


@variants
def test_probes_have_timeouts_a_busy_node_can_meet(variant):
    for workload in dm.workloads(dm.render(variant)):
        for container in dm.containers(workload):
            for kind in PROBES:
                probe = container[kind]
                timeout = probe.get("timeoutSeconds", 1)  # the kubelet's default
                assert 2 <= timeout <= probe.get("periodSeconds", 10), f"{container['name']}.{kind}: {timeout} s"


@variants
def test_every_container_waits_in_pre_stop_before_its_drain(variant):
    # The kubelet runs preStop before SIGTERM: the pod leaves the Services' endpoints (and DNS) first.
    for workload in dm.workloads(dm.render(variant)):
        for container in dm.containers(workload):
            hook = container["lifecycle"]["preStop"]
            assert list(hook) == ["sleep"] and hook["sleep"]["seconds"] >= 3, container["name"]


# overlay -> the podAffinity topology key that keeps every kpool-pd pod in one domain
PLACEMENT_DOMAIN = {"gpu": "topology.kubernetes.io/zone", "rdma": "kpool-pd.io/fabric-domain",
                    "dcp": "topology.kubernetes.io/zone"}


@variants
def test_gpu_pods_need_one_gpu_product_a_cuda_13_driver_and_one_domain(variant):
    objects = dm.render(variant)
    templates = [w["spec"]["template"] for w in dm.workloads(objects)]
    for template in templates:
        affinity = template["spec"].get("affinity", {})
        if variant.overlay not in PLACEMENT_DOMAIN:
            assert not affinity, "the cpu overlay runs anywhere"
            continue
        (term,) = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        expressions = {e["key"]: e for e in term["matchExpressions"]}
        product = expressions["nvidia.com/gpu.product"]
        assert product["operator"] == "In" and len(product["values"]) == 1, "one GPU product throughout"
        driver = expressions["nvidia.com/cuda.runtime.major"]  # the newest CUDA the node's driver runs
        assert driver["operator"] == "Gt" and int(driver["values"][0]) + 1 == CUDA_MAJOR
        (domain,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert domain["topologyKey"] == PLACEMENT_DOMAIN[variant.overlay]
        # The term picks the pods of both roles, so each follows the first one into its domain.
        assert all(dm.selects(domain["labelSelector"]["matchLabels"], t["metadata"]["labels"]) for t in templates)


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
