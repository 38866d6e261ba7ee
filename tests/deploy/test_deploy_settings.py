"""What each daemon reads in the cluster, through its own settings loader: the ConfigMap (every
key read, none unread, the same model options on both roles), the two bearer-token credentials, the
preStop, drain and grace periods, the metrics annotations, the transports, device and fabric check
per overlay with the UCX environment (which UCX, which network devices), and the optional TLS
Secret."""

from __future__ import annotations

import secrets

import pytest

from kpool_pd.runtime import MODEL_OPTIONS, SettingsError, load_settings, tls_config
from kpool_pd.runtime.fabric_check import Fabric
from tests.support import deploy_manifests as dm
from tests.support.deploy_daemons import (DAEMON_OPTIONS, EXTENDED_RESOURCES, TLS_MOUNT, TLS_SECRET, TOKEN_SECRET,
                                  all_settings, local_pod, role_of, secret_bytes, tls_secret, token_secret, variants)


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
def test_secret_references_give_each_daemon_its_credentials(variant, tmp_path):
    """The decode pods get the client token (their Generate API) and the peer token (their calls to
    prefill pods); the prefill pods the peer token alone: the client token opens nothing there."""
    objects = dm.render(variant)
    token, peer_token = secrets.token_hex(16), secrets.token_hex(16)
    expected = {"decode": (["token", "peer-token"], token), "prefill": (["peer-token"], "")}
    for workload in dm.workloads(objects):
        pod = local_pod(objects, workload, tmp_path, extra_objects=[token_secret(token, peer_token)])
        refs = [v["valueFrom"]["secretKeyRef"] for v in pod.container["env"]
                if "secretKeyRef" in v.get("valueFrom", {})]
        role = role_of(pod)
        keys, client_token = expected[role]
        assert refs == [{"name": TOKEN_SECRET, "key": key} for key in keys], \
            f"{role}: the token Secret's keys {keys} must be required, not optional"
        settings = load_settings(role, DAEMON_OPTIONS[role], pod.argv[2:], description=role, env=pod.env)
        assert settings["token"] == client_token and settings["peer_token"] == peer_token, role


@variants
def test_termination_grace_outlasts_the_pre_stop_and_the_drain_and_liveness_outlasts_the_grace(variant, tmp_path):
    for role, (workload, container, settings) in all_settings(variant, tmp_path).items():
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # The kubelet counts the preStop hook in the grace period; then SIGTERM starts the drain.
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert grace >= pre_stop + settings["drain_s"] + 5, \
            f"{role}: grace {grace} s, preStop {pre_stop} s, drain {settings['drain_s']} s"
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
def test_transport_choice_per_overlay(variant, tmp_path):
    expected = {"cpu": ("auto", "auto"), "gpu": ("ucx,grpc", "ucx"), "rdma": ("ucx,grpc", "ucx"),
                "dcp": ("ucx,grpc", "ucx")}[variant.overlay]
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
            extra = [token_secret("t" * 32, "p" * 32), *([secret] if with_secret else [])]
            pod = local_pod(objects, workload, tmp_path / f"{with_secret}", extra_objects=extra)
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


# overlay -> what the daemons' start-up check requires of the data plane
FABRIC = {"cpu": Fabric.ANY, "gpu": Fabric.GPU, "rdma": Fabric.RDMA, "dcp": Fabric.GPU}


@variants
def test_the_fabric_check_and_the_ucx_environment_per_overlay(variant, tmp_path):
    """The rdma pods refuse to turn ready without an RDMA transport; their UCX sees every HCA port in
    the pod (no one fixed HCA for all); the GPU pods load the image's UCX, not the wheel's."""
    objects = dm.render(variant)
    for role, (workload, container, settings) in all_settings(variant, tmp_path).items():
        assert settings["fabric"] is FABRIC[variant.overlay], role
        env = local_pod(objects, workload, tmp_path / role, extra_objects=[token_secret("t" * 32, "p" * 32)]).env
        assert env.get("UCX_NET_DEVICES") == ("all" if variant.overlay == "rdma" else None), role
        want = "true" if variant.overlay in ("gpu", "rdma", "dcp") else None
        assert env.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY") == want, role


@variants
def test_only_the_dcp_overlay_runs_decode_ranks_one_gpu_each(variant, tmp_path):
    for role, (_, container, settings) in all_settings(variant, tmp_path).items():
        ranks = 2 if variant.overlay == "dcp" and role == "decode" else 1
        assert settings.get("dcp", 1) == ranks, role
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        if ranks > 1:
            assert gpus == str(ranks), "a DCP decode pod holds one GPU per rank"
