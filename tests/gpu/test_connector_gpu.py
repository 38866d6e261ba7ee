"""The connector between two GPUs of one host: the prefill node's pool on cuda:0, the decode
node's on cuda:1, each in its own process; random non-contiguous blocks and the ring travel
over UCX (cuda_ipc) and over the gRPC stream, and land byte for byte."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from kpool_pd.runtime.launch import ChildKind, child_context, start_child

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices (nvidia-h200-x2)"),
]


FRESH = ChildKind.SPAWN  # GPU children start CUDA and UCX in a fresh interpreter, as a deployment does
LENGTHS = [1, 4, 5, 64, 65, 257, 1000, 4096]


def _prefill_proc(conn) -> None:
    from prometheus_client import CollectorRegistry

    from kpool_pd.connector import ConnectorConfig, PrefillConnector, Transport
    from tests.support.connector_procs import CONFIG, SeededFillEngine
    from kpool_pd.kvcache import NodeCache
    from tests.support.serving import serve_prefill, stop_prefill

    async def main():
        cache = NodeCache(CONFIG, num_blocks=256, num_rings=8, device="cuda:0")
        one_each = [cache.allocate("spacer", 1, ring=False) for _ in range(256)]  # block i in one_each[i]
        for spacer in one_each[1::2]:
            spacer.release()  # every other block stays held: grants are non-contiguous
        node = PrefillConnector(cache.pool, SeededFillEngine(cache), engine_id="gpu-prefill",
                                config=ConnectorConfig(transfer_timeout_s=60, rpc_timeout_s=60),
                                registry=CollectorRegistry(), transports=(Transport.UCX, Transport.GRPC_STREAM))
        server = await serve_prefill(node)
        conn.send(server.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await stop_prefill(server, node)
        conn.send((cache.free_blocks, cache.free_rings))
        for spacer in one_each[::2]:
            spacer.release()

    asyncio.run(main())
    os._exit(0)


def _decode_proc(conn, address: str, transport: str) -> None:
    from prometheus_client import CollectorRegistry

    from kpool_pd.connector import ConnectorConfig, DecodeConnector, Transport
    from tests.support.connector_procs import CONFIG, landed_differences
    from kpool_pd.kvcache import NodeCache
    from tests.support.pulls import pull_into

    async def main():
        cache = NodeCache(CONFIG, num_blocks=256, num_rings=8, device="cuda:1")
        pool = cache.pool
        pool.blocks.fill_(0xA5)
        occupied = cache.allocate("occupied", 7, ring=False)  # the pulls land after the first 7 blocks
        t = Transport.parse(transport)
        node = await DecodeConnector(pool, engine_id=f"gpu-decode-{transport}",
                                     config=ConnectorConfig(transfer_timeout_s=60, rpc_timeout_s=60),
                                     registry=CollectorRegistry(), transports=(t,)).start()
        peer = await node.connect(address)
        rng = random.Random(3)
        checked = 0
        for i, n in enumerate(LENGTHS):
            rid = f"gpu-{transport}-{i}"
            grant = await peer.prefill(rid, [rng.randrange(1000) for _ in range(n)])
            extra = 2 if i % 2 else 0  # every other pull also reserves blocks for output tokens
            with await pull_into(cache, peer, grant, reserve_blocks=grant.num_blocks + extra, transport=t,
                                 integrity=i % 2 == 1) as landed:
                assert len(landed.block_ids) == grant.num_blocks + extra
                differences, compared = landed_differences(pool, landed, rid, n)
                assert not differences, differences
                checked += compared
        conn.send(("ok", checked, cache.free_blocks, cache.free_rings))
        occupied.release()

    try:
        asyncio.run(main())
    except BaseException as exc:  # report the failure to the test, then leave
        conn.send(("error", repr(exc)))
    os._exit(0)


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_blocks_move_gpu_to_gpu_byte_for_byte(transport):
    if transport == "ucx":
        pytest.importorskip("ucxx", reason="the UCX transport needs ucxx (carry the cu13 wheels)")
    p_conn, p_child = child_context(FRESH).Pipe()
    prefill = start_child(_prefill_proc, p_child, kind=FRESH)
    assert p_conn.poll(120), "prefill node did not start"
    address = f"127.0.0.1:{p_conn.recv()}"
    d_conn, d_child = child_context(FRESH).Pipe()
    decode = start_child(_decode_proc, d_child, address, transport, kind=FRESH)
    try:
        assert d_conn.poll(240), "decode node did not finish within 240 s"
        result = d_conn.recv()
        assert result[0] == "ok", result
        _, checked, free_blocks, free_rings = result
        assert checked > 0
        assert (free_blocks, free_rings) == (256 - 7, 8)  # every pull's allocation came back
        p_conn.send("stop")
        assert p_conn.poll(60)
        assert p_conn.recv() == (128, 8)  # the prefill node freed every grant
    finally:
        for proc in (decode, prefill):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
