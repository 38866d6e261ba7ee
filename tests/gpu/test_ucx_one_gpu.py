"""UCX with GPU memory on one GPU, as the Handshake hardening leaves it: the prefill and the decode
node's pools both on cuda:0, each in its own process; the decode node's worker address (with the
cuda transports in it) passes the address check and the probe child; requests land byte for byte
with UCX's memory-type cache off (``UCX_MEMTYPE_CACHE=n`` now applies), and UCX prints no warning
about unused options. Run by ``tests/gpu/run_all.sh`` on an H200."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from kpool_pd.runtime.launch import ChildKind, child_context, start_child

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


FRESH = ChildKind.SPAWN  # GPU children start CUDA and UCX in a fresh interpreter, as a deployment does
LENGTHS = [1, 5, 65, 1000, 4096]


def _prefill_proc(conn) -> None:
    from prometheus_client import CollectorRegistry

    from kpool_pd.connector import ConnectorConfig, PrefillConnector, Transport
    from tests.support.connector_procs import CONFIG, SeededFillEngine
    from kpool_pd.kvcache import NodeCache
    from tests.support.serving import serve_prefill, stop_prefill

    async def main():
        cache = NodeCache(CONFIG, num_blocks=256, num_rings=8, device="cuda:0")
        node = PrefillConnector(cache.pool, SeededFillEngine(cache), engine_id="gpu-prefill",
                                config=ConnectorConfig(transfer_timeout_s=60, rpc_timeout_s=60),
                                registry=CollectorRegistry(), transports=(Transport.UCX,))
        server = await serve_prefill(node)
        conn.send((server.port, sorted(node._ucx.active_transports()), node._ucx.ucx_config().get("NET_DEVICES")))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await stop_prefill(server, node)
        conn.send((cache.free_blocks, cache.free_rings))

    asyncio.run(main())
    os._exit(0)


def _decode_proc(conn, address: str) -> None:
    from prometheus_client import CollectorRegistry

    from kpool_pd.connector import ConnectorConfig, DecodeConnector, Transport
    from kpool_pd.connector.prefill.ucx_address import check_worker_address
    from tests.support.connector_procs import CONFIG, landed_differences
    from kpool_pd.kvcache import NodeCache
    from tests.support.pulls import pull_into

    async def main():
        cache = NodeCache(CONFIG, num_blocks=256, num_rings=8, device="cuda:0")
        pool = cache.pool
        pool.blocks.fill_(0xA5)
        occupied = cache.allocate("occupied", 7, ring=False)  # the pulls land after the first 7 blocks
        node = await DecodeConnector(pool, engine_id="gpu-decode",
                                     config=ConnectorConfig(transfer_timeout_s=60, rpc_timeout_s=60),
                                     registry=CollectorRegistry(), transports=(Transport.UCX,)).start()
        info = check_worker_address(node.ucx.address)
        peer = await node.connect(address)
        rng = random.Random(5)
        checked = 0
        for i, n in enumerate(LENGTHS):
            rid = f"one-gpu-{i}"
            grant = await peer.prefill(rid, [rng.randrange(1000) for _ in range(n)])
            with await pull_into(cache, peer, grant, transport=Transport.UCX, integrity=i % 2 == 1) as landed:
                differences, compared = landed_differences(pool, landed, rid, n)
                assert not differences, differences
                checked += compared
        free = (cache.free_blocks, cache.free_rings)
        occupied.release()
        conn.send(("ok", checked, len(node.ucx.address), info.interfaces, sorted(node.ucx.active_transports()),
                   os.environ.get("UCX_MEMTYPE_CACHE"), free))

    try:
        asyncio.run(main())
    except BaseException as exc:  # report the failure to the test, then leave
        conn.send(("error", repr(exc)))
    os._exit(0)


def test_gpu_memory_moves_over_ucx_on_one_gpu(capfd):
    p_conn, p_child = child_context(FRESH).Pipe()
    prefill = start_child(_prefill_proc, p_child, kind=FRESH)
    try:
        assert p_conn.poll(120), "prefill process did not start"
        port, prefill_transports, _ = p_conn.recv()
        d_conn, d_child = child_context(FRESH).Pipe()
        decode = start_child(_decode_proc, d_child, f"127.0.0.1:{port}", kind=FRESH)
        assert d_conn.poll(300), "decode process did not report"
        result = d_conn.recv()
        decode.join(30)
        assert result[0] == "ok", result
        _, checked, nbytes, interfaces, transports, memtype, free = result
        print(f"moved and checked {checked} bytes; decode worker address {nbytes} bytes, {interfaces} interfaces; "
              f"transports decode {transports}, prefill {prefill_transports}; UCX_MEMTYPE_CACHE={memtype}")
        assert checked > 0 and memtype == "n"
        assert free == (256 - 7, 8)  # every pull's allocation came back
        p_conn.send("stop")
        assert p_conn.poll(60)
        assert p_conn.recv() == (256, 8)  # the prefill node freed every grant
    finally:
        if prefill.is_alive():
            prefill.kill()
        prefill.join(10)
    output = capfd.readouterr()
    assert "unused environment variable" not in output.out + output.err
