"""The Kubernetes manifests of ``deploy/`` held to the daemons.

Every variant (overlay, or overlay + component) renders with ``kubectl kustomize`` and every
object passes ``kubernetes-validate --strict`` for the pinned Kubernetes version; the checks
below catch what the API server or the kubelet would refuse and schema validation misses, and
read each container's flags, environment and config file through the daemons' own settings
loader, so a port or option the daemons do not have fails here. The last test starts the
daemons exactly as the cpu overlay describes them, on loopback, sends requests through the
decode Service's port and compares the results with the colocated run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.client import RequestFailed, generate_all, model_info
from model.colocated import make_prompts, run_colocated
from kpool_pd.certs import issue, make_ca
from model.settings import MODEL_OPTIONS, SettingsError, load_settings, model_config
from connector.daemon_tls import client_tls, tls_config
from prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
from tests import deploy_launch as dl
from tests import deploy_manifests as dm

DAEMON_OPTIONS = {"prefill": PREFILL_OPTIONS, "decode": DECODE_OPTIONS}
EXPECTED_OBJECTS = {
    ("ServiceAccount", "kpool-pd"), ("ConfigMap", "kpool-pd-config"), ("Service", "kpool-pd-prefill"),
    ("Service", "kpool-pd-decode"), ("StatefulSet", "kpool-pd-prefill"), ("Deployment", "kpool-pd-decode"),
    ("PodDisruptionBudget", "kpool-pd-prefill"), ("PodDisruptionBudget", "kpool-pd-decode"),
}
DAEMON_PORTS = {"port": "grpc", "metrics_port": "metrics", "health_port": "health"}  # settings key -> port name
SERVICE_PORTS = {"grpc", "metrics"}  # what a Service exposes; probes reach the health port on the pod
TLS_SECRET = "kpool-pd-tls"
TLS_MOUNT = "/etc/kpool-pd/tls"
EXTENDED_RESOURCES = {"gpu": {"nvidia.com/gpu"}, "rdma": {"nvidia.com/gpu", "rdma/ib"}}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
TOKEN_SECRET = "kpool-pd-auth"

variants = pytest.mark.parametrize("variant", dm.VARIANTS, ids=lambda v: v.id)


def base_name(obj: dict) -> str:
    """A generated ConfigMap's name without kustomize's content-hash suffix."""
    name = obj["metadata"]["name"]
    return re.sub(r"-[a-z0-9]{10}$", "", name) if obj["kind"] == "ConfigMap" else name


def token_secret(token: str) -> dict:
    """The Secret the README has users create, made by the same kubectl command (client side)."""
    text = dm.run_tool([dm.kubectl(), "create", "secret", "generic", TOKEN_SECRET, f"--from-literal=token={token}",
                        "--dry-run=client", "-o", "yaml"])
    return yaml.safe_load(text)


def tls_secret(directory: Path) -> tuple[dict, dict[str, Path]]:
    """The TLS Secret the README has users create (a throwaway CA here), made by the same kubectl
    command; and the files: the CA, and a client certificate it signed."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    pod = issue(directory, ca, "pod", hosts=("kpool-pd-prefill", "kpool-pd-decode"))
    client = issue(directory, ca, "client")
    text = dm.run_tool([dm.kubectl(), "create", "secret", "generic", TLS_SECRET, "--type=kubernetes.io/tls",
                        f"--from-file=tls.crt={pod.cert}", f"--from-file=tls.key={pod.key}",
                        f"--from-file=ca.crt={ca.cert}", "--dry-run=client", "-o", "yaml"])
    return yaml.safe_load(text), {"ca": ca.cert, "cert": client.cert, "key": client.key}


def role_of(pod: dl.LocalPod) -> str:
    """``kpool-pd prefill ...`` -> prefill."""
    role = pod.argv[1] if len(pod.argv) > 1 else ""
    assert Path(pod.argv[0]).name == "kpool-pd" and role in DAEMON_OPTIONS, \
        f"{pod.pod_name}: command {pod.argv[:2]} is not a kpool-pd daemon"
    return role


def daemon_settings(objects: list[dict], workload: dict, root: Path) -> tuple[str, dict]:
    """What the daemon in ``workload`` is given in the cluster: its role and its settings, parsed
    by the daemon's own loader from the container's args, env and mounted config file."""
    pod = dl.LocalPod(objects, workload, None, root, extra_objects=[token_secret("t" * 32)])
    role = role_of(pod)
    return role, load_settings(role, DAEMON_OPTIONS[role], pod.argv[2:], description=role, env=pod.env)


