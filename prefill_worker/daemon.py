"""`kpool-pd prefill`: the prefill daemon.

Start-up: build the cache and the model, warm up (one prefill through the engine), then serve
the connector's prefill side; only then does grpc.health.v1 report SERVING and the ready file
appear. SIGTERM drains: grpc.health.v1 turns NOT_SERVING and new prefills are refused
(UNAVAILABLE, so decode nodes try another), grants already handed out may be pulled until
released or for ``drain-s``, then the server stops and frees everything.
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
from connector.prefill import PrefillConnector
from connector.ucx import ucx_available
from connector.wire import Transport
from kvcache import BlockAllocator, BlockLayout, CachePool, RingAllocator
from model import Engine, PrefillJob
from model.service import default_engine_id, on_termination, start_metrics, write_ready_file
from model.settings import (MODEL_OPTIONS, Option, model_config, positive_int,
                            service_options)
from connector.daemon_tls import TLS_OPTIONS
from prefill_worker.batcher import BatchingPrefillEngine
from runtime.grpc_server import GrpcServer

logger = logging.getLogger(__name__)

OPTIONS: tuple[Option, ...] = (
    *service_options(port=50051, metrics_port=9401),
    *TLS_OPTIONS,
    *MODEL_OPTIONS,
    Option("num-blocks", positive_int, 512, "blocks in the cache pool"),
    Option("num-rings", positive_int, 64, "ring blocks (requests held at once)"),
    Option("max-prompt-tokens", positive_int, 8192, "longest prompt accepted"),
    Option("max-batch-tokens", positive_int, 16384, "prompt tokens per prefill batch"),
    Option("max-queue", positive_int, 64, "prefill calls waiting at most; more get RESOURCE_EXHAUSTED"),
)


def transports_of(text: str) -> tuple[Transport, ...]:
    """``auto``: UCX when ucxx imports, and the gRPC stream; else the comma-separated names."""
    if text == "auto":
        return (Transport.UCX, Transport.GRPC_STREAM) if ucx_available() else (Transport.GRPC_STREAM,)
    chosen = tuple(Transport.parse(name.strip()) for name in text.split(",") if name.strip())
    if not chosen:
        raise ValueError(f"transports must be auto or a comma-separated list of ucx and grpc, got {text!r}")
    if Transport.UCX in chosen and not ucx_available():
        raise ValueError("transport ucx asked for, but ucxx cannot be imported here (pip install 'kpool-pd[ucx]')")
    return chosen


async def serve(settings: dict, *, device: torch.device, tls: TlsConfig | None) -> None:
    config = model_config(settings)
    layout = BlockLayout(config.cache_config())
    pool = CachePool(layout, num_blocks=settings["num_blocks"], num_rings=settings["num_rings"], device=device)
    blocks, rings = BlockAllocator(pool.num_blocks), RingAllocator(pool.num_rings)
    engine = Engine(config, pool)
    registry = CollectorRegistry()
    batcher = BatchingPrefillEngine(engine, max_batch_tokens=settings["max_batch_tokens"],
                                    max_queue=settings["max_queue"], registry=registry)

    started = time.perf_counter()
    warm_blocks, warm_ring = blocks.allocate(1), rings.allocate("warm-up")
    prompt = [t % config.vocab_size for t in range(min(config.resolved_block_size, 2 * config.group + 1))]
    await asyncio.to_thread(engine.prefill, [PrefillJob(prompt=prompt, block_ids=warm_blocks, ring_id=warm_ring)])
    blocks.free(warm_blocks)
    rings.free("warm-up")
    logger.info("warmed up in %.0f ms", (time.perf_counter() - started) * 1000)

    connector_config = ConnectorConfig(
        lease_s=settings["lease_s"], bearer_token=settings["token"] or None,
        max_prompt_tokens=settings["max_prompt_tokens"], rpc_timeout_s=settings["rpc_timeout_s"],
        transfer_timeout_s=settings["transfer_timeout_s"], tls=tls,
    )
    engine_id = settings["engine_id"] or default_engine_id("prefill")
    node = PrefillConnector(pool, blocks, rings, batcher, engine_id=engine_id, config=connector_config,
                            registry=registry, transports=transports_of(settings["transports"]))
    server = GrpcServer(token=connector_config.bearer_token, tls=tls, options=connector_config.grpc_options())
    server.add(node)
    batch_task = asyncio.create_task(batcher.run(), name="prefill-batches")
    stop = asyncio.Event()
    on_termination(asyncio.get_running_loop(), lambda name: (logger.info("%s: draining", name), stop.set()))
    metrics_server = None
    try:
        await node.start()
        port = await server.start(settings["host"], settings["port"], health_port=settings["health_port"])
        await server.set_serving(True)
        metrics_server, metrics_port = start_metrics(settings["metrics_host"], settings["metrics_port"], registry)
        write_ready_file(settings["ready_file"], grpc_port=port, metrics_port=metrics_port,
                         health_port=server.health_port, engine_id=engine_id)
        logger.info("prefill node ready", extra={"grpc_port": port, "metrics_port": metrics_port,
                                                  "health_port": server.health_port, "tls": tls is not None,
                                                  "device": str(device), "model": config.describe(),
                                                  "layout_hash": layout.layout_hash})
        await stop.wait()
        batcher.draining = True
        await server.set_serving(False)
        deadline = time.monotonic() + settings["drain_s"]
        while (node.grants_held or not batcher.idle) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if node.grants_held:
            logger.warning("drain time is up with %d grants still held; freeing them", node.grants_held)
    finally:
        await server.stop(1.0)
        await node.stop()
        batch_task.cancel()
        await asyncio.gather(batch_task, return_exceptions=True)
        if metrics_server is not None:
            metrics_server.shutdown()
    logger.info("prefill node stopped; free: %d of %d blocks, %d of %d rings", blocks.num_free, blocks.num_blocks,
                rings.num_free, rings.num_rings)


def main(argv: Sequence[str] | None = None) -> int:
    return run_daemon("prefill", OPTIONS, serve, argv, description=__doc__.splitlines()[0])
