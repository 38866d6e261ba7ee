"""A fleet of the project's own daemons on one host: ``prefill`` prefill daemons and ``decode`` decode daemons
on loopback (CPU, the tiny synthetic model), every decode daemon listing every prefill daemon. Prefill
daemons keep their ports across a restart (the decode daemons keep dialing the same addresses); decode
daemons can be replaced by others with another ``--prefill-policy``.

What the fleet reads of its nodes: grpc.health.v1 (SERVING, and a prefill node's load report from its
trailing metadata, ``runtime.load_report``), and the ``/metrics`` counters of free blocks and rings,
requests sent per prefill node and expired leases.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kpool_pd.decode_worker.prefill_choice import PrefillPolicy
from kpool_pd.model import ModelConfig
from kpool_pd.runtime import model_flags, model_settings
from kpool_pd.runtime.launch import Daemon, start_decode, start_prefill
from kpool_pd.runtime.load_report import NodeLoad
from kpool_pd.runtime.ports import spare_ports

logger = logging.getLogger(__name__)

READY_S = 300.0  # a daemon's start on a loaded machine, sixteen at once
CHECK_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class NodeSizes:
    """Each daemon's flags beyond the model: cache and queue sizes, health interval, waits."""

    prefill_blocks: int = 256
    prefill_rings: int = 64
    prefill_queue: int = 256
    decode_running: int = 16
    decode_queue: int = 256
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 64
    health_interval_s: float = 0.5
    prefill_wait_s: float = 60.0
    drain_s: float = 5.0

    def prefill_flags(self) -> list[str]:
        return ["--num-blocks", str(self.prefill_blocks), "--num-rings", str(self.prefill_rings),
                "--max-queue", str(self.prefill_queue), "--max-prompt-tokens", str(self.max_prompt_tokens),
                "--drain-s", str(self.drain_s), "--log-format", "text", "--log-level", "WARNING"]

    def decode_flags(self, policy: PrefillPolicy) -> list[str]:
        return ["--max-running", str(self.decode_running), "--max-queue", str(self.decode_queue),
                "--max-prompt-tokens", str(self.max_prompt_tokens), "--max-new-tokens", str(self.max_new_tokens),
                "--health-interval-s", str(self.health_interval_s), "--prefill-wait-s", str(self.prefill_wait_s),
                "--prefill-policy", policy.value, "--drain-s", str(self.drain_s), "--log-format", "text",
                "--log-level", "WARNING"]


