"""The same-node overlay (deploy/overlays/same-node): each pod holds a prefill and a decode container
that share a DRA claim of two GPUs, so that UCX can use cuda_ipc between them. Read as the API
server and the daemons' own settings loaders see it: the claim, the devices, the pod-local prefill
target, ports and probes per container, and the prefill container kept equal to the base's."""

from __future__ import annotations

import pytest

from kpool_pd.runtime import MODEL_OPTIONS
from kpool_pd.runtime.fabric_check import Fabric
from tests.support import deploy_manifests as dm
from tests.support.deploy_daemons import daemon_settings, local_pod, token_secret

DAEMON_PORTS = ("port", "metrics_port", "health_port")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    objects = dm.render(dm.SAME_NODE)
    (workload,) = dm.workloads(objects)
    root = tmp_path_factory.mktemp("same-node")
    settings = {name: daemon_settings(objects, workload, root / name, container=name)
                for name in ("prefill", "decode")}
    return objects, workload, settings, root


def test_one_pod_runs_both_daemons_on_the_two_gpus_of_one_claim(pair):
    objects, workload, settings, _ = pair
    assert {name: role for name, (role, _) in settings.items()} == {"prefill": "prefill", "decode": "decode"}
    spec = workload["spec"]["template"]["spec"]
    (claim,) = spec["resourceClaims"]
    template = dm.find(objects, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["allocationMode"] == "ExactCount" and request["exactly"]["count"] == 2
    for container in spec["containers"]:
        assert container["resources"]["claims"] == [{"name": claim["name"]}], container["name"]
        extended = {k for part in ("requests", "limits") for k in container["resources"].get(part, {}) if "/" in k}
        assert not extended, f"{container['name']}: the GPUs come from the claim, not {extended}"
    devices = {name: s["device"] for name, (_, s) in settings.items()}
    assert devices == {"prefill": "cuda:0", "decode": "cuda:1"}
    assert all(s["fabric"] is Fabric.GPU and s["transports"] == "ucx,grpc" for _, s in settings.values())
    for option in MODEL_OPTIONS:
        assert settings["prefill"][1][option.key] == settings["decode"][1][option.key], option.name


def test_the_decode_container_uses_its_own_pods_prefill_container(pair):
    objects, workload, settings, root = pair
    prefill, decode = settings["prefill"][1], settings["decode"][1]
    assert decode["prefill"] == f"127.0.0.1:{prefill['port']}"
    containers = {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}
    assert prefill["port"] in {p["containerPort"] for p in containers["prefill"]["ports"]}
    assert prefill["host"] == "0.0.0.0"  # reachable on the pod's loopback
    engines = {name: local_pod(objects, workload, root / "env", container=name,
                               extra_objects=[token_secret("t" * 32, "p" * 32)]).env["KPOOLPD_ENGINE_ID"]
               for name in containers}
    assert engines == {"decode": "kpool-pd-decode-local", "prefill": "kpool-pd-decode-local-prefill"}


def test_ports_and_probes_are_each_containers_own(pair):
    _, workload, settings, _ = pair
    containers = {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}
    names = [p["name"] for c in containers.values() for p in c["ports"]]
    numbers = [p["containerPort"] for c in containers.values() for p in c["ports"]]
    assert len(set(names)) == len(names) and len(set(numbers)) == len(numbers), "a pod's ports are unique"
    for name, (_, s) in settings.items():
        container = containers[name]
        assert {p["containerPort"] for p in container["ports"]} == {s[k] for k in DAEMON_PORTS}, name
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[kind]["grpc"]["port"] == s["health_port"], f"{name}.{kind}"
    # Services reach the decode container by its port names; the shared /dev/shm is one memory volume.
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    shm = {m["name"] for c in containers.values() for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert len(shm) == 1 and volumes[shm.pop()]["emptyDir"]["medium"] == "Memory"
    tmp = [m["name"] for c in containers.values() for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(set(tmp)) == 2, "each container has its own /tmp"


def test_every_configmap_key_is_read_except_the_shared_device(pair):
    objects, workload, _, _ = pair
    (configmap,) = dm.of_kind(objects, "ConfigMap")
    read = {item["key"] for v in workload["spec"]["template"]["spec"]["volumes"] if "configMap" in v
            for item in v["configMap"]["items"]}
    for container in dm.containers(workload):
        read |= {v["valueFrom"]["configMapKeyRef"]["key"] for v in container.get("env", [])
                 if "configMapKeyRef" in v.get("valueFrom", {})}
    # The two containers need different devices (cuda:0, cuda:1): each names its own.
    assert set(configmap["data"]) - read == {"device"} and read <= set(configmap["data"])


def _comparable(container: dict) -> dict:
    """What must stay the same between the base's prefill container and the pair's."""
    port_names = {p["containerPort"]: p["name"] for p in container["ports"]}
    env = {v["name"]: v for v in container.get("env", []) if v["name"] not in ("KPOOLPD_DEVICE", "KPOOLPD_ENGINE_ID",
                                                                                "POD_NAME")}
    resources = {part: {k: v for k, v in values.items() if "/" not in k}
                 for part, values in container["resources"].items() if part != "claims"}
    return {"image": container["image"], "command": container["command"], "args": container["args"],
            "ports": sorted(port_names), "env": env, "resources": resources,
            "probes": [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")],
            "lifecycle": container["lifecycle"], "securityContext": container["securityContext"],
            "mounts": sorted(m["mountPath"] for m in container["volumeMounts"])}


def test_the_prefill_container_is_the_gpu_overlays_prefill_container(pair):
    _, workload, _, _ = pair
    gpu = dm.find(dm.render(dm.Variant("gpu")), "Deployment", "kpool-pd-prefill")
    (base,) = gpu["spec"]["template"]["spec"]["containers"]
    (mine,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "prefill"]
    assert _comparable(mine) == _comparable(base)


def test_the_pod_monitor_scrapes_both_containers(pair):
    _, _, settings, _ = pair
    objects = dm.render(dm.Variant("same-node", ("monitoring",)))
    (monitor,) = dm.of_kind(objects, "PodMonitor")
    (workload,) = dm.workloads(objects)
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for container in dm.containers(workload):
        port = settings[container["name"]][1]["metrics_port"]
        metrics = [p["name"] for p in container["ports"] if p["containerPort"] == port]
        assert len(metrics) == 1 and metrics[0] in scraped, container["name"]
