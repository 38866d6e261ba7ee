"""The transfer benchmark's connector rows (``kpool_pd.bench.transfer`` prints them beside its baselines): pulls
between a decode node and one or two prefill nodes, each node in a process of its own (``kpool_pd.runtime.launch``),
timed from ``pull`` (or, for a push, from the prompt's end) to the last byte landed, with each row's phases, UCX
messages per pull and, with --hops, the hop stamps of both nodes.

A push's time is read off the one clock both processes share: from the prefill node's ``prompt`` stamp (its
engine said the prompt is written) to the decode node's ``received`` (every receive's completion reached its
loop). ``TransferTimes.exposed_transfer_ms``, which a decode node on another host reports, leaves PrefillDone's
way across out; its median goes in the row beside (``stated_ms``)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time

import torch
from prometheus_client import CollectorRegistry

from kpool_pd.bench.pull_hops import hop_offsets, thread_work
from kpool_pd.connector import (HopRecorder, StepCountingLoop, ConnectorConfig, DecodeConnector, LandedRequest,
                                PrefillConnector, PrefillInput, PrefillOutput, PrefillPeer, PrefillProgress, PullTimeline,
                                Transport)
from kpool_pd.kvcache import BlockLayout, CacheConfig, NodeCache
from kpool_pd.runtime import GrpcServer
from kpool_pd.runtime.launch import child_context, start_child


PHASES = tuple(f.name.removesuffix("_ms") for f in dataclasses.fields(PullTimeline))  # post, wire, completion, verify


def bench_config(layers: int, block_size: int, kpool: int) -> CacheConfig:
    return CacheConfig(layer_names=tuple(f"layer.{i}" for i in range(layers)), block_size=block_size, kpool=kpool, num_spec=3)


class _TemplateEngine:
    """Fills a request's blocks, allocated from its node cache, from a random template (the fill is not timed),
    after a modelled compute time of ``compute_s`` a prompt: the time a real engine's kernels take, during which its
    loop runs on (a push's grant is made and its sends wait on the prompt, as behind a real prefill; with no such time
    the prompt would be written before the grant is made, and a push's exposed time would count the grant's making).
    ``chunk_tokens`` > 0 writes the prompt in chunks of that many tokens, each after its share of the time, and says
    so after each (``progress.advance``), as a chunked prefill does: a push's pieces then move while the later chunks
    compute, and its exposed time is what the last chunk leaves. 0: the whole prompt at once."""

    def __init__(self, cache: NodeCache, template: torch.Tensor, compute_s: float, chunk_tokens: int = 0) -> None:
        self.cache, self.template, self.compute_s, self.chunk_tokens = cache, template, compute_s, chunk_tokens

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        n = len(request.prompt_token_ids)
        config = self.cache.config
        allocation = self.cache.allocate(request.request_id, config.blocks_for_tokens(n))
        progress.serve_from(allocation)
        pool, ids = self.cache.pool, list(allocation.block_ids)
        step = self.chunk_tokens or n
        written = 0  # blocks filled so far
        for start in range(0, n, step):
            end = min(start + step, n)
            await asyncio.sleep(self.compute_s * (end - start) / n)  # this chunk's share of the compute
            upto = config.blocks_for_tokens(end)
            pool.blocks[ids[written:upto]] = self.template[written:upto]
            written = upto
            if pool.device.type == "cuda":  # the bytes must be written before UCX reads them
                torch.cuda.synchronize(pool.device)
            progress.advance(end)
        return PrefillOutput(prompt_len=n, first_token=0)


def _prefill_proc(conn, args: dict) -> None:
    recorder = HopRecorder().install()  # a push's exposed time is read off its stamps

    async def main():
        config = bench_config(args["layers"], args["block_size"], args["kpool"])
        layout = BlockLayout(config)
        device = args["prefill_device"]
        cache = NodeCache(layout, num_blocks=args["num_blocks"], num_rings=4, device=device)
        template = torch.randint(0, 256, (args["num_blocks"], layout.block_bytes), dtype=torch.uint8, device=device)
        transports = (Transport.UCX, Transport.GRPC_STREAM) if args["ucx"] else (Transport.GRPC_STREAM,)
        config = ConnectorConfig(transfer_timeout_s=120, rpc_timeout_s=120, ucx_options=tuple(args["ucx_options"]),
                                 piece_tokens=args["piece_tokens"])
        node = PrefillConnector(cache.pool, _TemplateEngine(cache, template, args["prefill_ms"] / 1000,
                                                                 args["prefill_chunk"]),
                                engine_id="bench-prefill", config=config,
                                registry=CollectorRegistry(), transports=transports)
        await node.start()  # UCX first, then the server's threads (see runtime.daemon.serve)
        server = GrpcServer(options=config.grpc_options())
        server.add(node)
        await server.set_serving(True)
        conn.send(await server.start("127.0.0.1", 0))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)
        # the pulls are over; the node's stop may take long
        conn.send((recorder.stamps, recorder.steps))
        await server.stop(0)
        await node.stop()
    with asyncio.Runner(loop_factory=StepCountingLoop if args["hops"] else None) as runner:  # --hops: count steps
        runner.run(main())
    os._exit(0)


# the connector --------------------------------------------------------------------------------
@dataclasses.dataclass
class _Series:
    """The pulls of one row: from one prefill node, over one transport, of one request size."""
    path: str
    peer: PrefillPeer  # the decode node's peer of that prefill node
    transport: Transport
    times: list[float] = dataclasses.field(default_factory=list)
    timelines: list[PullTimeline] = dataclasses.field(default_factory=list)
    starts: dict[str, float] = dataclasses.field(default_factory=dict)  # grant id -> when its timed pull began
    landed: LandedRequest | None = None  # the last pull's
    push: bool = False  # PrefillPush: the time is what the transfer exposes after the prompt
    stated: list[float] = dataclasses.field(default_factory=list)  # a push's exposed time as TransferTimes states it
    push_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # grant id -> the push's stamp key before it


def _start_prefill(args: dict, ucx_options: tuple, block_size: int, transports: tuple[Transport, ...]):
    """A prefill process of ``block_size``-token blocks; (its process, its pipe, its gRPC port)."""
    blocks = bench_config(1, block_size, args["kpool"]).blocks_for_tokens(max(args["tokens"])) + 2
    conn, child = child_context().Pipe()
    proc = start_child(_prefill_proc, child, dict(
        layers=args["layers"], block_size=block_size, kpool=args["kpool"], num_blocks=blocks,
        ucx=Transport.UCX in transports, prefill_device=args["prefill_device"], ucx_options=ucx_options,
        hops=args["hops"], prefill_ms=args["prefill_ms"], prefill_chunk=args["prefill_chunk"],
        piece_tokens=push_piece_tokens(args["prefill_chunk"], args["tokens"])))
    return proc, conn, conn.recv()


def push_piece_tokens(prefill_chunk: int, tokens: list[int]) -> int:
    """The prefill node's piece size, as ``kpool-pd prefill-worker`` sets it: a step's worth of prompt tokens (its
    chunk), so that a push's pieces move as the chunks are written; a prompt computed whole (``prefill_chunk`` 0)
    is one piece, however long (one message, where pieces of the default size would cut it into many)."""
    return prefill_chunk or max(tokens)


async def _push_once(series: _Series, cache: NodeCache, tokens: int, rep: int) -> None:
    """One push of ``tokens`` tokens (PrefillPush): its time is what it exposes after the prompt was computed,
    from the grant stating it (or its PrefillDone) to the last byte landed (``TransferTimes``)."""
    request_id = f"t{tokens}-{series.path}-{rep}"
    with cache.allocate(request_id, cache.config.blocks_for_tokens(tokens)) as allocation:
        t0 = time.perf_counter()
        landed = await series.peer.push(request_id, [1] * tokens, into=allocation, transport=series.transport)
        if cache.pool.device.type == "cuda":
            torch.cuda.synchronize(cache.pool.device)
        if rep:  # the decode node stamps a push by its request until the grant is known
            key = series.push_keys[landed.grant.grant_id] = f"push-{request_id}"
            series.starts[landed.grant.grant_id] = series.starts[key] = t0
            series.stated.append(landed.times.exposed_transfer_ms / 1000)
            series.timelines.append(landed.timeline)
        series.landed = landed
        await series.peer.release(landed.grant.grant_id)


async def _pull_once(series: _Series, cache: NodeCache, tokens: int, rep: int) -> None:
    """One pull of ``tokens`` tokens for ``series`` (rep 0 warms up and is not kept)."""
    if series.push:
        return await _push_once(series, cache, tokens, rep)
    grant = await series.peer.prefill(f"t{tokens}-{series.path}-{rep}", [1] * tokens)
    with cache.allocate(grant.request_id, cache.config.blocks_for_tokens(grant.prompt_len)) as allocation:
        t0 = time.perf_counter()
        landed = await series.peer.pull(grant, into=allocation, transport=series.transport, release=False)
        if cache.pool.device.type == "cuda":
            torch.cuda.synchronize(cache.pool.device)
        elapsed = time.perf_counter() - t0
        if rep:
            series.starts[grant.grant_id] = t0
            series.times.append(elapsed)
            series.timelines.append(landed.timeline)
        series.landed = landed
        await series.peer.release(grant.grant_id)


async def _connector_rows(args: dict, ucx_options: tuple, transports: tuple[Transport, ...], suffix: str) -> list[dict]:
    """The rows of one UCX configuration: pulls from a prefill node of our block size over ``transports``, and
    with ``args["prefill_block_size"]`` also over UCX (the gRPC stream without ucxx) from a second prefill node of
    that block size (staging and repack). The two nodes' pulls alternate, rep by rep, in this one decode
    process, so that what drifts over the run (the host's load, its clocks) weighs on both alike."""
    config = bench_config(args["layers"], args["block_size"], args["kpool"])
    layout = BlockLayout(config)
    other = args.get("prefill_block_size") or args["block_size"]
    recorder = HopRecorder().install()
    prefills = [_start_prefill(args, ucx_options, args["block_size"], transports)]
    hetero = (Transport.UCX if Transport.UCX in transports else Transport.GRPC_STREAM,)
    if other != args["block_size"]:
        prefills.append(_start_prefill(args, ucx_options, other, hetero))
    cache = NodeCache(layout, num_blocks=config.blocks_for_tokens(max(args["tokens"])) + 2, num_rings=4,
                      device=args["decode_device"])
    node = await DecodeConnector(cache.pool, engine_id="bench-decode",
                                 config=ConnectorConfig(transfer_timeout_s=120, rpc_timeout_s=120, ucx_options=ucx_options),
                                 registry=CollectorRegistry(), transports=transports).start()
    peers = [await node.connect(f"127.0.0.1:{port}") for _, _, port in prefills]
    measured: list[tuple[int, _Series]] = []
    for tokens in args["tokens"]:
        series = [_Series(f"connector {t.label}{suffix}", peers[0], t) for t in transports]
        if Transport.UCX in transports and peers[0].pushes:
            series.append(_Series(f"connector ucx{suffix} push", peers[0], Transport.UCX, push=True))
        if len(peers) > 1:
            series += [_Series(f"connector {t.label}{suffix} from {other}", peers[1], t) for t in hetero]
        for rep in range(args["reps"] + 1):
            for one in series:
                await _pull_once(one, cache, tokens, rep)
        measured += [(tokens, one) for one in series]
    await node.close()
    prefill_stamps, prefill_steps = [], []
    for proc, conn, _ in prefills:  # the prefill nodes' stamps come once they stop
        conn.send("stop")
        stamps, steps = conn.recv() if conn.poll(30) else ({}, {})
        prefill_stamps.append(stamps)
        prefill_steps.append(steps)
        proc.join(30)
    rows = []
    for tokens, one in measured:
        if one.push:
            one.times = push_exposed_s(one.push_keys, recorder.stamps, *prefill_stamps)
        seconds = max(statistics.median(one.times), 1e-9) if one.times else float("nan")
        messages = one.landed.regions if one.transport is Transport.UCX else None  # a tagged message a region
        row = {"tokens": tokens, "layers": args["layers"], "bytes": one.landed.nbytes, "path": one.path,
               "gbps": one.landed.nbytes / seconds / 1e9, "ms": seconds * 1e3, "regions": one.landed.regions,
               "messages": messages,
               "phases_ms": {name: round(statistics.median(getattr(t, f"{name}_ms") for t in one.timelines), 3)
                             for name in PHASES}}
        if one.push:
            row["stated_ms"] = round(statistics.median(one.stated) * 1e3, 3)
        if args["hops"]:
            row["hops_ms"] = hop_offsets(one.starts, recorder.stamps, *prefill_stamps)
            row["prefill_steps"] = loop_steps(one.starts, "read", "send", *prefill_steps)
            if (work := thread_work(one.starts, recorder.stamps, recorder.cpu, "prepared", "repacked")) is not None:
                row["repack_op"] = work  # the repack's public op in the decode process: wall and its thread's CPU
        rows.append(row)
    return rows


def push_exposed_s(push_keys: dict[str, str], decode: dict[str, dict[str, float]],
                   *prefill: dict[str, dict[str, float]]) -> list[float]:
    """Each push's exposed time in seconds, on the one clock of both processes: from the prefill node's ``prompt``
    stamp to the decode node's ``received`` (under the grant's id or, stamped before the grant came, the push's
    key: ``push_keys`` maps the one to the other), for the pushes that have both stamps."""
    times = []
    for grant_id, key in push_keys.items():
        prompt = next((p[grant_id]["prompt"] for p in prefill if "prompt" in p.get(grant_id, {})), None)
        received = [decode[k]["received"] for k in (grant_id, key) if "received" in decode.get(k, {})]
        if prompt is not None and received:
            times.append(max(0.0, min(received) - prompt))
    return times


def _decode_proc(conn, args: dict, ucx_options: tuple, transports: tuple, suffix: str) -> None:
    rows = asyncio.run(_connector_rows(args, tuple(ucx_options), tuple(Transport(t) for t in transports), suffix))
    conn.send(rows)
    os._exit(0)  # skip the UCX worker's teardown (its peer is gone)


def connector_rows(args: dict, ucx_options: tuple, transports: tuple[Transport, ...], suffix: str = "") -> list[dict]:
    """Rows for each transport and request size, from a fresh decode process and prefill process."""
    conn, child = child_context().Pipe()
    # not a daemon: it starts the prefill process
    proc = start_child(_decode_proc, child, args, ucx_options, tuple(t.value for t in transports), suffix, daemon=False)
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the decode benchmark process exited with {proc.exitcode} before sending its rows")
    rows = conn.recv()
    proc.join(60)
    return rows


def loop_steps(starts: dict[str, float], first: str, last: str, *steps: dict[str, dict[str, int]]) -> int | None:
    """Median loop steps the pulls of ``starts`` took from hop ``first`` to hop ``last`` on a node that counted
    them (``HopRecorder.steps``), or None where none was counted."""
    counts = [process[g][last] - process[g][first] for g in starts for process in steps
              if first in process.get(g, {}) and last in process.get(g, {})]
    return round(statistics.median(counts)) if counts else None
