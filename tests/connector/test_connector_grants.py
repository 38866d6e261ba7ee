"""A grant belongs to the decode engine that asked for it, between real processes on loopback: a
prefill node in one process, two decode connectors (engines A and B, both holding the peer token)
in another. B naming A's grant in Pull, Release or Heartbeat gets PERMISSION_DENIED and moves no
byte (no chunk, no UCX send); a Prefill naming an engine that never handshook is refused; then A
pulls its grant byte for byte, over both transports."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, StatusError, Transport
from kpool_pd.connector import prefill_api as pb
from kpool_pd.kvcache import BlockLayout, NodeCache
from tests.support import connector_procs as procs
from tests.support.connector_harness import prefill_nodes, run_child  # noqa: F401 (the prefill fixture)
from tests.support.deadlines import patient
from tests.support.polling import wait_for
from tests.support.pulls import allocation_for, pull_into

LEASE_S = 5.0
POISON = 0xA5  # every byte of engine B's pool, before and after its refused pull


def two_engines_main(conn, *, address: str, transport: str) -> None:
    """Engines A and B against the prefill node at ``address``; send back what each step answered."""
    async def main():
        layout = BlockLayout(procs.CONFIG)
        config = ConnectorConfig(peer_token=procs.TOKEN, lease_s=LEASE_S, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))
        t = Transport.parse(transport)
        engines, registries = {}, {name: CollectorRegistry() for name in ("a", "b")}
        caches = {name: NodeCache(layout, num_blocks=16, num_rings=2) for name in ("a", "b")}
        for name in ("a", "b"):
            engines[name] = DecodeConnector(caches[name].pool, engine_id=f"decode-{name}",
                                            config=config, registry=registries[name], transports=(t,))
            await engines[name].start()
        a, b = engines["a"], engines["b"]
        b.pool.blocks.fill_(POISON)
        b.pool.rings.fill_(POISON)
        peer_a, peer_b = await a.connect(address), await b.connect(address)
        out: dict = {}
        grant = await peer_a.prefill("req-a", [7] * 150)  # 3 blocks of 64 tokens
        out["num_blocks"] = grant.num_blocks

        async def status(call) -> str:
            try:
                await call
                return "OK"
            except StatusError as exc:
                out.setdefault("messages", []).append(exc.message)
                return exc.code.name
        with allocation_for(caches["b"], grant) as b_allocation:  # B's blocks, made ready as B's scheduler would
            out["b_pull"] = await status(peer_b.pull(grant, into=b_allocation, transport=t))
            out["b_still_held"] = not b_allocation.released
        out["b_release"] = await status(peer_b.release(grant.grant_id))
        out["b_heartbeat"] = await status(peer_b.heartbeat([grant.grant_id]))
        out["b_free"] = (caches["b"].free_blocks, caches["b"].free_rings)
        out["b_untouched"] = bool((b.pool.blocks == POISON).all() and (b.pool.rings == POISON).all())
        out["b_bytes"] = registries["b"].get_sample_value("kpoolpd_decode_transfer_bytes_total",
                                                          {"transport": t.label}) or 0.0
        # An engine id that never handshook asks for a prefill on B's channel: refused, nothing held.
        stub = pb.PrefillServiceStub(peer_b._channel)
        try:
            await stub.Prefill(pb.PrefillRequest(request_id="ghost", prompt_token_ids=[1, 2], engine_id="decode-ghost"),
                               timeout=5)
            out["ghost"] = "OK"
        except grpc.aio.AioRpcError as exc:
            out["ghost"] = exc.code().name
        # A's lease was not renewed or released by B; A pulls it, byte for byte.
        with await pull_into(caches["a"], peer_a, grant, transport=t) as landed:
            out["a_bytes"] = landed.nbytes
            out["a_equal"] = all(torch.equal(a.pool.blocks[block], procs.expected_block(layout, "req-a", j))
                                 for j, block in enumerate(landed.block_ids[:grant.num_blocks]))
        out["a_released_again"] = await peer_a.release(grant.grant_id)
        # B's own grant is B's: the binding works both ways.
        grant_b = await peer_b.prefill("req-a", [9] * 70)  # the same request id, another engine: no conflict
        out["a_pulls_b"] = await status(pull_into(caches["a"], peer_a, grant_b, transport=t))
        with await pull_into(caches["b"], peer_b, grant_b, transport=t) as landed_b:
            out["b_equal"] = all(torch.equal(b.pool.blocks[block], procs.expected_block(layout, "req-a", j))
                                 for j, block in enumerate(landed_b.block_ids[:grant_b.num_blocks]))
        out["a_free"] = (caches["a"].free_blocks, caches["a"].free_rings)
        for engine in (a, b):
            await engine.close()
        conn.send(out)
    asyncio.run(main())
    os._exit(0)  # skip interpreter teardown of the UCX workers


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_another_engines_grant_is_refused_and_moves_no_byte(prefill, transport):
    node = prefill(lease_s=LEASE_S)
    (out,), code = run_child(two_engines_main, address=node.address, transport=transport)
    assert code == 0, out
    assert out["b_pull"] == out["b_release"] == out["b_heartbeat"] == "PERMISSION_DENIED", out
    assert all("not made for engine 'decode-b'" in m for m in out["messages"][:3]), out["messages"]
    assert not any("decode-a" in m for m in out["messages"][:3]), "a refusal must not name the grant's engine"
    assert out["b_untouched"] is True, "a refused pull must land no byte in B's blocks"
    assert out["b_still_held"] is True, "a refused pull leaves B's allocation to B"
    assert out["b_free"] == (16, 2) and out["b_bytes"] == 0
    assert out["ghost"] == "FAILED_PRECONDITION"
    assert out["a_bytes"] > 0 and out["a_equal"] is True
    assert out["a_released_again"] is False  # A's pull released it; B's Release had not
    assert out["a_pulls_b"] == "PERMISSION_DENIED"
    assert out["b_equal"] is True
    assert out["a_free"] == (16, 2), "every allocation of A came back"
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 10), node.counts()
