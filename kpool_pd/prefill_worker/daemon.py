"""`kpool-pd prefill`: the prefill daemon.

Start-up: build the cache and the model, warm up (one prefill through the engine), then serve
the connector's prefill side; only then does grpc.health.v1 report SERVING and the ready file
appear. SIGTERM drains: grpc.health.v1 turns NOT_SERVING and new prefills are refused
(UNAVAILABLE, so decode nodes try another), grants already handed out may be pulled until
released or for ``drain-s``, then the server stops and frees everything.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kpool_pd.connector import PrefillConnector
from kpool_pd.kvcache import BlockLayout, NodeCache
from kpool_pd.model import Engine, PrefillJob
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine
from kpool_pd.runtime import (MODEL_OPTIONS, TLS_OPTIONS, DaemonSpec, NodeContext, Option, Role, cuda_graphs_serve,
                     model_config, parse_bool, positive_int, run_daemon, service_options)
from kpool_pd.runtime.load_report import NodeLoad
from kpool_pd.runtime.preflight import check_cache_memory

DEFAULT_MAX_BATCH_TOKENS = 2048
# Prefill steps of up to this many prompts replay a graph; a step of more (short prompts) runs eagerly.
GRAPH_PROMPTS = 16

OPTIONS: tuple[Option, ...] = (
    *service_options(grpc_port=50051, metrics_port=9401),
    *TLS_OPTIONS,
    *MODEL_OPTIONS,
    Option("num-blocks", positive_int, 512, "blocks in the cache pool"),
    Option("num-rings", positive_int, 64, "ring blocks (requests held at once)"),
    Option("max-prompt-tokens", positive_int, 8192, "longest prompt accepted"),
    Option("max-batch-tokens", positive_int, DEFAULT_MAX_BATCH_TOKENS,
           "prompt tokens per prefill step: longer prompts are prefilled in chunks across steps, shorter ones "
           "share a step"),
    Option("max-queue", positive_int, 64, "prefill calls waiting at most; more get RESOURCE_EXHAUSTED"),
    Option("cuda-graphs", parse_bool, True, "replay prefill steps of up to max-batch-tokens tokens in up to "
           f"{GRAPH_PROMPTS} prompts from CUDA graphs, padded to the next token count (powers of two from 256) and "
           "prompt count (CUDA devices, the kpool family; false: every step eager)"),
)


class PrefillNode:
    """The cache pool, the model behind a batching engine, and the connector's prefill side
    (the servicer). A drain waits until no grant is held and no batch is running."""

    def __init__(self, context: NodeContext) -> None:
        settings = context.settings
        self.config = model_config(settings)
        self.layout = BlockLayout(self.config.cache)
        self.cache = NodeCache(self.layout, num_blocks=settings["num_blocks"], num_rings=settings["num_rings"],
                               device=context.device)
        graphs = cuda_graphs_serve(settings, context.device)
        self.engine = Engine(self.config, self.cache.pool,
                             prefill_graph_tokens=settings["max_batch_tokens"] if graphs else 0,
                             prefill_graph_requests=GRAPH_PROMPTS,
                             graph_table_width=self.config.cache.blocks_for_tokens(settings["max_prompt_tokens"]))
        self.batcher = BatchingPrefillEngine(self.engine, self.cache, max_batch_tokens=settings["max_batch_tokens"],
                                             max_queue=settings["max_queue"], registry=context.registry)
        # a pipelined transfer moves blocks in pieces of a step's worth of tokens
        config = dataclasses.replace(context.connector_config, max_prompt_tokens=settings["max_prompt_tokens"],
                                     piece_tokens=settings["max_batch_tokens"])
        self.connector = PrefillConnector(self.cache.pool, self.batcher,
                                          engine_id=context.engine_id, config=config, registry=context.registry,
                                          transports=context.transports.offered, model_identity=self.config.identity())
        self.servicer = self.connector
        self._batches: asyncio.Task | None = None

    def warm_up(self) -> None:
        """One prefill of ``2 * group + 1`` tokens (at most a block) through the engine, whole and then in two
        chunks (the second starting inside a pool), so that both kernel variants are built before serving; then
        the prefill graphs of every prompt count, where steps replay them."""
        if self.engine.prefill_graphs is not None:
            self.engine.capture_prefill_graphs()
        config = self.config
        prompt = [t % config.vocab_size for t in range(min(config.cache.block_size, 2 * config.cache.tokens_per_entry + 1))]
        with self.cache.allocate("warm-up", 1) as held:
            self.engine.prefill([PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id)])
            cut = min(config.cache.tokens_per_entry + 1, len(prompt) - 1)  # inside the second pool (group)
            for start, end in ((0, cut), (cut, len(prompt))):
                self.engine.prefill([PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id,
                                                start=start, end=end)])

    async def start(self) -> None:
        await self.connector.start()
        self._batches = asyncio.create_task(self.batcher.run(), name="prefill-batches")

    def drain(self) -> None:
        self.batcher.draining = True

    @property
    def idle(self) -> bool:
        return not self.connector.grants_held and self.batcher.idle

    def leftover(self) -> str | None:
        held = self.connector.grants_held
        return f"{held} grants still held; freeing them" if held else None

    async def close(self) -> None:
        await self.connector.stop()
        if self._batches is not None:
            self._batches.cancel()
            await asyncio.gather(self._batches, return_exceptions=True)
            self._batches = None

    def load(self) -> NodeLoad:
        """What the health checks of decode nodes carry back (``runtime.load_report``): they send to the least
        loaded prefill node."""
        return NodeLoad(queued_prompt_tokens=self.batcher.queued_tokens, free_blocks=self.cache.free_blocks,
                        block_tokens=self.config.cache.block_size, steps_in_flight=self.batcher.steps_running,
                        grants_held=self.connector.grants_held)

    def describe(self) -> dict[str, object]:
        return {"model": self.config.describe(), "layout_hash": self.layout.layout_hash}


def check_resources(settings: Mapping[str, Any]) -> None:
    """The cache the settings ask for fits the memory free on the device (SettingsError naming num-blocks)."""
    layout = BlockLayout(model_config(settings).cache)
    check_cache_memory(settings, "num_blocks", layout, num_blocks=settings["num_blocks"],
                       num_rings=settings["num_rings"], device=settings["device"])


SPEC = DaemonSpec(role=Role.PREFILL, description=__doc__.splitlines()[0], options=OPTIONS, build=PrefillNode,
                  check=check_resources)


def main(argv: Sequence[str] | None = None) -> int:
    return run_daemon(SPEC, argv)
