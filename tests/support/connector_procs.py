"""Process bodies for the connector tests: a prefill node and a decode node, each in its own
process (``kpool_pd.runtime.launch``), talking over loopback; the caches they use. The prefill engines are
``tests.support.connector_engines``'s, the bytes they write and the decode side checks ``tests.support.connector_bytes``'s."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import replace

import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, Transport
from kpool_pd.connector.shared import regions  # fault injection: how the gRPC stream reads and writes a region's bytes
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheAllocation, CacheConfig, CacheFamily, CachePool, NodeCache
from tests.support.connector_bytes import expected_block, landed_differences, live_slots, mirror_pool, state_differences
from tests.support.connector_engines import ChunkedFillEngine, SeededFillEngine
from tests.support.deadlines import patient
from tests.support.pulls import pull_into
from tests.support.serving import serve_prefill, stop_prefill

CONFIG = CacheConfig(layer_names=("l0", "l1", "l2"), block_size=64, kpool=4, num_spec=3, mla_entry_bytes=64)
TOKEN = "s3cret-token"
# Two heads per page, so that the BLNHC and BLHNC orders store different bytes.
CONFIGS = {
    "kpool": CONFIG,
    "kpool-2heads": replace(CONFIG, mla_num_heads=2),
    "kpool2": replace(CONFIG, kpool=2, num_spec=0, block_size=128, mla_num_heads=2),
    "qsa-2heads": CacheConfig(family=CacheFamily.QSA, layer_names=("a", "b"), block_size=32, compress_ratio=4, num_spec=1,
                              mla_entry_bytes=32, mla_num_heads=2, qsa_num_heads=2, qsa_head_size=64),
}


def make_config(name: str = "kpool", order: str = "BLNHC") -> CacheConfig:
    return replace(CONFIGS[name], order=BlockOrder(order))


def _fragment(cache: NodeCache, rng: random.Random) -> list[CacheAllocation]:
    """Hold a random half of the blocks (one ringless allocation each) so that what is allocated next is
    not contiguous; returns what is held."""
    held = [cache.allocate("fragment", 1, ring=False) for _ in range(cache.num_blocks)]
    keep = set(rng.sample(range(len(held)), len(held) // 2))
    for index, allocation in enumerate(held):
        if index not in keep:
            allocation.release()
    return [held[index] for index in sorted(keep)]


def prefill_main(conn, *, lease_s: float, die: str | None = None, num_blocks: int = 96, num_rings: int = 8, seed: int = 1,
                 cache: str = "kpool", order: str = "BLNHC", chunk_tokens: int = 0, chunk_pause_s: float = 0.05) -> None:
    """Serve until told to stop; answer ("counts",) with (free blocks, free rings, grants held).
    ``chunk_tokens``: compute prompts in chunks of that many tokens, ``chunk_pause_s`` apart
    (``ChunkedFillEngine``; ("chunks",) is answered with its chunks computed and computations stopped);
    with ``die="between_chunks"`` the process exits after the second chunk."""
    async def main():
        layout = BlockLayout(make_config(cache, order))
        node_cache = NodeCache(layout, num_blocks=num_blocks, num_rings=num_rings)
        held = _fragment(node_cache, random.Random(seed))
        config = ConnectorConfig(lease_s=lease_s, peer_token=TOKEN, transfer_timeout_s=lease_s * 2)
        engine = SeededFillEngine(node_cache)
        if chunk_tokens:
            def exit_after_two(index: int) -> None:
                if die == "between_chunks" and index == 1:
                    os._exit(17)
            engine = ChunkedFillEngine(chunk_tokens, lambda: asyncio.sleep(chunk_pause_s), on_chunk=exit_after_two,
                                       cache=node_cache)
        config = replace(config, piece_tokens=max(chunk_tokens, 1))
        node = PrefillConnector(node_cache.pool, engine, engine_id="prefill-0", config=config,
                                registry=CollectorRegistry())
        if die == "grpc":  # fault injection: the process dies after its first chunk
            real, calls = regions.host_bytes, [0]

            def dying(view):
                calls[0] += 1
                if calls[0] > 1:
                    os._exit(17)
                return real(view)
            regions.host_bytes = dying
        server = await serve_prefill(node)
        port = server.port
        if die == "ucx":  # fault injection: the process dies while its UCX sends are in flight
            ucx = node._ucx
            real_send, started = ucx.send_on, []

            async def dying_send(ep, views, tag_base, **on):
                if not any(v.numel() for v in views):  # the Handshake's empty warm-up message
                    return await real_send(ep, views, tag_base, **on)
                if started:  # only the first region is sent: an eager send may land whole within the 2 ms
                    await asyncio.sleep(3600)
                started.append(asyncio.ensure_future(real_send(ep, views, tag_base, **on)))  # kept alive
                await asyncio.sleep(0.002)  # its send is in flight (or landed), the other regions not sent
                os._exit(17)
            ucx.send_on = dying_send
            real_post = ucx.post_send

            def dying_post(ep, view, tag, **on):  # a pull's sends are posted one region at a time
                if started:  # only the first region is sent
                    return asyncio.get_running_loop().create_future()  # never completes: the process dies first
                started.append(real_post(ep, view, tag, **on))
                # dies within this call, its first send posted (in flight): a timer of even 2 ms let a loaded machine
                # land the whole pull before the process died
                os._exit(17)
            ucx.post_send = dying_post
        conn.send(("port", port, node_cache.free_blocks, node_cache.free_rings))
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "counts":
                conn.send((node_cache.free_blocks, node_cache.free_rings, len(node.leases)))
            elif cmd[0] == "chunks":  # a chunked engine's: chunks computed, computations stopped before their end
                conn.send((engine.chunks_done, engine.stopped))
            elif cmd[0] == "stop":
                await stop_prefill(server, node)
                for allocation in held:
                    allocation.release()
                conn.send(("stopped", node_cache.free_blocks, node_cache.free_rings))
                return
    asyncio.run(main())
    os._exit(0)  # skip interpreter teardown of the UCX worker (peers may be gone)


class _NeverLanding:
    """Stands in for the UCX receives of a pull that posted none: they never complete, and
    retiring them finds them all pending (fault injection)."""

    def __init__(self, count: int) -> None:
        self.tags = [0] * count
        self.futures = [asyncio.get_running_loop().create_future() for _ in range(count)]

    def pending(self) -> list[int]:
        return []  # nothing was posted: nothing to retire

    async def wait(self) -> None:
        await asyncio.gather(*self.futures)


def decode_main(conn, *, address: str, transport: str, scenario: str, lease_s: float, seed: int = 2,
                cache: str = "kpool", order: str = "BLNHC", peer_order: str = "BLNHC") -> None:
    """Run one scenario against the prefill node at ``address``; send back a result dict."""
    async def main():
        layout = BlockLayout(make_config(cache, order))
        num_blocks = 128
        node_cache = NodeCache(layout, num_blocks=num_blocks, num_rings=8)
        pool = node_cache.pool
        rng = random.Random(seed)
        fragments = _fragment(node_cache, rng)  # the rest of the pool stays held: landed blocks are not contiguous
        start_free = (node_cache.free_blocks, node_cache.free_rings)
        t = Transport.parse(transport)
        config = ConnectorConfig(lease_s=lease_s, peer_token=TOKEN, transfer_timeout_s=patient(3),
                                 rpc_timeout_s=patient(3))
        node = await DecodeConnector(pool, engine_id=f"decode-{scenario}", config=config,
                                     registry=CollectorRegistry(), transports=(t,)).start()
        out: dict = {"start_free": start_free, "transfer_timeout_s": config.transfer_timeout_s}
        peer = await node.connect(address)
        if scenario == "roundtrip":
            checked = 0
            lengths = [1, 3, 4, 5, 63, 64, 65, 200, 256, 257, 700, 1000]
            for i, n in enumerate(lengths):
                rid = f"req-{transport}-{i}"
                grant = await peer.prefill(rid, [rng.randrange(50000) for _ in range(n)])
                with await pull_into(node_cache, peer, grant, transport=t, integrity=i % 2 == 0) as landed:
                    assert len(landed.block_ids) == CONFIG.blocks_for_tokens(n)
                    differences, compared = landed_differences(pool, landed, rid, n)
                    assert not differences, differences
                    checked += compared
                    out.setdefault("regions", []).append(landed.regions)
            out["checked_bytes"] = checked
            out["released_twice"] = await peer.release(grant.grant_id)  # already released by pull
            # A late pull after the lease ran out: NOT_FOUND, and nothing stays allocated here.
            grant = await peer.prefill("late", [1] * 100)
            await asyncio.sleep(lease_s * 1.6)
            try:
                await pull_into(node_cache, peer, grant, transport=t)
                out["late"] = "OK"
            except StatusError as exc:
                out["late"] = exc.code.name
            out["end_free"] = (node_cache.free_blocks, node_cache.free_rings)
        elif scenario == "order":  # the prefill node stores peer_order; compare through both sides' views
            peer_layout = BlockLayout(make_config(cache, peer_order))
            out["repacks"] = peer.repacks
            out["differences"], out["repacked"] = [], []
            for i, n in enumerate([1, 5, layout.config.block_size + 3, 5 * layout.config.block_size - 1]):
                rid = f"order-{transport}-{i}"
                grant = await peer.prefill(rid, [rng.randrange(50000) for _ in range(n)])
                with await pull_into(node_cache, peer, grant, transport=t, integrity=i % 2 == 0) as landed:
                    src = mirror_pool(peer_layout, rid, landed.grant.num_blocks)
                    out["differences"] += [f"{rid}: {d}" for d in state_differences(
                        pool, landed.block_ids, landed.ring_id, src, range(landed.grant.num_blocks), 0,
                        live_slots(layout.config, n), n)]
                    out["repacked"].append(landed.repacked)
            out["end_free"] = (node_cache.free_blocks, node_cache.free_rings)
        elif scenario == "failed_pulls_then_more":
            # Pulls that fail on our side after the receives were posted (or mid-stream), a
            # disconnect and new handshake, and more pulls from the same live prefill node in
            # between: each must land byte for byte.
            out["failed"], out["differences"] = [], []
            real_write_bytes = regions.write_bytes
            for i in range(3):
                grant = await peer.prefill(f"fail-{i}", [rng.randrange(50000) for _ in range(900 + 100 * i)])
                if t is Transport.UCX:
                    real = node.ucx.post_receives

                    def post_then_fail(*a, real=real):
                        real(*a)
                        raise RuntimeError("injected failure after posting the receives")
                    node.ucx.post_receives = post_then_fail
                else:
                    def fail_on_chunk(view, data):
                        raise RuntimeError("injected failure on a chunk")
                    regions.write_bytes = fail_on_chunk
                try:
                    await pull_into(node_cache, peer, grant, transport=t)
                    out["failed"].append("OK")
                except StatusError as exc:
                    out["failed"].append(exc.code.name)
                    await peer.release(grant.grant_id)  # as a decode worker does after a failed pull
                finally:  # back to the real receive and chunk paths
                    if node.ucx is not None:
                        vars(node.ucx).pop("post_receives", None)
                    regions.write_bytes = real_write_bytes
                if i == 1:  # as a router does when a health check failed: a new channel, a new handshake
                    await node.disconnect(peer)
                    peer = await node.connect(address)
                for j, n in enumerate([1, 300, 1200]):
                    rid = f"after-{i}-{j}"
                    grant = await peer.prefill(rid, [rng.randrange(50000) for _ in range(n)])
                    with await pull_into(node_cache, peer, grant, transport=t, integrity=True) as landed:
                        out["differences"] += [f"{rid} block {k}" for k, b in enumerate(landed.block_ids)
                                               if not torch.equal(pool.blocks[b], expected_block(layout, rid, k))]
            out["end_free"] = (node_cache.free_blocks, node_cache.free_rings)
        elif scenario in ("pipelined", "pipelined_decode_dies", "pipelined_prefill_dies"):
            # The prefill node computes in chunks: the pull starts before the prompt is computed.
            out["differences"], out["pipelined"] = [], []
            lengths = [700, 1, 257] if scenario == "pipelined" else [2000]
            for i, n in enumerate(lengths):
                rid = f"pipe-{transport}-{i}"
                prompt = [rng.randrange(50000) for _ in range(n)]
                out.setdefault("expected_first_tokens", []).append(sum(prompt) % 50000)  # SeededFillEngine's rule
                grant = await peer.prefill(rid, prompt, pipelined=True)
                out["pipelined"].append(grant.pipelined)
                if scenario == "pipelined_decode_dies":  # exit once the pull is under way, between two chunks
                    def die():
                        conn.send({"dying": True})
                        os._exit(17)
                    asyncio.get_running_loop().call_later(0.3, die)
                began = time.monotonic()
                try:
                    with await pull_into(node_cache, peer, grant, transport=t, integrity=i % 2 == 1) as landed:
                        differences, _ = landed_differences(pool, landed, rid, n)
                        out["differences"] += [f"{rid}: {d}" for d in differences]
                        out.setdefault("first_tokens", []).append(landed.first_token)
                        out.setdefault("times", []).append(landed.times)
                    out["error"] = None
                except StatusError as exc:
                    out["error"], out["message"] = exc.code.name, exc.message
                out["seconds"] = time.monotonic() - began
            out["end_free"] = (node_cache.free_blocks, node_cache.free_rings)
        elif scenario in ("decode_dies", "prefill_dies"):
            grant = await peer.prefill("victim", [7] * 2000)
            if scenario == "decode_dies":  # fault injection: exit while the prefill node sends
                if t is Transport.UCX:
                    def post_nothing_and_die(views, tag_base):
                        """Post no receive (so the prefill node's sends wait for ours), exit once
                        the Pull has reached the prefill node."""
                        def die():
                            conn.send({"dying": True})
                            os._exit(17)
                        asyncio.get_running_loop().call_later(0.5, die)
                        return _NeverLanding(len(views))
                    node.ucx.post_receives = post_nothing_and_die
                else:
                    def die_on_chunk(view, data):
                        conn.send({"dying": True})
                        os._exit(17)
                    regions.write_bytes = die_on_chunk
            began = time.monotonic()
            try:
                await pull_into(node_cache, peer, grant, transport=t)
                out["error"] = None
            except StatusError as exc:
                out["error"] = exc.code.name
                out["message"] = exc.message
            out["seconds"] = time.monotonic() - began
            out["end_free"] = (node_cache.free_blocks, node_cache.free_rings)
        await node.close()
        for allocation in fragments:
            allocation.release()
        conn.send(out)
    asyncio.run(main())
    os._exit(0)  # skip interpreter teardown of the UCX worker (peers may be gone)


def refusal_main(conn, *, address: str, what: str) -> None:
    """Handshake with a wrong layout or without the token; send back the status code and message."""
    async def main():
        config = CONFIG if what == "no_token" else CacheConfig(layer_names=("l0", "l1", "l2"), block_size=64, kpool=2,
                                                               num_spec=3, mla_entry_bytes=64)
        layout = BlockLayout(config)
        pool = CachePool(layout, num_blocks=4, num_rings=2)
        token = None if what == "no_token" else TOKEN
        node = DecodeConnector(pool, engine_id="decode-x",
                               config=ConnectorConfig(peer_token=token, rpc_timeout_s=patient(3)), registry=CollectorRegistry(),
                               transports=(Transport.GRPC_STREAM,))
        try:
            await node.connect(address)
            conn.send(("OK", ""))
        except StatusError as exc:
            conn.send((exc.code.name, exc.message))
        await node.close()
    asyncio.run(main())


def ucx_env_report(progress: str = "") -> None:
    """In a fresh process: make a UcxNode with the connector's default options (and ``ConnectorConfig.ucx_progress``
    named ``progress``, else its default), move one request over UCX between two connectors of this process, and
    print what UCX reports as one JSON line (prefixed ``UCX-REPORT``) on stdout."""
    import json

    from kpool_pd.connector import UcxProgress
    from tests.support.connector_harness import InProcessPair

    async def main():
        config = ConnectorConfig(peer_token=TOKEN, rpc_timeout_s=patient(10), transfer_timeout_s=patient(10),
                                 ucx_progress=UcxProgress[progress]) if progress else None
        async with InProcessPair(transports=(Transport.UCX,), config=config) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("env", [9] * 150)
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.UCX) as landed:
                same = all(torch.equal(pair.decode.pool.blocks[b], expected_block(pair.decode.pool.layout, "env", j))
                           for j, b in enumerate(landed.block_ids))
            ucx = pair.decode.ucx
            config = ucx.ucx_config()
            return {"tls": config.get("TLS"), "rndv_thresh": config.get("RNDV_THRESH"),
                    "zcopy_thresh": config.get("ZCOPY_THRESH"), "transports": sorted(ucx.active_transports()),
                    "progress": ucx.progress_mode, "bytes_equal": same, "freed": pair.free() == start}
    report = asyncio.run(asyncio.wait_for(main(), 30))
    print("UCX-REPORT " + json.dumps(report), flush=True)
    os._exit(0)  # skip interpreter teardown of the UCX worker
