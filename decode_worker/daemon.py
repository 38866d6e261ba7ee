"""`kpool-pd decode`: the decode daemon, serving the public Generate API.

Start-up: build the cache and the model, warm up (one local prefill and decode step), connect
to the prefill nodes, then serve; grpc.health.v1 reports SERVING and the ready file appears
only then. SIGTERM drains: health turns NOT_SERVING, new requests get UNAVAILABLE, requests in
flight finish (for at most ``drain-s``), then everything is freed and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import torch
from prometheus_client import CollectorRegistry

from connector.daemon_main import run_daemon
from connector.config import ConnectorConfig, TlsConfig
from connector.decode import DecodeConnector
from connector.ucx import ucx_available
from connector.wire import Transport
from decode_worker.router import PrefillRouter, parse_targets
from decode_worker.scheduler import DecodeScheduler
from decode_worker.service import GenerateService
from kvcache import BlockAllocator, BlockLayout, CachePool, RingAllocator
from model import DecodeSequence, Engine, PrefillJob
from model.service import default_engine_id, on_termination, start_metrics, write_ready_file
from runtime.grpc_server import GrpcServer
from model.settings import (MODEL_OPTIONS, Option, model_config, parse_bool,
                            positive_float, positive_int, service_options)
from connector.daemon_tls import TLS_CLIENT_OPTIONS, TLS_OPTIONS

logger = logging.getLogger(__name__)

OPTIONS: tuple[Option, ...] = (
    *service_options(port=50052, metrics_port=9402),
    *TLS_OPTIONS,
    *TLS_CLIENT_OPTIONS,
    *MODEL_OPTIONS,
    Option("prefill", str, "127.0.0.1:50051", "prefill nodes: host:port or dns:///name:port, comma-separated"),
    Option("transport", str, "auto", "data plane of pulls: ucx, grpc, or auto (ucx when both sides have it)"),
    Option("integrity", parse_bool, False, "verify a crc32 of every transferred region"),
    Option("max-running", positive_int, 16, "requests decoded at once (the batch)"),
    Option("max-queue", positive_int, 64, "requests waiting for room at most; more get RESOURCE_EXHAUSTED"),
    Option("queue-timeout-s", positive_float, 60.0, "how long a request may wait for room"),
    Option("max-prompt-tokens", positive_int, 4096, "longest prompt accepted"),
    Option("max-new-tokens", positive_int, 512, "most output tokens a request may ask for"),
    Option("num-blocks", int, 0, "blocks in the cache pool (0: enough for max-running of the largest requests)"),
    Option("health-interval-s", positive_float, 2.0, "how often prefill nodes are health-checked and re-resolved"),
)


def _transports(settings: dict) -> tuple[tuple[Transport, ...], Transport | None]:
    """(what this node can receive with, what its pulls ask for; None: UCX when the peer has it)."""
    offered = settings["transports"]
    if offered == "auto":
        receive = (Transport.UCX, Transport.GRPC_STREAM) if ucx_available() else (Transport.GRPC_STREAM,)
    else:
        receive = tuple(Transport.parse(t.strip()) for t in offered.split(",") if t.strip())
    choice = settings["transport"]
    pull = None if choice == "auto" else Transport.parse(choice)
    if pull is not None and pull not in receive:
        if pull is Transport.UCX and not ucx_available():
            raise ValueError("transport ucx asked for, but ucxx cannot be imported here (pip install 'kpool-pd[ucx]')")
        receive = receive + (pull,)
    return receive, pull


def _warm_up(engine: Engine, blocks: BlockAllocator, rings: RingAllocator) -> None:
    config = engine.config
    prompt = [t % config.vocab_size for t in range(2 * config.group + 1)]
    block_ids, ring_id = blocks.allocate(config.blocks_for(len(prompt), 3)), rings.allocate("warm-up")
    try:
        first = engine.prefill([PrefillJob(prompt=prompt, block_ids=block_ids, ring_id=ring_id)])[0]
        seq = DecodeSequence(request_id="warm-up", prompt_len=len(prompt), max_tokens=3, block_ids=block_ids,
                             ring_id=ring_id, output=[first])
        while not seq.finished:
            engine.decode_step([seq])
        engine.state_digest(seq.block_ids, seq.ring_id, seq.cached)
    finally:
        blocks.free(block_ids)
        rings.free("warm-up")


async def serve(settings: dict, *, device: torch.device, tls: TlsConfig | None) -> None:
    config = model_config(settings)
    layout = BlockLayout(config.cache_config())
    max_running = settings["max_running"]
    num_blocks = settings["num_blocks"] or max_running * config.blocks_for(settings["max_prompt_tokens"],
                                                                           settings["max_new_tokens"])
    pool = CachePool(layout, num_blocks=num_blocks, num_rings=max_running, device=device)
    blocks, rings = BlockAllocator(pool.num_blocks), RingAllocator(pool.num_rings)
    engine = Engine(config, pool)
    started = time.perf_counter()
    await asyncio.to_thread(_warm_up, engine, blocks, rings)
    logger.info("warmed up in %.0f ms", (time.perf_counter() - started) * 1000)

    registry = CollectorRegistry()
    receive, pull = _transports(settings)
    engine_id = settings["engine_id"] or default_engine_id("decode")
    connector_config = ConnectorConfig(
        lease_s=settings["lease_s"], bearer_token=settings["token"] or None,
        rpc_timeout_s=settings["rpc_timeout_s"], transfer_timeout_s=settings["transfer_timeout_s"], tls=tls,
    )
    connector = await DecodeConnector(pool, blocks, rings, engine_id=engine_id, config=connector_config,
                                      registry=registry, transports=receive).start()
    router = PrefillRouter(connector, parse_targets(settings["prefill"]),
                           health_interval_s=settings["health_interval_s"], rpc_timeout_s=settings["rpc_timeout_s"],
                           tls=tls)
    scheduler = DecodeScheduler(engine, blocks, rings, connector, router, max_running=max_running,
                                max_queue=settings["max_queue"], transport=pull, integrity=settings["integrity"],
                                queue_timeout_s=settings["queue_timeout_s"], registry=registry)
    service = GenerateService(scheduler, max_prompt_tokens=settings["max_prompt_tokens"],
                              max_new_tokens=settings["max_new_tokens"],
                              step_timeout_s=settings["transfer_timeout_s"], engine_id=engine_id)
    server = GrpcServer(token=connector_config.bearer_token, tls=tls, options=connector_config.grpc_options())
    server.add(service)
    loop_task = asyncio.create_task(scheduler.run(), name="decode-loop")
    stop = asyncio.Event()
    on_termination(asyncio.get_running_loop(), lambda name: (logger.info("%s: draining", name), stop.set()))
    metrics_server = None
    try:
        await router.start()
        port = await server.start(settings["host"], settings["port"], health_port=settings["health_port"])
        metrics_server, metrics_port = start_metrics(settings["metrics_host"], settings["metrics_port"], registry)
        await server.set_serving(True)
        write_ready_file(settings["ready_file"], grpc_port=port, metrics_port=metrics_port,
                         health_port=server.health_port, engine_id=engine_id)
        logger.info("decode node ready", extra={"grpc_port": port, "metrics_port": metrics_port,
                                                 "health_port": server.health_port, "tls": tls is not None,
                                                 "device": str(device), "prefill": router.healthy(),
                                                 "model": config.describe(), "layout_hash": layout.layout_hash})
        await stop.wait()
        service.draining = True
        await server.set_serving(False)
        deadline = time.monotonic() + settings["drain_s"]
        while not scheduler.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not scheduler.idle:
            logger.warning("drain time is up with %d requests in flight; cancelling them", scheduler.active())
    finally:
        await server.stop(1.0)
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        await router.close()
        await connector.close()
        if metrics_server is not None:
            metrics_server.shutdown()
    logger.info("decode node stopped; free: %d of %d blocks, %d of %d rings", blocks.num_free, blocks.num_blocks,
                rings.num_free, rings.num_rings)


def main(argv: Sequence[str] | None = None) -> int:
    return run_daemon("decode", OPTIONS, serve, argv, description=__doc__.splitlines()[0])
