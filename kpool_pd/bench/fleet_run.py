"""One fleet run: its phases and what each checks (``kpool-pd bench fleet`` and ``tests/e2e/test_fleet.py``).

1. Every prefill daemon starts, then every decode daemon with each policy in turn. Per policy, the
   workloads (``fleet_load.Workload``: skewed prompt lengths, and for the least-loaded policy the balanced
   set of the same mean beside it) run from ``clients`` concurrent clients. Every reply must equal the
   colocated run of its prompt byte for byte, no request may fail, and once the phase is over every node
   must hold nothing: free blocks and rings back to their idle counts, no grant held and nothing queued
   (the prefill nodes' own load reports), no lease expired.
2. Restart: under load (least-loaded), every prefill daemon is killed at once (SIGKILL) and started again on
   its ports. Each decode daemon must answer SERVING within ``recover_s`` of the last prefill daemon being
   ready, and only requests sent before the kill may fail; the replies that did not fail must still equal
   the colocated run, and every node must hold nothing afterwards.

``run_fleet`` returns the figures of every phase and the list of what failed its check (empty: all held).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kpool_pd.bench.fleet_load import Workload, drive, expected, summary
from kpool_pd.bench.fleet_nodes import Fleet, NodeSizes, check, until_serving
from kpool_pd.decode_worker.prefill_choice import PrefillPolicy
from kpool_pd.model import ModelConfig

logger = logging.getLogger(__name__)

SETTLE_S = 60.0  # how long a node may take to show what a phase freed (releases are sent in the background)
SETTLE_POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    """The size of a run: nodes, clients, requests per phase, the policies compared, the restart."""

    prefill: int = 8
    decode: int = 8
    clients: int = 32
    workload: Workload = field(default_factory=lambda: Workload(requests=10_000))
    policies: tuple[PrefillPolicy, ...] = (PrefillPolicy.ROUND_ROBIN, PrefillPolicy.LEAST_LOADED)
    balanced: bool = True  # also run the balanced workload beside the skewed one (least-loaded)
    restart_requests: int = 1_000  # 0: no restart phase
    kill_after: float = 0.3  # the share of the restart phase's requests answered before the kill
    recover_s: float = 5.0
    sizes: NodeSizes = field(default_factory=NodeSizes)
    config: ModelConfig = field(default_factory=lambda: ModelConfig.build(num_layers=2, num_spec=3, seed=3,
                                                                          block_size=128))

    def describe(self) -> dict:
        w = self.workload
        return {"prefill": self.prefill, "decode": self.decode, "clients": self.clients, "requests": w.requests,
                "distinct_prompts": w.distinct, "short_tokens": list(w.short), "long_tokens": list(w.long),
                "long_share": w.long_share, "max_tokens": w.max_tokens, "policies": [p.value for p in self.policies], "balanced": self.balanced,
                "restart_requests": self.restart_requests, "recover_s": self.recover_s,
                "health_interval_s": self.sizes.health_interval_s, "model": self.config.describe()}


class FleetRun:
    """The phases of one run over ``fleet``; ``problems`` collects every failed check in words."""

    def __init__(self, spec: FleetSpec, fleet: Fleet) -> None:
        self.spec, self.fleet = spec, fleet
        self.problems: list[str] = []
        self.phases: list[dict] = []
        self._idle: dict[str, tuple[float, float]] = {}

    async def _settled(self, phase: str) -> None:
        """Every node holds nothing (within ``SETTLE_S``), else a problem naming what is held."""
        deadline, held = time.monotonic() + SETTLE_S, ""
        while time.monotonic() < deadline:
            counts = await asyncio.to_thread(self.fleet.free_counts)
            held = "; ".join(f"{name} has {blocks:g} blocks, {rings:g} rings free of {self._idle[name]}"
                             for name, (blocks, rings) in counts.items() if (blocks, rings) != self._idle[name])
            loads = [(a, (await check(a))[1]) for a in self.fleet.prefill_addresses]
            held += "".join(f"; {a} reports {load}" for a, load in loads
                            if load is None or load.grants_held or load.queued_prompt_tokens)
            if not held:
                break
            await asyncio.sleep(SETTLE_POLL_S)
        if held:
            self.problems.append(f"{phase}: nodes still hold work: {held}")
        expired = await asyncio.to_thread(self.fleet.expired_leases)
        if expired:
            self.problems.append(f"{phase}: {expired:g} leases expired (grants nobody released)")

    async def _record_idle(self) -> None:
        self._idle = await asyncio.to_thread(self.fleet.free_counts)

    def _judge(self, phase: str, figures: dict, allowed_failures: int = 0) -> None:
        if figures["mismatched"]:
            self.problems.append(f"{phase}: {figures['mismatched']} replies differ from the colocated run")
        if figures["failed"] > allowed_failures:
            self.problems.append(f"{phase}: {figures['failed']} requests failed: {figures['errors']}")

    async def workload_phase(self, policy: PrefillPolicy, skewed: bool) -> dict:
        spec, fleet = self.spec, self.fleet
        name = f"{policy.value}/{'skewed' if skewed else 'balanced'}"
        prompts = spec.workload.prompts(spec.config, skewed)
        want = await asyncio.to_thread(expected, spec.config, prompts)
        before = await asyncio.to_thread(fleet.prefill_picks)
        replies = await drive(fleet.decode_addresses, prompts, spec.workload.requests, spec.clients,
                              tag=name.replace("/", "-"))
        after = await asyncio.to_thread(fleet.prefill_picks)
        figures = {"phase": name, **summary(replies, want),
                   "picks_per_prefill": sorted(after.get(a, 0) - before.get(a, 0) for a in fleet.prefill_addresses)}
        self._judge(name, figures)
        await self._settled(name)
        logger.info("%s", figures)
        self.phases.append(figures)
        return figures

    async def restart_phase(self) -> dict:
        """Kill every prefill daemon under load, start them again, time each decode daemon's recovery."""
        spec, fleet = self.spec, self.fleet
        prompts = spec.workload.prompts(spec.config, skewed=True)
        want = await asyncio.to_thread(expected, spec.config, prompts)
        load = asyncio.create_task(drive(fleet.decode_addresses, prompts, spec.restart_requests, spec.clients,
                                         tag="restart"))
        target = sum((await asyncio.to_thread(fleet.prefill_picks)).values()) + spec.kill_after * spec.restart_requests
        while not load.done() and sum((await asyncio.to_thread(fleet.prefill_picks)).values()) < target:
            await asyncio.sleep(0.05)
        killed = await asyncio.to_thread(fleet.kill_prefill)
        ready = await asyncio.to_thread(fleet.start_prefill)
        serving = await until_serving(fleet.decode_addresses, timeout_s=SETTLE_S)
        replies = await load
        late = [r for r in replies if r.error and r.sent >= killed]
        recover = {address: round(max(0.0, at - ready), 3) for address, at in serving.items()}
        figures = {"phase": "restart", **summary(replies, want),
                   "restart_s": round(ready - killed, 2), "decode_serving_after_ready_s": recover,
                   "failed_after_kill": len(late), "failed_in_flight": sum(1 for r in replies if r.error) - len(late)}
        if late:
            self.problems.append(f"restart: {len(late)} requests sent after the kill failed: "
                                 f"{sorted({r.error for r in late})[:3]}")
        slow = {a: s for a, s in recover.items() if s > spec.recover_s}
        if slow:
            self.problems.append(f"restart: decode daemons SERVING more than {spec.recover_s:g} s after the prefill "
                                 f"daemons were ready: {slow}")
        if figures["mismatched"]:
            self.problems.append(f"restart: {figures['mismatched']} replies differ from the colocated run")
        self._idle.update({d.name: (float(spec.sizes.prefill_blocks), float(spec.sizes.prefill_rings))
                           for d in fleet.prefill})
        await self._settled("restart")
        logger.info("%s", figures)
        self.phases.append(figures)
        return figures


