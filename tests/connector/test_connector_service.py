"""The connector's service edge in one process (gRPC stream transport on loopback): TLS and mTLS,
integrity mode, RESOURCE_EXHAUSTED and INVALID_ARGUMENT with their messages, the metrics read
back from the registry, and the health and reflection services."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import (ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, TlsConfig, Transport,
                       open_channel)
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared import regions  # fault injection: how the gRPC stream reads a region's bytes
from kpool_pd.connector.shared.wire import layout_message
from kpool_pd.kvcache import BlockLayout, CacheExhaustedError, NodeCache
from tests.support.connector_procs import CONFIG, TOKEN, SeededFillEngine
from tests.support.deadlines import patient
from tests.support.pulls import allocation_for, pull_into
from tests.support.serving import serve_prefill, stop_prefill

GRPC = Transport.GRPC_STREAM
BASE = ConnectorConfig(peer_token=TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))


class Pair:
    """A prefill node and a decode node in this process, each with its own node cache (``p_cache``,
    ``d_cache``) and registry."""

    def __init__(self, config: ConnectorConfig = BASE, decode_config: ConnectorConfig | None = None,
                 prefill_blocks: int = 64, decode_blocks: int = 64) -> None:
        self.prefill_registry, self.decode_registry = CollectorRegistry(), CollectorRegistry()
        self.p_cache = NodeCache(CONFIG, num_blocks=prefill_blocks, num_rings=4)
        self.d_cache = NodeCache(CONFIG, num_blocks=decode_blocks, num_rings=4)
        self.prefill = PrefillConnector(self.p_cache.pool, SeededFillEngine(self.p_cache), engine_id="prefill-t",
                                        config=config, registry=self.prefill_registry, transports=(GRPC,))
        self.decode = DecodeConnector(self.d_cache.pool, engine_id="decode-t", config=decode_config or config,
                                      registry=self.decode_registry, transports=(GRPC,))
        self.address = ""

    async def __aenter__(self) -> "Pair":
        self.server = await serve_prefill(self.prefill)
        self.address = f"127.0.0.1:{self.server.port}"
        await self.decode.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.decode.close()
        await stop_prefill(self.server, self.prefill)

    def free(self) -> tuple[int, int, int, int]:
        """Free blocks and rings: prefill side, then decode side."""
        return self.p_cache.free_blocks, self.p_cache.free_rings, self.d_cache.free_blocks, self.d_cache.free_rings

    def sample(self, side: str, name: str, **labels) -> float:
        registry = self.prefill_registry if side == "prefill" else self.decode_registry
        return registry.get_sample_value(f"kpoolpd_{side}_{name}", labels) or 0.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


# TLS and mTLS ------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _leaf(d: Path, name: str, ca: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA with a server and a client certificate, and a second CA with its own client."""
    if shutil.which("openssl") is None:
        pytest.fail("the TLS tests make their certificates with the openssl command, which is not on PATH")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca")
    _leaf(d, "client", "ca")
    _leaf(d, "rogue-client", "rogue-ca")
    return {p.stem + p.suffix: p.read_bytes() for p in d.iterdir() if p.suffix in (".pem", ".key")}


def _server_tls(pki, mutual: bool) -> TlsConfig:
    return TlsConfig(cert_chain=pki["server.pem"], private_key=pki["server.key"],
                     root_certs=pki["ca.pem"] if mutual else None, require_client_auth=mutual)


def _client_tls(pki, who: str | None, ca: str = "ca.pem") -> TlsConfig:
    return TlsConfig(root_certs=pki[ca], cert_chain=pki[f"{who}.pem"] if who else None,
                     private_key=pki[f"{who}.key"] if who else None)


async def _handshake_and_pull(pair: Pair) -> bytes:
    peer = await pair.decode.connect(pair.address)
    grant = await peer.prefill("tls-req", [5] * 300)
    with await pull_into(pair.d_cache, peer, grant, transport=GRPC, integrity=True) as landed:
        return bytes(pair.decode.pool.blocks[landed.block_ids[0]].numpy())


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_tls_connection_moves_a_request(pki, mutual):
    server = dataclasses.replace(BASE, tls=_server_tls(pki, mutual))
    client = dataclasses.replace(BASE, tls=_client_tls(pki, "client" if mutual else None))

    async def main():
        async with Pair(server, client) as pair:
            first = await _handshake_and_pull(pair)
            assert pair.free()[2:] == (64, 4)
            return first
    assert len(run(main())) == BlockLayout(CONFIG).block_bytes


@pytest.mark.parametrize("mutual,client_tls", [
    (False, "plaintext"),
    (False, "wrong-ca"),
    (True, "no-client-cert"),
    (True, "client-cert-from-another-ca"),
])
def test_tls_refuses(pki, mutual, client_tls):
    server = dataclasses.replace(BASE, tls=_server_tls(pki, mutual))
    client = {"plaintext": None, "wrong-ca": _client_tls(pki, None, ca="rogue-ca.pem"),
              "no-client-cert": _client_tls(pki, None),
              "client-cert-from-another-ca": _client_tls(pki, "rogue-client")}[client_tls]
    client = dataclasses.replace(BASE, tls=client, rpc_timeout_s=3.0)

    async def main():
        async with Pair(server, client) as pair:
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            return err.value
    err = run(main())
    assert err.code is grpc.StatusCode.UNAVAILABLE, err
    assert "Handshake" in err.message


