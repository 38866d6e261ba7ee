"""What a pipelined transfer exposes, and when it is handed over. A UCX push without integrity ends once its bytes
landed and its first token is known (PrefillDone): the prefill node's PullDone, which states nothing the decode
node checks, follows in the background, so a PullDone held back does not hold the push. With integrity the push
waits for PullDone's checksums. PrefillDone states the prefill node's times from the prompt's end, so the exposed
time ends at the last byte landed here, and a prompt whose bytes all landed before it ended exposes no more than
PrefillDone's own way here."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kpool_pd.connector import ConnectorConfig, Transport, ucx_available
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.outbound import OutboundPull, SendClock
from tests.support import connector_procs as procs
from tests.support.connector_engines import ChunkedFillEngine
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import Pulled

pytestmark = pytest.mark.skipif(not ucx_available(), reason="needs ucxx")
BLOCK = procs.CONFIG.block_size
CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5),
                         piece_tokens=64 * BLOCK)


async def _yield() -> None:
    await asyncio.sleep(0)  # a chunk's compute hands the loop on: the grant is made before the prompt's end


def _chunked() -> ChunkedFillEngine:
    """An engine whose prompt is computed in chunks of a block, so that a push's grant is made before its end
    (a pipelined grant, whose PrefillDone states the times)."""
    return ChunkedFillEngine(BLOCK, _yield)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(90)))


class HeldPullDone:
    """Holds every PullDone on the prefill node until ``let_go()``; ``reached`` is set when one is held."""

    def __init__(self, monkeypatch) -> None:
        self.reached, self._gate = asyncio.Event(), asyncio.Event()
        real = OutboundPull.messages

        async def held(pull: OutboundPull):
            async for message in real(pull):
                if isinstance(message, pb.PullResponse) and message.WhichOneof("message") == "done":
                    self.reached.set()
                    await self._gate.wait()
                yield message
        monkeypatch.setattr(OutboundPull, "messages", held)

    def let_go(self) -> None:
        self._gate.set()


async def _push(pair: InProcessPair, peer, request_id: str, n: int, **options) -> Pulled:
    allocation = pair.d_cache.allocate(request_id, pair.d_cache.config.blocks_for_tokens(n))
    try:
        return Pulled(await peer.push(request_id, [3] * n, into=allocation, transport=Transport.UCX, **options),
                      allocation)
    except BaseException:
        allocation.release()
        raise


@contextlib.asynccontextmanager
async def _pushing_pair(monkeypatch):
    """(PullDone held on the prefill node, a pair computing prompts in chunks, a decode peer, the free counts at start)."""
    held = HeldPullDone(monkeypatch)
    async with InProcessPair(engine=_chunked(), config=CONFIG, transports=(Transport.UCX,), num_blocks=40) as pair:
        start = pair.free()
        yield held, pair, await pair.decode.connect(pair.address), start


def test_a_push_is_handed_over_once_landed_while_its_pull_done_is_held(monkeypatch):
    async def main():
        async with _pushing_pair(monkeypatch) as (held, pair, peer, start):
            n = 3 * BLOCK + 5
            with await _push(pair, peer, "early", n) as landed:  # PullDone is still held on the prefill node
                assert not held._gate.is_set() and landed.grant.pipelined
                differences, compared = procs.landed_differences(pair.decode.pool, landed, "early", n)
                assert not differences and compared > 0
                assert landed.first_token == (3 * n) % 50000
                times = landed.times
                assert times.exposed_transfer_ms >= 0 and times.transfer_ms > 0, times
                assert times.exposed_transfer_ms < landed.seconds * 1000, (times, landed.seconds)
                held.let_go()
                assert await peer.release(landed.grant.grant_id)
            await until(_check(lambda: pair.free() == start), "everything freed", 10)
    run(main())


def test_a_push_with_integrity_waits_for_the_checksums_of_pull_done(monkeypatch):
    async def main():
        async with _pushing_pair(monkeypatch) as (held, pair, peer, start):
            push = asyncio.ensure_future(_push(pair, peer, "checked", 2 * BLOCK, integrity=True))
            await asyncio.wait_for(held.reached.wait(), patient(10))  # every send completed, PullDone held
            for _ in range(20):  # the decode node's receives complete, its loop turns: the push still waits
                await asyncio.sleep(0)
            assert not push.done()
            held.let_go()
            with await push as landed:
                assert procs.landed_differences(pair.decode.pool, landed, "checked", 2 * BLOCK)[0] == []
                assert await peer.release(landed.grant.grant_id)
            await until(_check(lambda: pair.free() == start), "everything freed", 10)
    run(main())


def _check(predicate):
    async def check() -> bool:
        return predicate()
    return check


def test_prefill_done_states_the_sends_so_far_once_and_their_exposure():
    clock = SendClock()
    t = 100.0
    clock.start(0, t)
    clock.add(0, t, t + 0.002)          # [0, 2] ms
    clock.start(1, t + 0.001)
    clock.add(1, t + 0.001, t + 0.004)  # [1, 4] ms: overlaps the first
    assert clock.busy_until_ms(t + 0.009) == pytest.approx(4)
    assert clock.exposed_ms(t + 0.003, t + 0.009) == pytest.approx(1)  # all done: up to the last send's end
    assert clock.exposed_ms(t + 0.005, t + 0.009) == 0.0  # all done before the prompt's end
    clock.start(2, t + 0.006)           # still running at PrefillDone, 9 ms
    assert clock.busy_until_ms(t + 0.009) == pytest.approx(4 + 3)
    assert clock.exposed_ms(t + 0.005, t + 0.009) == pytest.approx(4)  # up to now
    assert clock.busy_ms == pytest.approx(4)