def _metric_values(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """The samples of ``/metrics`` whose line starts with one of ``names`` (by the full sample text)."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(names):
            sample, _, value = line.rpartition(" ")
            values[sample] = float(value)
    return values


def _wait_all_ready(daemons: list[Daemon]) -> None:
    for daemon in daemons:
        daemon.wait_ready(READY_S)


class Fleet:
    """``start`` every daemon at once (or ``start_prefill``, ``start_decode``); ``close`` stops everything
    (idempotent). The prefill daemons' ports are chosen up front, so that decode daemons can list them
    before they are up (a decode daemon serves once one is)."""

    def __init__(self, workdir: Path, config: ModelConfig, prefill: int, decode: int, sizes: NodeSizes) -> None:
        if prefill < 1 or decode < 1:
            raise ValueError(f"a fleet needs at least one node of each role, got {prefill} prefill, {decode} decode")
        self.workdir, self.config, self.sizes = workdir, config, sizes
        self.num_prefill, self.num_decode = prefill, decode
        self.model = model_flags(model_settings(config))
        self.prefill: list[Daemon] = []
        self.decode: list[Daemon] = []
        ports = spare_ports(2 * prefill)
        self._ports = list(zip(ports[::2], ports[1::2]))  # each prefill daemon's (grpc, metrics) port, for good
        self.restarts = 0

    @property
    def prefill_addresses(self) -> list[str]:
        return [f"127.0.0.1:{grpc_port}" for grpc_port, _ in self._ports]

    @property
    def decode_addresses(self) -> list[str]:
        return [f"127.0.0.1:{d.port}" for d in self.decode]

    def _launch_prefill(self) -> None:
        self.prefill = [start_prefill(self.workdir, self.model, name=f"prefill-{i}-{self.restarts}",
                                      extra=[*self.sizes.prefill_flags(), "--port", str(grpc_port), "--metrics-port",
                                             str(metrics_port)])
                        for i, (grpc_port, metrics_port) in enumerate(self._ports)]

    def _launch_decode(self, policy: PrefillPolicy) -> None:
        self.decode = [start_decode(self.workdir, self.model, self.prefill_addresses, name=f"decode-{i}-{policy.value}",
                                    transport="grpc", extra=self.sizes.decode_flags(policy))
                       for i in range(self.num_decode)]

    def start(self, policy: PrefillPolicy) -> None:
        """Start every daemon at once and wait until each is ready."""
        self._launch_prefill()
        self._launch_decode(policy)
        _wait_all_ready(self.prefill + self.decode)

    def start_prefill(self) -> float:
        """Start every prefill daemon at once on its ports; the time (monotonic) when the last one was ready."""
        self._launch_prefill()
        _wait_all_ready(self.prefill)
        return time.monotonic()

    def start_decode(self, policy: PrefillPolicy) -> None:
        """Start every decode daemon at once, each listing every prefill daemon."""
        self._launch_decode(policy)
        _wait_all_ready(self.decode)

    def kill_prefill(self) -> float:
        """SIGKILL every prefill daemon at once (a crash of them all); the time (monotonic) of the kill."""
        killed = time.monotonic()
        for daemon in self.prefill:
            daemon.signal(signal.SIGKILL)
        for daemon in self.prefill:
            daemon.stop()
        self.restarts += 1
        return killed

    def stop_decode(self) -> None:
        _stop_all(self.decode)
        self.decode = []

    def close(self) -> None:
        _stop_all(self.decode + self.prefill)
        self.decode, self.prefill = [], []

    def log_tails(self, lines: int = 20) -> str:
        return "\n".join(f"--- {d.name} ---\n{d.log_tail(lines)}" for d in self.prefill + self.decode)

    # what the fleet reads of its nodes -------------------------------------------------------------
    def free_counts(self) -> dict[str, tuple[float, float]]:
        """Each daemon's free blocks and rings, by name."""
        counts = {}
        for daemon in self.prefill + self.decode:
            role = "prefill" if daemon in self.prefill else "decode"
            values = _metric_values(daemon.metrics_port, (f"kpoolpd_{role}_free_",))
            counts[daemon.name] = (values[f"kpoolpd_{role}_free_blocks"], values[f"kpoolpd_{role}_free_rings"])
        return counts

    def expired_leases(self) -> float:
        """Leases that ran out on the prefill daemons now running (a grant nobody released)."""
        return sum(_metric_values(d.metrics_port, ("kpoolpd_prefill_leases_expired_total",)).get(
            "kpoolpd_prefill_leases_expired_total", 0.0) for d in self.prefill)

    def prefill_picks(self) -> dict[str, float]:
        """Requests sent to each prefill address, summed over the decode daemons."""
        picks: dict[str, float] = {}
        for daemon in self.decode:
            for sample, value in _metric_values(daemon.metrics_port, ("kpoolpd_decode_prefill_picks_total",)).items():
                address = sample.split('prefill="', 1)[1].split('"', 1)[0]
                picks[address] = picks.get(address, 0.0) + value
        return picks


def _stop_all(daemons: list[Daemon]) -> None:
    """SIGTERM all at once (they drain in parallel), then wait for each."""
    for daemon in daemons:
        daemon.signal(signal.SIGTERM)
    for daemon in daemons:
        daemon.stop()


async def check(address: str) -> tuple[bool, NodeLoad | None]:
    """Whether ``address`` answers SERVING, and the load report its answer carried (None: none or no answer)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT_S)
        try:
            reply = await call
            return reply.status == health_pb2.HealthCheckResponse.SERVING, NodeLoad.from_metadata(
                await call.trailing_metadata())
        except grpc.aio.AioRpcError:
            return False, None


async def until_serving(addresses: list[str], timeout_s: float, period_s: float = 0.05) -> dict[str, float]:
    """Each address's first SERVING answer (monotonic time), polling every ``period_s``; TimeoutError naming the
    ones still not SERVING after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline, serving = loop.time() + timeout_s, {}
    while len(serving) < len(addresses):
        for address in addresses:
            if address not in serving and (await check(address))[0]:
                serving[address] = time.monotonic()
        if loop.time() > deadline and len(serving) < len(addresses):
            missing = [a for a in addresses if a not in serving]
            raise TimeoutError(f"not SERVING within {timeout_s:g} s: {missing}")
        await asyncio.sleep(period_s)
    return serving
