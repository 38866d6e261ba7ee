"""The daemons started exactly as the cpu overlay describes them (plaintext, and with the TLS
component), on loopback: requests through the decode Service's port, by the command-line client
and the client library, equal the colocated run; unauthenticated and untrusted clients are
refused, and the client token opens nothing on a prefill pod; both pods stop within their grace
period."""

from __future__ import annotations

import asyncio
import functools
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

from kpool_pd.connector import auth_metadata, open_channel
from kpool_pd.connector import prefill_api as pb
from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.decode_worker.client import RequestFailed, generate_all, model_info
from kpool_pd.model.colocated import make_prompts, run_colocated
from kpool_pd.runtime import client_tls, load_settings, model_config
from tests.support import deploy_launch as dl
from tests.support import deploy_manifests as dm
from tests.support.deadlines import patient
from tests.support.deploy_daemons import role_of, tls_secret, token_secret


@functools.cache
def autoscaling_metrics() -> dict[str, set[str]]:
    """container -> the kpoolpd_* series the autoscaling component's queries select by that container."""
    objects = dm.render(dm.Variant("cpu", ("monitoring", "autoscaling")))
    found: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for scaled in dm.of_kind(objects, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            for metric, container in re.findall(r'(kpoolpd_\w+)\{[^}]*container="(\w+)"', trigger["metadata"]["query"]):
                found[container].add(metric)
    assert all(found.values()), found
    return found


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
    extra, tls, tls_flags = [token_secret(token, secrets.token_hex(16))], None, []
    if "tls" in variant.components:  # the Secret the README has users create; clients present a certificate
        secret, files = tls_secret(tmp_path / "pki")
        extra.append(secret)
        tls = client_tls(ca=str(files["ca"]), cert=str(files["cert"]), key=str(files["key"]),
                         server_name="kpool-pd-decode")
        tls_flags = ["--tls-ca", str(files["ca"]), "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"]),
                     "--tls-server-name", "kpool-pd-decode"]
    pods = {pod.container["name"]: pod for pod in (dl.LocalPod(objects, w, ports, tmp_path, extra_objects=extra)
                                                   for w in dm.workloads(objects))}
    prefill, decode = pods["prefill"], pods["decode"]
    try:
        for pod in (prefill, decode):  # decode pods find prefill pods through the headless Service
            pod.start()
            pod.wait_started(timeout_s=120)
            pod.wait_serving("readinessProbe", timeout_s=patient(20))
            assert pod.probe("livenessProbe") == "SERVING"
            annotations = pod.workload["spec"]["template"]["metadata"]["annotations"]
            url = (f"http://{dl.LOOPBACK}:{pod.local_port(int(annotations['prometheus.io/port']))}"
                   f"{annotations['prometheus.io/path']}")
            with urllib.request.urlopen(url, timeout=5) as reply:
                exported = reply.read().decode()
            assert f"kpoolpd_{role_of(pod)}_" in exported
            # What the autoscaling component's queries ask of this role's pods, they export.
            for metric in autoscaling_metrics()[pod.container["name"]]:
                assert re.search(rf"^{metric}(\{{| )", exported, flags=re.M), f"{role_of(pod)} does not export {metric}"

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
        requests = [r for n in (1, config.cache.block_size, config.cache.block_size + 1)
                    for r in make_prompts(1, n, seed=n, vocab_size=config.vocab_size, max_tokens=7, prefix=f"len{n}")]
        results = asyncio.run(generate_all(address, requests, token=token, tls=tls))
        failed = [r for r in results if isinstance(r, RequestFailed)]
        assert not failed, failed
        want = run_colocated(config, requests)
        assert [_digests(r.as_json()) for r in results] == [_digests(r.as_json()) for r in want]

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(model_info(address, tls=tls))
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # The client token opens nothing on a prefill pod: its PrefillService wants the peer token.
        prefill_port = ports.of(prefill.workload, dm.container_port(prefill.container, "grpc")["containerPort"])
        prefill_tls = None if tls is None else client_tls(ca=str(files["ca"]), cert=str(files["cert"]),
                                                          key=str(files["key"]), server_name="kpool-pd-prefill")

        async def heartbeat_with_the_client_token():
            async with open_channel(f"{dl.LOOPBACK}:{prefill_port}", prefill_tls) as channel:
                await pb.PrefillServiceStub(channel).Heartbeat(pb.HeartbeatRequest(engine_id="a-client"), timeout=5,
                                                               metadata=auth_metadata(token))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(heartbeat_with_the_client_token())
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
