"""A bounded soak: 300 requests through a real prefill daemon and two decode daemons (one pulling
over UCX when it is installed, one over the gRPC stream), a quarter of them cancelled by their
client, aimed at every state of a request: waiting in the queue, prefilling, pulling, releasing
the grant, decoding. The prefill daemon (``tests.support.soak_prefill``) holds the requests aimed at
its steps there until the cancel has come; the decode daemons (``tests.support.soak_decode``) hold the one
aimed at decoding in their running batch until its cancel has come (a small request could finish
before a cancel reached a loaded node, and the cancel would count nothing).

At the end nothing is held anywhere: every block and ring is free again on all three daemons,
no reservation is left, and no lease expired (a lease of 120 s cannot run out here: only Releases
freed the grants, within a wait scaled with the machine's load, ``settle_s``); the cancels landed
in every state; every request that was not cancelled finished and equals the colocated run byte
for byte.

Rounds of 20 requests per decode daemon (``--max-running 3``): the three requests aimed at the
prefill node's steps go first and take every slot (the round waits until the decode node has
reserved their blocks); the one aimed at the queue follows and is cancelled once the decode node
counts it waiting (not after a fixed delay, which a loaded machine may outlast before the request
reached the node); the three are cancelled only after that, so that they keep every slot until it is
counted; the others queue behind them and run once the three are cancelled. On a machine so loaded
that a held request ends before the queued one is counted, that cancel lands in another state, which
the count by state allows for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import urllib.request
from dataclasses import dataclass

import grpc
import pytest

from kpool_pd.connector import open_channel, ucx_available
from kpool_pd.decode_worker import api
from kpool_pd.decode_worker.client import RequestFailed, generate_one
from kpool_pd.runtime.launch import Daemon, start_decode
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, RequestResult, make_prompts, run_colocated
from kpool_pd.runtime import model_flags, model_settings
from tests.support.deadlines import patient
from tests.support.paths import REPO
from tests.support.polling import wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = ModelConfig.build(num_spec=3, num_layers=2, seed=17)
TRANSPORTS = ["ucx", "grpc"] if ucx_available() else ["grpc"]
REQUESTS, ROUND = 300, 20
HELD = ("prefilling", "pulling", "releasing")  # held on the prefill node until cancelled
STATES = ("waiting", *HELD, "decoding")
HOLD_S = 2.0  # the prefill node's hold (tests.support.soak_prefill), the decode nodes' per step (tests.support.soak_decode)
CANCEL_HELD_S = 0.5  # a held request is cancelled this long after it was sent
SEEN_S = 30.0  # how long a round waits for the decode node to count its held and queued requests (idle; ``patient``)
MAX_RUNNING = len(HELD)
SETTLE_S = HOLD_S + 10.0  # on an idle machine (``settle_s`` scales it with the load)
LEASE_S = 120.0  # the prefill node's (--lease-s): past any settle_s, so only a Release can end a grant in time
READY_S = 120.0


@dataclass(frozen=True)
class Planned:
    request: GenerateRequest
    aim: str | None  # the state its cancel is aimed at; None: it runs to the end


def plan(transport: str, rounds: int, seed: int) -> list[list[Planned]]:
    """Rounds of ``ROUND`` requests: one aimed at each state, the rest run to the end. Small
    prompts (1 to 40 tokens) and few output tokens (64 for the one cancelled while decoding)."""
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        prompts = make_prompts(ROUND, 40, seed=seed * 1000 + r, vocab_size=CONFIG.vocab_size, max_tokens=8,
                               prefix=f"{transport}-{r}")
        planned = []
        for i, p in enumerate(prompts):
            aim = STATES[i] if i < len(STATES) else None
            request_id = f"{p.request_id}@{aim}" if aim else p.request_id
            max_tokens = 64 if aim == "decoding" else rng.randint(2, 8)
            planned.append(Planned(GenerateRequest(request_id=request_id, prompt=p.prompt[:rng.randint(1, 40)],
                                                   max_tokens=max_tokens), aim))
        out.append(planned)
    return out


async def until_counted(daemon: Daemon, gauge: str, at_least: float, at_most: float = float("inf"),
                        within_s: float | None = None) -> None:
    """Until the decode node's ``gauge`` reads ``at_least`` to ``at_most`` (AssertionError after ``within_s``,
    by default ``patient(SEEN_S)``)."""
    within_s = patient(SEEN_S) if within_s is None else within_s
    reached = await asyncio.to_thread(wait_for, lambda: at_least <= metrics(daemon)[gauge] <= at_most, within_s)
    assert reached, f"{daemon.name}: {gauge} stayed outside [{at_least}, {at_most}] for {within_s:.0f} s"


async def cancelled(stub: api.GenerateServiceStub, p: Planned, daemon: Daemon, queued: asyncio.Event) -> None:
    """Send ``p`` and cancel it where it is aimed: once the node counts it waiting (then ``queued``
    is set), after a delay (held on the prefill node), or after its second tokens."""
    r = p.request
    call = stub.Generate(api.GenerateRequest(request_id=r.request_id, prompt_token_ids=list(r.prompt),
                                             max_tokens=r.max_tokens), timeout=patient(60))
    if p.aim == "decoding":
        seen = 0
        async for response in call:
            seen += response.WhichOneof("event") == "tokens"
            if seen == 2:  # the first comes before the decode loop; the second from it
                break
    elif p.aim == "waiting":
        try:  # the held ones take every slot until it is counted: it queues
            await until_counted(daemon, "kpoolpd_decode_waiting", 1, within_s=SEEN_S)  # a probe: not stretched
        except AssertionError:  # a held one ended first (a very loaded machine): the cancel lands elsewhere
            pass
        finally:
            queued.set()
    else:  # held at its step: cancelled once the queued one was counted, so that it keeps its slot till then
        await asyncio.sleep(CANCEL_HELD_S)
        await asyncio.wait_for(queued.wait(), patient(2 * SEEN_S))
    call.cancel()
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        async for _ in call:
            pass


async def run_round(stub: api.GenerateServiceStub, planned: list[Planned], daemon: Daemon) -> list:
    async def finished(p: Planned):
        try:
            return await generate_one(stub, p.request, token=None, timeout_s=patient(60))
        except RequestFailed as exc:
            return exc

    queued = asyncio.Event()

    def start(p: Planned):
        return asyncio.ensure_future(finished(p) if p.aim is None else cancelled(stub, p, daemon, queued))
    await until_counted(daemon, "kpoolpd_decode_reserved_blocks", 0, 0)  # the last round's cancels are freed
    tasks = [start(p) for p in planned if p.aim in HELD]
    try:
        held_blocks = sum(CONFIG.cache.blocks_for_request(len(p.request.prompt), p.request.max_tokens)
                          for p in planned if p.aim in HELD)
        await until_counted(daemon, "kpoolpd_decode_reserved_blocks", held_blocks)  # they hold every slot now
        tasks += [start(p) for p in planned if p.aim == "waiting"]
        await asyncio.wait_for(queued.wait(), patient(2 * SEEN_S))  # it queued (and is cancelled): the rest queue behind it
        tasks += [start(p) for p in planned if p.aim not in (*HELD, "waiting")]
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [r for r in await asyncio.gather(*tasks) if r is not None]


async def drive(daemon: Daemon, rounds: list[list[Planned]]) -> list:
    async with open_channel(f"127.0.0.1:{daemon.port}", None) as channel:
        stub = api.GenerateServiceStub(channel)
        results = []
        for planned in rounds:
            results += await run_round(stub, planned, daemon)
        return results


def metrics(daemon: Daemon) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kpoolpd_"))}


def settle_s() -> float:
    """How long the daemons get to free everything once the clients are done: ``SETTLE_S`` times the
    machine's load per core now (a loaded machine answers the cancels' Releases late), short of a
    lease (a grant freed by its lease's end, not by a Release, is counted expired and fails the test)."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(SETTLE_S * max(1.0, load), LEASE_S - HOLD_S)


def held_counts(daemon: Daemon, role: str) -> tuple[float, float]:
    m = metrics(daemon)
    return m[f"kpoolpd_{role}_free_blocks"], m[f"kpoolpd_{role}_free_rings"]


def test_cancels_aimed_at_every_state_leave_nothing_held_and_the_rest_match_colocated(tmp_path):
    flags = model_flags(model_settings(CONFIG))
    env = {"PYTHONPATH": str(REPO), "KPOOLPD_SOAK_HOLD_S": str(HOLD_S)}
    prefill = Daemon("tests.support.soak_prefill", ["--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1",
                                            "--metrics-port", "0", "--num-blocks", "256", "--max-prompt-tokens", "64",
                                            "--lease-s", str(LEASE_S), "--log-format", "text", *flags],
                     tmp_path, "prefill", env=env)
    decodes: list[Daemon] = []
    try:
        prefill.wait_ready(READY_S)
        decodes = [start_decode(tmp_path, flags, [f"127.0.0.1:{prefill.port}"], name=f"decode-{t}", transport=t,
                                module="tests.support.soak_decode", env=env, extra=["--max-running", str(MAX_RUNNING), "--max-prompt-tokens", "64",
                                       "--max-new-tokens", "64", "--log-format", "text"]) for t in TRANSPORTS]
        per_decode = REQUESTS // ROUND // len(TRANSPORTS)
        rounds = {t: plan(t, per_decode + (i < REQUESTS // ROUND % len(TRANSPORTS)), seed=i + 1)
                  for i, t in enumerate(TRANSPORTS)}
        assert sum(len(r) for rs in rounds.values() for r in rs) == REQUESTS
        runs = [p.request for rs in rounds.values() for r in rs for p in r if p.aim is None]
        reference = {r.request_id: r for r in run_colocated(CONFIG, runs)}  # while the decode daemons warm up
        for d in decodes:
            d.wait_ready(READY_S)
        start = {d.name: held_counts(d, "decode") for d in decodes}
        prefill_start = held_counts(prefill, "prefill")

        async def everything():
            return await asyncio.gather(*(drive(d, rounds[t]) for d, t in zip(decodes, TRANSPORTS)))
        outcomes = asyncio.run(everything())

        assert wait_for(lambda: held_counts(prefill, "prefill") == prefill_start, settle_s()), \
            (held_counts(prefill, "prefill"), prefill_start, prefill.log_tail(20))
        for d in decodes:
            assert wait_for(lambda: held_counts(d, "decode") == start[d.name], settle_s()), d.log_tail(20)
            assert metrics(d)["kpoolpd_decode_reserved_blocks"] == 0
        assert metrics(prefill)["kpoolpd_prefill_leases_expired_total"] == 0

        landed = {state: sum(metrics(d).get(f'kpoolpd_decode_cancelled_total{{state="{state}"}}', 0) for d in decodes)
                  for state in STATES}
        aimed = REQUESTS // ROUND  # one per round and state
        assert all(landed[s] >= aimed // 2 for s in STATES), f"cancels by state: {landed} (aimed {aimed} each)"
        assert sum(landed.values()) == len(STATES) * aimed, landed

        for transport, results in zip(TRANSPORTS, outcomes):
            failed = [r for r in results if isinstance(r, RequestFailed)]
            assert not failed, f"{len(failed)} failed over {transport}: {failed[:3]}"
            assert {r.transport for r in results} == {transport}
            for r in results:
                want = reference[r.request_id]
                assert isinstance(r, RequestResult) and (r.tokens, r.output_digest, r.state_digest) == (
                    want.tokens, want.output_digest, want.state_digest), r.request_id
        assert sum(len(r) for r in outcomes) == len(runs)
    finally:
        for daemon in (*decodes, prefill):
            daemon.signal(signal.SIGTERM)
        for daemon in (*decodes, prefill):
            daemon.stop()
