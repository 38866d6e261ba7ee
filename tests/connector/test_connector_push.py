"""PrefillPush in one event loop: the decode node posts its receives and sends its plan with the prompt, and the
prefill node sends each piece from the chunk that wrote it, with no message from the decode node after the
Prefill. The bytes equal a pull's (prefill blocks scattered or not, same layout or another block size); a chunk's
blocks land before the next chunk is computed; a cancel between the push and the prefill's end, and a
computation that fails with the push pre-posted, free everything on both sides; a plan that reaches beyond the
grant is refused before the engine runs."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, StatusError, Transport
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared import hops
from kpool_pd.connector.shared.wire import region_message
from kpool_pd.connector.shared.plan import PoolKind, Region
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import Pulled

TRANSPORTS = [pytest.param(Transport.GRPC_STREAM, id="grpc"), pytest.param(Transport.UCX, id="ucx")]
BLOCK = procs.CONFIG.block_size  # 64
CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5), piece_tokens=BLOCK)
WHOLE = replace(CONFIG, piece_tokens=64 * BLOCK)  # a prompt's blocks in one piece: one message


class Steps:
    """The engine's gate: each chunk waits for the test's ``go()``."""

    def __init__(self) -> None:
        self._allowed = asyncio.Semaphore(0)
        self.waiting = 0  # chunks waiting at the gate

    async def __call__(self) -> None:
        self.waiting += 1
        try:
            await asyncio.wait_for(self._allowed.acquire(), 60)  # beyond every test's own waits
        finally:
            self.waiting -= 1

    def go(self, chunks: int = 1) -> None:
        for _ in range(chunks):
            self._allowed.release()


async def soon(predicate, what: str, timeout_s: float = 10.0) -> None:
    async def check() -> bool:
        return predicate()
    await until(check, what, timeout_s)


def holding(pair: InProcessPair, request_id: str, block: int) -> bool:
    """Whether some block of the decode pool holds the prompt's block ``block`` (random bytes: never by chance)."""
    want = procs.expected_block(pair.decode.pool.layout, request_id, block)
    return any(bool((pair.decode.pool.blocks[b] == want).all()) for b in range(pair.decode.pool.num_blocks))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(90)))


async def push_into(pair: InProcessPair, peer, request_id: str, prompt: list[int], **options) -> Pulled:
    """The prompt's blocks and a ring allocated on the decode node, the push into them; released on failure."""
    allocation = pair.d_cache.allocate(request_id, pair.d_cache.config.blocks_for_tokens(len(prompt)))
    try:
        return Pulled(await peer.push(request_id, prompt, into=allocation, **options), allocation)
    except BaseException:
        allocation.release()
        raise


def scatter(pair: InProcessPair) -> list:
    """Hold every other block of the prefill pool, so that a prompt's blocks do not lie together there."""
    held = [pair.p_cache.allocate("hole", 1, ring=False) for _ in range(pair.p_cache.free_blocks)]
    for allocation in held[::2]:
        allocation.release()
    return held[1::2]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scattered", [False, True], ids=["together", "scattered"])
def test_a_push_lands_the_prompt_byte_for_byte_and_its_release_frees_both_nodes(transport, scattered):
    async def scenario():
        async with InProcessPair(config=WHOLE, transports=(transport,), num_blocks=40) as pair:
            holes = scatter(pair) if scattered else []
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.pushes
            n = 5 * BLOCK + 7
            prompt = [random.Random(n).randrange(1, 1000) for _ in range(n)]
            with await push_into(pair, peer, "p", prompt, transport=transport, integrity=True) as landed:
                differences, compared = procs.landed_differences(pair.decode.pool, landed, "p", n)
                assert not differences and compared > 0
                assert landed.first_token == sum(prompt) % 50000
                assert landed.grant.grant_id and landed.grant.num_blocks == 6
                assert landed.regions == 2  # the blocks in one message (gathered where they lie apart), the ring
                src = landed.grant.src_block_ids
                assert scattered == (list(src) != list(range(src[0], src[0] + len(src))))
                assert await peer.release(landed.grant.grant_id)
            await soon(lambda: pair.free() == start, "everything freed")
            for allocation in holes:
                allocation.release()
    run(scenario())