async def _run(spec: FleetSpec, fleet: Fleet) -> FleetRun:
    run = FleetRun(spec, fleet)
    for k, policy in enumerate(spec.policies):
        if k:
            await asyncio.to_thread(fleet.stop_decode)
            await asyncio.to_thread(fleet.start_decode, policy)
        else:
            await asyncio.to_thread(fleet.start, policy)
        await until_serving(fleet.decode_addresses, timeout_s=SETTLE_S)
        await run._record_idle()
        if policy is PrefillPolicy.LEAST_LOADED and spec.balanced:
            await run.workload_phase(policy, skewed=False)
        await run.workload_phase(policy, skewed=True)
    if spec.restart_requests:
        await run.restart_phase()
    return run


def run_fleet(spec: FleetSpec, workdir: Path) -> tuple[list[dict], list[str]]:
    """Run every phase of ``spec`` on a fleet in ``workdir`` (logs there); (figures per phase, problems)."""
    fleet = Fleet(workdir, spec.config, spec.prefill, spec.decode, spec.sizes)
    try:
        run = asyncio.run(_run(spec, fleet))
    except BaseException:
        logger.error("the fleet run failed; its daemons' last lines:\n%s", fleet.log_tails())
        raise
    finally:
        fleet.close()
    return run.phases, run.problems


def skew_ratio(phases: Sequence[dict]) -> float | None:
    """p99 time to first token of the skewed workload over the balanced one, both least-loaded."""
    by = {p["phase"]: p for p in phases}
    skewed, balanced = by.get("least-loaded/skewed"), by.get("least-loaded/balanced")
    if not skewed or not balanced or not balanced["ttft_p99_ms"]:
        return None
    return round(skewed["ttft_p99_ms"] / balanced["ttft_p99_ms"], 3)