# integrity ---------------------------------------------------------------------------------
def test_corrupted_region_is_data_loss_and_leaves_the_allocation_to_the_caller(monkeypatch):
    real = regions.host_bytes

    def flip_one_byte(view):  # the wire copy differs from what the checksum covered
        data = bytearray(real(view))
        data[len(data) // 2] ^= 0x40
        return bytes(data)
    monkeypatch.setattr(regions, "host_bytes", flip_one_byte)

    async def main():
        async with Pair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("corrupt", [3] * 500)
            allocation = allocation_for(pair.d_cache, grant)
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, into=allocation, transport=GRPC, integrity=True)
            assert err.value.code is grpc.StatusCode.DATA_LOSS and "crc32 mismatch" in err.value.message
            assert not allocation.released  # the pull released nothing: the blocks and the ring are the caller's
            assert pair.free()[2:] == (start[2] - grant.num_blocks, start[3] - 1)
            allocation.release()
            assert pair.free()[2:] == start[2:]
            assert pair.sample("decode", "transfer_failures_total", cause="data_loss") == 1
            assert await peer.release(grant.grant_id) is True
            assert pair.free() == start
    run(main())


# RESOURCE_EXHAUSTED ------------------------------------------------------------------------
def test_grants_are_bounded():
    async def main():
        async with Pair(dataclasses.replace(BASE, max_grants=2)) as pair:
            peer = await pair.decode.connect(pair.address)
            await peer.prefill("a", [1] * 10)
            await peer.prefill("b", [1] * 10)
            with pytest.raises(StatusError) as err:
                await peer.prefill("c", [1] * 10)
            assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 grants held (limit 2)" in err.value.message
            assert pair.sample("prefill", "transfer_failures_total", cause="too_many_grants") == 1
    run(main())


def test_prompt_larger_than_the_prefill_pool():
    async def main():
        async with Pair(prefill_blocks=8) as pair:
            peer = await pair.decode.connect(pair.address)
            with pytest.raises(StatusError) as err:
                await peer.prefill("big", [1] * (64 * 9))
            assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 9 blocks and a ring; free: 8 of 8 blocks" in err.value.message
            assert pair.free()[:2] == (8, 4)  # nothing kept by the failed prefill
            assert pair.sample("prefill", "transfer_failures_total", cause="cache_exhausted") == 1
    run(main())


def test_grant_larger_than_the_decode_pool():
    async def main():
        async with Pair(decode_blocks=4) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("big", [1] * (64 * 5))
            with pytest.raises(CacheExhaustedError, match="big needs 5 blocks and a ring; free: 4 of 4 blocks"):
                allocation_for(pair.d_cache, grant)  # the decode node cannot take the grant's blocks
            assert pair.free()[2:] == (4, 4)
            assert await peer.release(grant.grant_id) is True
    run(main())


# INVALID_ARGUMENT, one case per malformed field --------------------------------------------
def _prefill(**kw):
    fields = dict(request_id="r", prompt_token_ids=[1, 2, 3]) | kw
    return "Prefill", pb.PrefillRequest(**fields)


def _pull_of(grant, *regions: pb.Region):
    """A Pull of ``grant`` over the gRPC stream whose plan is ``regions``."""
    return "Pull", pb.PullRequest(grant_id=grant.grant_id, engine_id="decode-t", transport=pb.TRANSPORT_GRPC_STREAM,
                                  regions=list(regions))