def test_a_push_from_another_block_size_lands_through_the_repack():
    async def scenario():
        decode_config = replace(procs.CONFIG, block_size=2 * BLOCK)
        async with InProcessPair(config=CONFIG, decode_config=decode_config, transports=(Transport.UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks and peer.pushes
            n = 4 * BLOCK + 3
            prompt = list(range(1, n + 1))
            with await push_into(pair, peer, "h", prompt) as landed:
                assert landed.repacked and landed.prompt_blocks == 3
                mirror = procs.mirror_pool(pair.prefill.pool.layout, "h", landed.grant.num_blocks)
                assert procs.state_differences(pair.decode.pool, landed.block_ids, landed.ring_id, mirror,
                                               range(landed.grant.num_blocks), 0, procs.live_slots(procs.CONFIG, n),
                                               n) == []
                assert await peer.release(landed.grant.grant_id)
            await soon(lambda: pair.free() == start, "everything freed")
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_chunk_pushes_its_blocks_before_the_next_is_computed(transport):
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(2 * BLOCK, steps)
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            n = 4 * BLOCK + 9  # 5 blocks: 2 chunks of 2 blocks, then a last chunk of 9 tokens
            prompt = list(range(1, n + 1))
            granted = []
            push = asyncio.ensure_future(push_into(pair, peer, "c", prompt, transport=transport,
                                                   on_granted=granted.append))
            for chunk in range(2):
                await soon(lambda: steps.waiting == 1, f"chunk {chunk} waiting for its go")
                steps.go()
                for block in (2 * chunk, 2 * chunk + 1):
                    await soon(lambda b=block: holding(pair, "c", b), f"block {block} landing")
                assert (push.done(), engine.chunks_done) == (False, chunk + 1)
                assert [g.request_id for g in granted] == ["c"] and granted[0].pipelined  # told once, mid-prompt
            assert not holding(pair, "c", 4), "the prompt's last block must wait for its last chunk"
            steps.go()
            with await push as landed:
                differences, _ = procs.landed_differences(pair.decode.pool, landed, "c", n)
                assert not differences and landed.first_token == sum(prompt) % 50000
                assert landed.grant.pipelined and landed.times.prefill_ms > 0 and landed.grant == granted[0]
                assert await peer.release(landed.grant.grant_id)
            await soon(lambda: pair.free() == start, "everything freed")
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cancel_between_the_push_and_the_prefills_end_frees_both_nodes(transport):
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(2 * BLOCK, steps)
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            push = asyncio.ensure_future(push_into(pair, peer, "x", list(range(1, 4 * BLOCK + 1)), transport=transport))
            await soon(lambda: steps.waiting == 1, "the first chunk waiting")
            steps.go()
            await soon(lambda: holding(pair, "x", 0), "the first chunk's block landing")
            push.cancel()
            with pytest.raises(asyncio.CancelledError):
                await push
            await soon(lambda: pair.free() == start, "both nodes freed")
            assert engine.stopped == 1 and len(pair.prefill.grants) == 0
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cancel_before_the_grant_frees_both_nodes_and_the_engine_allocates_nothing(transport):
    """The push is cancelled while the prompt waits for the engine (no block allocated, no grant yet): the
    decode node's receives are retired, the engine's call is cancelled, and nothing is held anywhere."""
    class Queued(procs.SeededFillEngine):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.gate, self.stopped = asyncio.Event(), asyncio.Event(), 0

        async def prefill(self, request, progress):
            self.entered.set()
            try:
                await asyncio.wait_for(self.gate.wait(), 60)  # queued behind other prompts
            except asyncio.CancelledError:
                self.stopped += 1
                raise
            return await super().prefill(request, progress)

    async def scenario():
        engine = Queued()
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            granted = []
            push = asyncio.ensure_future(push_into(pair, peer, "q", list(range(1, 3 * BLOCK + 1)), transport=transport,
                                                   on_granted=granted.append))
            await asyncio.wait_for(engine.entered.wait(), 30)
            push.cancel()
            with pytest.raises(asyncio.CancelledError):
                await push
            await soon(lambda: pair.free() == start and engine.stopped == 1, "both nodes freed, the engine stopped")
            assert granted == [] and len(pair.prefill.grants) == 0
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_that_fails_with_the_push_pre_posted_frees_both_nodes(transport):
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(BLOCK, steps, fail_after=1)
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            push = asyncio.ensure_future(push_into(pair, peer, "f", list(range(1, 3 * BLOCK + 1)), transport=transport))
            steps.go(2)
            with pytest.raises(StatusError) as failed:
                await push
            assert failed.value.code is grpc.StatusCode.INTERNAL and "injected failure" in failed.value.message
            await soon(lambda: pair.free() == start, "both nodes freed")
            assert len(pair.prefill.grants) == 0
    run(scenario())


def test_a_plan_beyond_the_grant_is_refused_before_the_engine_runs():
    async def scenario():
        calls = []

        class Counting(procs.SeededFillEngine):
            async def prefill(self, request, progress):
                calls.append(request.request_id)
                return await super().prefill(request, progress)

        async with InProcessPair(engine=Counting(), config=CONFIG, transports=(Transport.GRPC_STREAM,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            layout = pair.prefill.pool.layout
            n = 2 * BLOCK  # two blocks: a region of three reaches beyond the grant
            beyond = Region(PoolKind.BLOCKS, 0, 3 * layout.block_bytes)
            request = pb.PushRequest(prefill=pb.PrefillRequest(request_id="b", prompt_token_ids=list(range(1, n + 1)),
                                                               engine_id=pair.decode.engine_id,
                                                               engine_secret=pair.decode.secrets.get(pair.address)),
                                     transport=Transport.GRPC_STREAM.value, regions=[region_message(beyond)])
            call = pb.PrefillServiceStub(peer._channel).PrefillPush(request, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "pushed region 0" in refused.value.details() and "whole blocks of the grant's 2" in refused.value.details()
            assert calls == [] and pair.free() == start
    run(scenario())


def test_a_node_that_does_not_offer_the_push_is_pulled_from_as_before(monkeypatch):
    """A prefill node without PrefillPush (an earlier build: no ``push`` in its Handshake) gets Prefill and Pull."""
    async def scenario():
        async with InProcessPair(config=CONFIG, transports=(Transport.UCX,)) as pair:
            answer = pair.prefill.handshakes.answer

            async def without_push(request, context):
                response = await answer(request, context)
                response.push = False
                return response
            monkeypatch.setattr(pair.prefill.handshakes, "answer", without_push)
            peer = await pair.decode.connect(pair.address)
            assert not peer.pushes
            allocation = pair.d_cache.allocate("o", 2)
            with pytest.raises(ValueError, match="takes no push"):
                await peer.push("o", list(range(1, BLOCK + 1)), into=allocation)
            allocation.release()
    run(scenario())


def test_a_push_is_stamped_from_its_prompt_written_to_its_last_receive():
    """The hops a push's exposed time is read off (the transfer bench's one clock): the prefill node's ``prompt``,
    its sends, and the decode node's ``received`` once the last of its receives (one a piece) completed."""
    async def scenario():
        recorder = hops.HopRecorder().install()
        try:
            async with InProcessPair(config=CONFIG, transports=(Transport.UCX,), num_blocks=40) as pair:
                peer = await pair.decode.connect(pair.address)
                n = 4 * BLOCK + 5
                with await push_into(pair, peer, "s", list(range(1, n + 1))) as landed:
                    assert landed.regions == 6  # five one-block pieces and the ring: six receives
                    stamps = {**recorder.stamps.get("push-s", {}), **recorder.stamps[landed.grant.grant_id]}
                    assert await peer.release(landed.grant.grant_id)
        finally:
            recorder.uninstall()
        assert {"prompt", "send", "completed", "received"} <= set(stamps), " ".join(sorted(stamps))
        assert stamps["prompt"] <= stamps["send"] <= stamps["received"]
        assert stamps["received"] <= stamps["returned"]
    run(scenario())
