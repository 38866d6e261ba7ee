"""PrefillPush between real processes on loopback, either side killed while the prompt is computed in chunks:
the decode process dying frees everything on the prefill node long before the lease ends; the prefill process
dying fails the push at once (UNAVAILABLE or CANCELLED) with the decode node's allocation free again; and pushes
of several lengths land byte for byte, scattered prefill blocks and all."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, StatusError, Transport
from kpool_pd.kvcache import BlockLayout, NodeCache
from tests.support import connector_procs as procs
from tests.support.connector_harness import prefill_nodes, run_child  # noqa: F401 (the prefill fixture)
from tests.support.deadlines import patient
from tests.support.polling import wait_for

TRANSPORTS = ["ucx", "grpc"]
CHUNK_TOKENS = 100  # the prefill node's chunks (a block is 64 tokens)


def push_main(conn, *, address: str, transport: str, scenario: str, lease_s: float) -> None:
    """Push prompts to the prefill node at ``address`` (``scenario``: "lands", "decode_dies" or
    "prefill_dies"); send back a result dict."""
    async def main():
        node_cache = NodeCache(BlockLayout(procs.CONFIG), num_blocks=128, num_rings=8)
        start_free = (node_cache.free_blocks, node_cache.free_rings)
        config = ConnectorConfig(lease_s=lease_s, peer_token=procs.TOKEN, transfer_timeout_s=patient(3),
                                 rpc_timeout_s=patient(3))
        t = Transport.parse(transport)
        node = await DecodeConnector(node_cache.pool, engine_id=f"push-{scenario}", config=config,
                                     registry=CollectorRegistry(), transports=(t,)).start()
        peer = await node.connect(address)
        out: dict = {"start_free": start_free, "pushes": peer.pushes, "differences": [], "error": None}
        rng = random.Random(3)
        for i, n in enumerate([700, 1, 257] if scenario == "lands" else [2000]):
            rid = f"push-{transport}-{i}"
            prompt = [rng.randrange(50000) for _ in range(n)]
            if scenario == "decode_dies":  # exit once the push is under way, between two chunks
                def die():
                    conn.send({"dying": True})
                    os._exit(17)
                asyncio.get_running_loop().call_later(0.3, die)
            allocation = node_cache.allocate(rid, procs.CONFIG.blocks_for_tokens(n))
            began = time.monotonic()
            try:
                landed = await peer.push(rid, prompt, into=allocation, transport=t, integrity=i % 2 == 1)
                differences, _ = procs.landed_differences(node_cache.pool, _Landed(landed, allocation), rid, n)
                out["differences"] += differences
                out.setdefault("first_tokens", []).append((landed.first_token, sum(prompt) % 50000))
                await peer.release(landed.grant.grant_id)
            except StatusError as exc:
                out["error"], out["message"] = exc.code.name, exc.message
            finally:
                allocation.release()
            out["seconds"] = time.monotonic() - began
        out["end_free"] = (node_cache.free_blocks, node_cache.free_rings)
        await node.close()
        conn.send(out)
    asyncio.run(main())


class _Landed:
    """A LandedRequest with the allocation it landed in, as ``landed_differences`` reads it."""

    def __init__(self, landed, allocation) -> None:
        self.grant, self.block_ids, self.ring_id = landed.grant, allocation.block_ids, allocation.ring_id


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pushes_land_byte_for_byte_from_scattered_prefill_blocks(prefill, transport):
    node = prefill(lease_s=10.0, chunk_tokens=CHUNK_TOKENS)
    (out,), code = run_child(push_main, address=node.address, transport=transport, scenario="lands", lease_s=10.0)
    assert code == 0 and out["pushes"] and out["error"] is None and out["differences"] == [], out
    assert all(got == want for got, want in out["first_tokens"]) and out["end_free"] == out["start_free"]
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 10.0), node.counts()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_decode_killed_mid_push_frees_everything_on_the_prefill_node_before_the_lease(prefill, transport):
    lease_s = 20.0
    node = prefill(lease_s=lease_s, chunk_tokens=CHUNK_TOKENS, chunk_pause_s=0.2)
    messages, code = run_child(push_main, address=node.address, transport=transport, scenario="decode_dies",
                               lease_s=lease_s)
    assert messages == [{"dying": True}] and code == 17
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 10.0), node.counts()
    computed, stopped = node.chunks()
    assert stopped == 1 and computed < 2000 // CHUNK_TOKENS, (computed, stopped)
    assert node.proc.is_alive()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_killed_mid_push_fails_the_request_cleanly(prefill, transport):
    node = prefill(lease_s=10.0, die="between_chunks", chunk_tokens=CHUNK_TOKENS)
    (out,), code = run_child(push_main, address=node.address, transport=transport, scenario="prefill_dies",
                             lease_s=10.0)
    assert code == 0 and out["pushes"]
    assert out["error"] in ("UNAVAILABLE", "CANCELLED"), out
    assert out["seconds"] < 3.0, out  # the lost call ends the push, long before its deadline
    assert out["end_free"] == out["start_free"]
    node.proc.join(10)
    assert node.proc.exitcode == 17
