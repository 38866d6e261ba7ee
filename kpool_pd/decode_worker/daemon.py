"""`kpool-pd decode`: the decode daemon, serving the public Generate API.

Start-up: build the cache and the model, warm up (one local prefill and decode step), connect
to the prefill nodes, then serve; the ready file appears only then, whether or not a prefill node
is usable yet (daemons may start in any order). grpc.health.v1 reports SERVING only while a
prefill node is usable and a request could get a ring (not every ring taken with the queue full);
NOT_SERVING otherwise, and again as soon as that ends. SIGTERM drains: health turns NOT_SERVING, new requests get UNAVAILABLE, requests in
flight finish (for at most ``drain-s``), then everything is freed and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kpool_pd.connector import DecodeConnector
from kpool_pd.decode_worker import dcp_api
from kpool_pd.decode_worker.capacity import largest_request_blocks, rank_cache_blocks
from kpool_pd.decode_worker.dcp_fetch import DcpLeader
from kpool_pd.decode_worker.dcp_options import DCP_OPTIONS, check_dcp, dcp_config
from kpool_pd.decode_worker.dcp_ranks import DcpRanks, rendezvous_dir
from kpool_pd.decode_worker.fetch import OneNode, PullChoice, RequestFetch
from kpool_pd.decode_worker.prefill_choice import PrefillPolicy
from kpool_pd.decode_worker.router import NO_NODE_WAIT_S, PrefillRouter, parse_targets
from kpool_pd.decode_worker.scheduler import DecodeScheduler
from kpool_pd.decode_worker.service import GenerateService
from kpool_pd.kvcache import BlockLayout, CacheFamily, NodeCache
from kpool_pd.model import DecodeSequence, Engine, PrefillJob
from kpool_pd.model.dcp_engine import DcpEngine
from kpool_pd.model.dcp_group import DcpGroup
from kpool_pd.runtime import (MODEL_OPTIONS, TLS_CLIENT_OPTIONS, TLS_OPTIONS, DaemonSpec, NodeContext, Option, Role,
                     cuda_graphs_serve, memory_fraction, model_config, nonnegative_int, parse_bool, positive_int,
                     pull_choice, seconds, seconds_or_off, run_daemon, service_options)
from kpool_pd.runtime.preflight import check_cache_memory

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 3  # output tokens of the warm-up request


def _targets(text: Any) -> str:
    """Parser of ``--prefill``: checks every address, returns the text."""
    parse_targets(str(text))
    return str(text)


OPTIONS: tuple[Option, ...] = (
    *service_options(grpc_port=50052, metrics_port=9402),
    *TLS_OPTIONS,
    *TLS_CLIENT_OPTIONS,
    *MODEL_OPTIONS,
    Option("prefill", _targets, "127.0.0.1:50051", "prefill nodes: host:port or dns:///name:port, comma-separated"),
    Option("transport", pull_choice, "auto", "data plane of pulls: ucx, grpc, or auto (ucx when both sides have it)",
           choices=("auto", "ucx", "grpc")),
    Option("integrity", parse_bool, False, "verify a crc32 of every transferred region"),
    Option("pipelined-transfer", parse_bool, True, "pull each prompt as its prefill runs: its blocks move while "
           "later chunks compute (false: pull once the prompt is computed)"),
    Option("cuda-graphs", parse_bool, True, "replay decode steps from CUDA graphs, one per padded batch size (CUDA "
           "devices, either family, DCP 1; false: every step eager)"),
    Option("max-running", positive_int, 16, "requests decoded at once (the batch)"),
    Option("max-queue", positive_int, 64, "requests waiting for room at most; more get RESOURCE_EXHAUSTED"),
    Option("queue-timeout-s", seconds_or_off, 0.0, "how long a request may wait for room before it fails "
           "DEADLINE_EXCEEDED (0: as long as its call's deadline allows)"),
    Option("max-prompt-tokens", positive_int, 4096, "longest prompt accepted"),
    Option("max-new-tokens", positive_int, 512, "most output tokens a request may ask for"),
    Option("num-blocks", nonnegative_int, 0, "blocks in the cache pool (0: from gpu-memory-fraction, or enough for "
           "max-running of the largest requests)"),
    Option("gpu-memory-fraction", memory_fraction, 0.0, "share of the GPU's memory this daemon may take, like vLLM's "
           "gpu_memory_utilization: the cache gets what is left after the memory in use, the rings and 1 GiB for the "
           "model and its graphs (0: the cache is sized from max-running; num-blocks wins)"),
    Option("health-interval-s", seconds, 2.0, "how often prefill nodes are health-checked and re-resolved (their "
           "load comes back on each check)"),
    Option("prefill-policy", PrefillPolicy.parse, PrefillPolicy.LEAST_LOADED, "how a request's prefill node is "
           "picked among the healthy ones: least-loaded (queued prompt tokens and free blocks as their health checks "
           "report, plus this node's picks since) or round-robin", choices=tuple(p.value for p in PrefillPolicy)),
    Option("prefill-wait-s", seconds, NO_NODE_WAIT_S, "how long a request waits for a usable prefill node before it "
           "fails UNAVAILABLE"),
    *DCP_OPTIONS,
)


def graph_requests(settings: Mapping[str, Any], device: torch.device) -> int:
    """The most requests a decode step replays from a CUDA graph: ``max-running`` where graphs serve the
    engine (``cuda_graphs_serve``, and one rank), 0 (eager) otherwise."""
    return settings["max_running"] if cuda_graphs_serve(settings, device, tuple(CacheFamily)) else 0


def check_settings(settings: Mapping[str, Any]) -> None:
    """The DCP options, then the memory of the cache the settings ask for (one per rank on the CPU)."""
    check_dcp(settings)
    option = next(o for o in ("num_blocks", "gpu_memory_fraction", "max_running") if settings[o])
    layout = BlockLayout(model_config(settings).cache)
    copies = settings["dcp"] if torch.device(settings["device"]).type == "cpu" else 1
    check_cache_memory(settings, option, layout, num_blocks=rank_cache_blocks(settings, settings["device"]),
                       num_rings=settings["max_running"], device=settings["device"], copies=copies)


class DecodeNode:
    """The cache pool and the model, the connector's decode side, the prefill router, the
    scheduler, and the Generate API (the servicer). A drain waits until no request is in flight."""

    def __init__(self, context: NodeContext) -> None:
        settings = context.settings
        self.config = model_config(settings)
        self.layout = BlockLayout(self.config.cache)
        max_running = settings["max_running"]
        dcp = dcp_config(settings)
        self.cache = NodeCache(self.layout, num_blocks=rank_cache_blocks(settings, context.device), num_rings=max_running,
                               device=context.device)
        self.ranks: DcpRanks | None = None
        self.leader: DcpLeader | None = None
        pulls = PullChoice(transport=context.transports.pull, integrity=settings["integrity"],
                           rpc_timeout_s=context.connector_config.rpc_timeout_s)
        self.fetch: RequestFetch  # how requests are fetched and stepped: chosen here, once
        self._watch: asyncio.Task | None = None
        if dcp.size > 1:  # start ranks 1..N-1, then join their group (which waits for them)
            self.ranks = DcpRanks(context, dcp, OPTIONS, rendezvous_dir())
            self.ranks.on_broken = self._broken
            try:
                group = DcpGroup.join(dcp.shard(0), init_method=self.ranks.rendezvous, device=context.device,
                                      timeout_s=settings["dcp_timeout_s"])
            except BaseException:  # no node to close: stop the ranks and remove their folder here
                self.ranks.kill()
                raise
            self.engine: Engine = DcpEngine(self.config, self.cache.pool, group)
            self.fetch = self.leader = DcpLeader(self.config.cache, pulls, dcp, self.ranks, context.engine_id)
        else:
            self.fetch = OneNode(self.config.cache, pulls, pipelined=settings["pipelined_transfer"])
            self.engine = Engine(self.config, self.cache.pool, graph_requests=graph_requests(settings, context.device),
                                 graph_table_width=largest_request_blocks(settings))
        self._settings = settings
        self.connector = DecodeConnector(self.cache.pool, engine_id=context.engine_id,
                                         config=context.connector_config, registry=context.registry,
                                         transports=context.transports.offered, model_identity=self.config.identity())
        self.router = PrefillRouter(self.connector, parse_targets(settings["prefill"]),
                                    health_interval_s=settings["health_interval_s"],
                                    rpc_timeout_s=settings["rpc_timeout_s"], tls=context.tls,
                                    no_node_wait_s=settings["prefill_wait_s"], policy=settings["prefill_policy"],
                                    registry=context.registry)
        self.scheduler = DecodeScheduler(self.engine, self.cache, self.connector, self.router, fetch=self.fetch,
                                         max_running=max_running, max_queue=settings["max_queue"],
                                         queue_timeout_s=settings["queue_timeout_s"], registry=context.registry)
        self.servicer = GenerateService(self.scheduler, max_prompt_tokens=settings["max_prompt_tokens"],
                                        max_new_tokens=settings["max_new_tokens"],
                                        step_timeout_s=settings["transfer_timeout_s"])
        self._loop: asyncio.Task | None = None
        self._health = context.health

    def _broken(self, why: str) -> None:
        """A DCP rank failed: the instance cannot step any more. Health turns NOT_SERVING for good and
        the daemon stops as after SIGTERM (the requests it holds fail and free everything first), so
        that the whole instance is restarted (a Deployment restarts the pod)."""
        self._report_health()
        logger.error("stopping: the DCP decode instance is broken (%s)", why)
        asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGTERM)

    @property
    def failure(self) -> str:
        """Why the node stopped by itself (a DCP rank broke the instance), or empty: the runtime then
        exits with status 1."""
        return self.ranks.broken if self.ranks is not None else ""

    def _report_health(self, _changed: bool | None = None) -> None:
        """Tell the runtime's health gate whether this node can serve a request now."""
        if self.ranks is not None and self.ranks.broken:
            self._health.set_able(False, f"the DCP decode instance is broken: {self.ranks.broken}")
        elif not self.router.usable:
            self._health.set_able(False, f"no prefill node is usable: {self.router.reasons()}")
        elif not self.scheduler.has_room:
            self._health.set_able(False, "no room: every ring is taken and the queue is full")
        else:
            self._health.set_able(True)

    def warm_up(self) -> None:
        """One local prefill of ``2 * group + 1`` tokens, then decode steps until 3 tokens, and the state digest;
        then the decode graphs of every batch size, where steps replay them. None with DCP: rank 0 runs no
        prefill, and a step needs every rank."""
        if self.leader is not None:
            return
        if self.engine.graphs is not None:
            self.engine.capture_graphs()
        config = self.config
        prompt = [t % config.vocab_size for t in range(2 * config.cache.tokens_per_entry + 1)]
        with self.cache.allocate("warm-up", config.cache.blocks_for_request(len(prompt), WARM_UP_TOKENS)) as held:
            first = self.engine.prefill([PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id)])[0]
            seq = DecodeSequence(request_id="warm-up", prompt_len=len(prompt), max_tokens=WARM_UP_TOKENS,
                                 allocation=held, output=[first])
            while not seq.finished:
                self.engine.decode_step([seq])
            self.engine.state_digest(seq.block_ids, seq.ring_id, seq.cached)

    def _rank_status(self) -> dcp_api.StatusResponse:
        """Rank 0's own line of the per-rank metrics."""
        return dcp_api.StatusResponse(rank=0, free_blocks=self.cache.free_blocks, num_blocks=self.cache.num_blocks,
                                      free_rings=self.cache.free_rings, num_rings=self.cache.num_rings,
                                      requests=self.scheduler.active(), steps=int(self.scheduler.steps_run),
                                      step_seconds=self.scheduler.step_seconds_total,
                                      transfer_bytes=self.scheduler.own_transfer_bytes)

    async def start(self) -> None:
        await self.connector.start()
        if self.ranks is not None:
            await self.ranks.connect(self._settings["dcp_timeout_s"])
            self._watch = asyncio.create_task(self.ranks.watch(self._settings["health_interval_s"], self._rank_status),
                                              name="dcp-watch")
        self._loop = asyncio.create_task(self.scheduler.run(), name="decode-loop")
        self.router.on_change = self.scheduler.on_room_change = self._report_health
        await self.router.start()

    def drain(self) -> None:
        self.servicer.draining = True

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def leftover(self) -> str | None:
        return None if self.scheduler.idle else f"{self.scheduler.active()} requests in flight; cancelling them"

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        self.scheduler.close()
        await self.router.close()
        await self.connector.close()
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self.ranks is not None:
            await self.ranks.close()
            if not self.ranks.broken:  # a failed group is not torn down: its peers are gone, and the process exits
                self.engine.group.leave()

    def describe(self) -> dict[str, object]:
        return {"prefill": self.router.healthy(), "model": self.config.describe(),
                "layout_hash": self.layout.layout_hash, "dcp": self.leader.dcp.size if self.leader else 1}


SPEC = DaemonSpec(role=Role.DECODE, description=__doc__.splitlines()[0], options=OPTIONS, build=DecodeNode,
                  check=check_settings)


def main(argv: Sequence[str] | None = None) -> int:
    return run_daemon(SPEC, argv)