INVALID = {
    "handshake-empty-engine-id": (lambda g: ("Handshake", pb.HandshakeRequest(engine_id="")), "engine_id"),
    "handshake-long-engine-id": (lambda g: ("Handshake", pb.HandshakeRequest(engine_id="e" * 257)), "engine_id"),
    "prefill-empty-request-id": (lambda g: _prefill(request_id=""), "request_id"),
    "prefill-long-request-id": (lambda g: _prefill(request_id="r" * 257), "request_id"),
    "prefill-empty-prompt": (lambda g: _prefill(prompt_token_ids=[]), "prompt has 0 tokens"),
    "prefill-prompt-over-limit": (lambda g: _prefill(prompt_token_ids=[1] * 513), "prompt has 513 tokens"),
    "heartbeat-too-many-ids": (lambda g: ("Heartbeat", pb.HeartbeatRequest(engine_id="decode-t", grant_ids=["x"] * 9)),
                               "9 grant ids (limit 8)"),
    "pull-transport-not-offered": (lambda g: ("Pull", pb.PullRequest(
        grant_id=g.grant_id, engine_id="decode-t", transport=pb.TRANSPORT_UCX, ucx_tag_base=1)), "not offered"),
    "pull-region-beyond-the-grants-blocks": (lambda g: _pull_of(g, pb.Region(kind=pb.POOL_KIND_BLOCKS, offset=0,
                                                                        nbytes=1 << 40)),
                                             "region 0 (pool 1, plane 0, bytes 0+1099511627776) is not served: it "
                                             "reaches bytes of a block the grant does not hold"),
    "pull-region-of-another-plane": (lambda g: _pull_of(g, pb.Region(kind=pb.POOL_KIND_BLOCKS, offset=0, nbytes=1, plane=1)),
                                     "reaches bytes of a block the grant does not hold"),
    "pull-region-beyond-the-ring": (lambda g: _pull_of(g, pb.Region(kind=pb.POOL_KIND_RINGS, offset=0, nbytes=1 << 30)),
                                    "the grant's ring holds bytes"),
    "pull-region-of-no-pool": (lambda g: _pull_of(g, pb.Region(kind=pb.POOL_KIND_UNSPECIFIED, offset=0, nbytes=1)),
                               "pool kind 0 is none of [1, 2]"),
    "pull-empty-region": (lambda g: _pull_of(g, pb.Region(kind=pb.POOL_KIND_BLOCKS, offset=0, nbytes=0)), "it is empty"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_argument_names_the_field(case):
    build, needle = INVALID[case]

    async def main():
        config = dataclasses.replace(BASE, max_prompt_tokens=512, max_grants=8)
        async with Pair(config) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("held", [1] * 200)
            method, request = build(grant)
            if request.engine_id == "decode-t":  # the engine's own call, malformed otherwise
                request.engine_secret = peer._secret
            stub = pb.PrefillServiceStub(peer._channel)  # the peer's session goes with each call
            call = getattr(stub, method)(request, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if method == "Pull":
                    async for _ in call:
                        pass
                else:
                    await call
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert needle in err.value.details()
            assert await peer.release(grant.grant_id) is True
            assert pair.free()[:2] == (64, 4)
    run(main())


# metrics -----------------------------------------------------------------------------------
def test_metrics_after_a_transfer_and_after_failures():
    async def main():
        async with Pair(dataclasses.replace(BASE, lease_s=0.3)) as pair:
            peer = await pair.decode.connect(pair.address)
            # the free counts are the node caches' (a daemon's runtime exports them: runtime.metrics.watch_cache)
            assert pair.p_cache.free_blocks == 64 and pair.d_cache.free_rings == 4
            grant = await peer.prefill("m", [2] * 300)  # 5 blocks
            assert pair.p_cache.free_blocks == 59
            with await pull_into(pair.d_cache, peer, grant, transport=GRPC) as landed:
                assert pair.d_cache.free_blocks == 59 and pair.d_cache.free_rings == 3
                for side in ("prefill", "decode"):
                    assert pair.sample(side, "transfer_bytes_total", transport="grpc") == landed.nbytes > 0
                    assert pair.sample(side, "transfer_regions_total", transport="grpc") == landed.regions
                    assert pair.sample(side, "transfer_seconds_count", transport="grpc") == 1
                    assert pair.sample(side, "transfer_seconds_sum", transport="grpc") > 0
                    assert pair.sample(side, "transfer_seconds_bucket", transport="grpc", le="+Inf") == 1
            assert pair.d_cache.free_blocks == 64
            # failures: a pull of a grant that expired (NOT_FOUND on both sides), counted by cause
            late = await peer.prefill("late", [2] * 100)
            await asyncio.sleep(0.8)
            assert pair.sample("prefill", "leases_expired_total") == 1
            assert pair.p_cache.free_blocks == 64
            with pytest.raises(StatusError):
                await pull_into(pair.d_cache, peer, late, transport=GRPC)
            assert pair.sample("prefill", "transfer_failures_total", cause="unknown_grant") == 1
            assert pair.sample("decode", "transfer_failures_total", cause="not_found") == 1
            assert pair.sample("decode", "transfer_bytes_total", transport="grpc") == landed.nbytes  # unchanged
    run(main())


# health and reflection ---------------------------------------------------------------------
def test_health_and_reflection_answer_without_a_token():
    async def main():
        async with Pair() as pair:
            async with grpc.aio.insecure_channel(pair.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", PrefillConnector.service_name):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
                assert err.value.code() is grpc.StatusCode.NOT_FOUND
            # reflection takes the peer credential: a channel opened with the peer token proves it
            async with open_channel(pair.address, None, peer_token=TOKEN, challenge_timeout_s=5.0) as peer:
                reflect = reflection_pb2_grpc.ServerReflectionStub(peer)
                names = []
                async for reply in reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                                timeout=5):
                    names = [s.name for s in reply.list_services_response.service]
                assert PrefillConnector.service_name in names and "grpc.health.v1.Health" in names
            async with grpc.aio.insecure_channel(pair.address) as channel:
                # and the service itself still wants the token
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb.PrefillServiceStub(channel).Handshake(
                        pb.HandshakeRequest(engine_id="x", layout=layout_message(pair.decode.pool.layout)), timeout=5)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            await stop_prefill(pair.server, pair.prefill)  # stopping twice (again on exit) is harmless
    run(main())