def all_settings(variant: dm.Variant, root: Path) -> dict[str, tuple[dict, dict, dict]]:
    """role -> (workload, container, settings)."""
    objects = dm.render(variant)
    out = {}
    for workload in dm.workloads(objects):
        role, settings = daemon_settings(objects, workload, root)
        assert role not in out, f"two workloads run the {role} daemon"
        out[role] = (workload, workload["spec"]["template"]["spec"]["containers"][0], settings)
    assert set(out) == set(DAEMON_OPTIONS), f"workloads run {sorted(out)}, expected both daemons"
    return out


# -- rendering and schema validation -----------------------------------------------------------


@variants
def test_renders_the_expected_objects(variant):
    objects = dm.render(variant)
    assert {(o["kind"], base_name(o)) for o in objects} == EXPECTED_OBJECTS
    assert len(objects) == len(EXPECTED_OBJECTS)


@variants
def test_every_object_passes_strict_schema_validation(variant, tmp_path):
    rendered = tmp_path / f"{variant.id}.yaml"
    rendered.write_text(dm.render_text(variant))
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(rendered)],
                          capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    passed = re.findall(r"passed for resource (\S+) against version", report)
    assert len(passed) == len(dm.render(variant)), report


def test_strict_schema_validation_refuses_an_unknown_field(tmp_path):
    objects = dm.render(dm.Variant("cpu"))
    statefulset = dm.find(objects, "StatefulSet", "kpool-pd-prefill")
    statefulset["spec"]["template"]["spec"]["containers"][0]["port"] = 50051  # a typo of "ports"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(statefulset))
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(broken)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "port" in proc.stdout + proc.stderr


# -- what schema validation misses -------------------------------------------------------------


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
                # grpc.health.v1's overall status (""): the daemons set it SERVING after warm-up.
                assert container[kind]["grpc"].get("service", "") == ""


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
def test_configmap_keys_read_by_the_daemons_exist_and_none_is_unread(variant, tmp_path):
    objects = dm.render(variant)
    (configmap,) = dm.of_kind(objects, "ConfigMap")
    read: set[str] = set()
    for workload in dm.workloads(objects):
        spec = workload["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if volume.get("configMap", {}).get("name") == configmap["metadata"]["name"]:
                read |= {item["key"] for item in volume["configMap"]["items"]}
        for container in dm.containers(workload):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] == configmap["metadata"]["name"], var
                    read.add(ref["key"])
    assert read == set(configmap["data"]), f"read {sorted(read)}, ConfigMap has {sorted(configmap['data'])}"
    # Every option in config.yaml is one the daemons know (their loader refuses unknown names),
    # and both roles read the same model and cache options.
    settings = all_settings(variant, tmp_path)
    for option in MODEL_OPTIONS:
        assert settings["prefill"][2][option.key] == settings["decode"][2][option.key], option.name
    assert settings["decode"][2]["max_prompt_tokens"] <= settings["prefill"][2]["max_prompt_tokens"]


@variants
def test_secret_references_give_both_daemons_the_same_bearer_token(variant, tmp_path):
    objects = dm.render(variant)
    token = secrets.token_hex(16)
    for workload in dm.workloads(objects):
        pod = dl.LocalPod(objects, workload, None, tmp_path, extra_objects=[token_secret(token)])
        refs = [v["valueFrom"]["secretKeyRef"] for v in pod.container["env"]
                if "secretKeyRef" in v.get("valueFrom", {})]
        assert refs == [{"name": TOKEN_SECRET, "key": "token"}], "the token Secret must be required, not optional"
        role = role_of(pod)
        assert load_settings(role, DAEMON_OPTIONS[role], pod.argv[2:], description=role, env=pod.env)["token"] == token


@variants
def test_termination_grace_outlasts_the_drain_and_liveness_outlasts_the_grace(variant, tmp_path):
    for role, (workload, container, settings) in all_settings(variant, tmp_path).items():
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > settings["drain_s"] + 5, f"{role}: grace {grace} s, drain {settings['drain_s']} s"
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= grace, role


@variants
def test_metrics_scraping_annotations_name_the_metrics_port(variant, tmp_path):
    for role, (workload, container, settings) in all_settings(variant, tmp_path).items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == settings["metrics_port"] \
            == dm.container_port(container, "metrics")["containerPort"], role


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


@variants
def test_transport_choice_per_overlay(variant, tmp_path):
    expected = {"cpu": ("auto", "auto"), "gpu": ("ucx,grpc", "ucx"), "rdma": ("ucx,grpc", "ucx")}[variant.overlay]
    settings = all_settings(variant, tmp_path)
    assert settings["prefill"][2]["transports"] == expected[0]
    assert (settings["decode"][2]["transports"], settings["decode"][2]["transport"]) == expected
    for workload, container, _ in settings.values():
        env = {v["name"] for v in container.get("env", [])}
        assert ("UCX_NET_DEVICES" in env) == (variant.overlay == "rdma")
        spec = workload["spec"]["template"]["spec"]
        host_network = "host-network" in variant.components
        assert spec.get("hostNetwork", False) is host_network
        assert spec.get("dnsPolicy", "ClusterFirst") == ("ClusterFirstWithHostNet" if host_network else "ClusterFirst")


@variants
def test_the_device_is_cuda_on_gpu_overlays(variant, tmp_path):
    want = "cuda" if variant.overlay in EXTENDED_RESOURCES else "cpu"
    for role, (_, container, settings) in all_settings(variant, tmp_path).items():
        assert settings["device"] == want, role
        (device,) = [v for v in container["env"] if v["name"] == "KPOOLPD_DEVICE"]
        assert device["valueFrom"]["configMapKeyRef"]["key"] == "device", role


@variants
def test_tls_files_come_from_the_optional_secret(variant, tmp_path):
    objects = dm.render(variant)
    secret, _ = tls_secret(tmp_path / "pki")
    tls_on = "tls" in variant.components
    for workload in dm.workloads(objects):
        spec = workload["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET]
        assert volume["secret"]["optional"] is True, "pods must start without the TLS Secret"
        (container,) = spec["containers"]
        assert {m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume["name"]} == {TLS_MOUNT}
        tls_env = {v["name"]: v["valueFrom"]["configMapKeyRef"]["key"] for v in container["env"]
                   if v["name"].startswith("KPOOLPD_TLS_")}
        assert {"KPOOLPD_TLS_CERT", "KPOOLPD_TLS_KEY", "KPOOLPD_TLS_CA",
                "KPOOLPD_TLS_REQUIRE_CLIENT_AUTH"} <= set(tls_env)
        for with_secret in (True, False):
            extra = [token_secret("t" * 32), *([secret] if with_secret else [])]
            pod = dl.LocalPod(objects, workload, None, tmp_path / f"{with_secret}", extra_objects=extra)
            role = role_of(pod)
            settings = load_settings(role, DAEMON_OPTIONS[role], pod.argv[2:], description=role, env=pod.env)
            if not tls_on:
                assert tls_config(settings) is None, role
                continue
            # The ConfigMap names files of the mounted Secret (mapped to this machine's folder).
            mount = pod.mounts[TLS_MOUNT]
            for key, name in (("tls_cert", "tls.crt"), ("tls_key", "tls.key"), ("tls_ca", "ca.crt")):
                assert settings[key] == str(mount / name), (role, key)
            if with_secret:
                tls = tls_config(settings)
                assert tls.require_client_auth and tls.root_certs == secret_bytes(secret, "ca.crt")
                if role == "decode":
                    assert tls.server_name_override == "kpool-pd-prefill"
            else:  # TLS asked for without the Secret: the daemon stops at start-up and says why
                with pytest.raises(SettingsError, match="tls-cert .*tls.crt: cannot read it"):
                    tls_config(settings)


def secret_bytes(secret: dict, key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def test_the_image_runs_the_manifests_user_and_holds_the_package():
    text = (dm.DEPLOY / "Dockerfile").read_text()
    final_stage = text[text.rindex("\nFROM "):]
    users = re.findall(r"^USER\s+(\S+)", final_stage, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    uid, _, gid = users[-1].partition(":")
    for workload in dm.workloads(dm.render(dm.Variant("cpu"))):
        context = workload["spec"]["template"]["spec"]["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (uid, gid)
    assert f"COPY --from=build {dl.IMAGE_VENV} {dl.IMAGE_VENV}" in final_stage
    assert re.search(r'pip install "/src', text), "the image must install the package"
    env = dl.image_env(dm.DEPLOY / "Dockerfile")
    assert env["PATH"].startswith(f"{dl.IMAGE_VENV}/bin:")
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", final_stage, flags=re.M) for p in line.split()}
    declared = {p["containerPort"] for w in dm.workloads(dm.render(dm.Variant("cpu"))) for c in dm.containers(w)
                for p in c["ports"]}
    assert exposed == declared


# -- the manifest-driven launch ----------------------------------------------------------------


def _kpool_pd(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "kpool-pd"), *args], capture_output=True, text=True,
                          timeout=timeout_s)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _digests(result: dict) -> tuple:
    return result["request_id"], result["tokens"], result["output_digest"], result["state_digest"]


@pytest.mark.parametrize("variant", [dm.Variant("cpu"), dm.Variant("cpu", ("tls",))], ids=lambda v: v.id)
def test_daemons_started_from_the_cpu_manifests_match_the_colocated_run(variant, tmp_path):
    objects = dm.render(variant)
    ports = dl.PortMap(objects)
    token = secrets.token_hex(16)
    extra, tls, tls_flags = [token_secret(token)], None, []
    if "tls" in variant.components:  # the Secret the README has users create; clients present a certificate
        secret, files = tls_secret(tmp_path / "pki")
        extra.append(secret)
        tls = client_tls(ca=str(files["ca"]), cert=str(files["cert"]), key=str(files["key"]),
                         server_name="kpool-pd-decode")
        tls_flags = ["--tls-ca", str(files["ca"]), "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"]),
                     "--tls-server-name", "kpool-pd-decode"]
    pods = {w["kind"]: dl.LocalPod(objects, w, ports, tmp_path, extra_objects=extra) for w in dm.workloads(objects)}
    prefill, decode = pods["StatefulSet"], pods["Deployment"]
    try:
        for pod in (prefill, decode):  # decode pods find prefill pods through the headless Service
            pod.start()
            pod.wait_started(timeout_s=120)
            assert pod.probe("readinessProbe") == pod.probe("livenessProbe") == "SERVING"
            annotations = pod.workload["spec"]["template"]["metadata"]["annotations"]
            url = (f"http://{dl.LOOPBACK}:{pod.local_port(int(annotations['prometheus.io/port']))}"
                   f"{annotations['prometheus.io/path']}")
            with urllib.request.urlopen(url, timeout=5) as reply:
                assert f"kpoolpd_{role_of(pod)}_" in reply.read().decode()

        settings = load_settings("decode", DECODE_OPTIONS, decode.argv[2:], description="decode", env=decode.env)
        config = model_config(settings)
        service = dm.find(objects, "Service", "kpool-pd-decode")
        (service_port,) = [p["port"] for p in service["spec"]["ports"] if p["targetPort"] == "grpc"]
        address = f"{dl.LOOPBACK}:{ports.service(service['metadata']['name'], service_port)}"

        # The command-line client, as a user of the deployment runs it.
        pd = _kpool_pd("generate", "--decode", address, "--token", token, *tls_flags, "--requests", "3",
                       "--prompt-len", "37", "--max-tokens", "9", "--seed", "5", "--json")
        assert pd.returncode == 0, pd.stderr + pd.stdout
        got = _json_lines(pd.stdout)
        assert got[-1]["summary"]["ok"] == 3, got[-1]
        want = run_colocated(config, make_prompts(3, 37, seed=5, vocab_size=config.vocab_size, max_tokens=9))
        assert [_digests(r) for r in got[:-1]] == [_digests(r.as_json()) for r in want]
        assert all(r["transfer_bytes"] > 0 for r in got[:-1])

        # Prompts of one token and on a block boundary and past it, through the client library.
        requests = [r for n in (1, config.resolved_block_size, config.resolved_block_size + 1)
                    for r in make_prompts(1, n, seed=n, vocab_size=config.vocab_size, max_tokens=7, prefix=f"len{n}")]
        results = asyncio.run(generate_all(address, requests, token=token, tls=tls))
        failed = [r for r in results if isinstance(r, RequestFailed)]
        assert not failed, failed
        want = run_colocated(config, requests)
        assert [_digests(r.as_json()) for r in results] == [_digests(r.as_json()) for r in want]

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(model_info(address, tls=tls))
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        if tls is not None:  # a plaintext client, and a client without a certificate, get no connection
            for other in (None, client_tls(ca=str(files["ca"]), server_name="kpool-pd-decode")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    asyncio.run(model_info(address, token=token, tls=other, timeout_s=5))
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        started = time.monotonic()
        statuses = {pod.pod_name: pod.stop() for pod in (decode, prefill)}
        logs = "\n".join(f"--- {pod.pod_name}\n{pod.log_tail()}" for pod in (decode, prefill))
    assert statuses == {decode.pod_name: 0, prefill.pod_name: 0}, logs
    assert time.monotonic() - started < decode.pod_spec["terminationGracePeriodSeconds"]
