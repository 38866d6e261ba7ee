"""Pipelined pulls in one event loop, with a prefill engine the test steps chunk by chunk: the pieces a
chunk completes land on the decode node before the next chunk is computed; the ring and the first token
come after the last one; a computation that fails mid-prompt, a pull cancelled mid-prompt and a grant
released mid-prompt each free everything on the prefill node, and leave the decode node's allocation to
its caller (who releases it: then both nodes are free)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, StatusError, Transport
from kpool_pd.connector.shared.plan import plan_transfer, ring_live_range
from kpool_pd.kvcache import BlockLayout
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import allocation_for, pull_into

TRANSPORTS = [pytest.param(Transport.GRPC_STREAM, id="grpc"), pytest.param(Transport.UCX, id="ucx")]
BLOCK = procs.CONFIG.block_size  # 64
CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5), piece_tokens=BLOCK)


class Steps:
    """The engine's gate: each chunk waits for the test's ``go()``."""

    def __init__(self) -> None:
        self._allowed = asyncio.Semaphore(0)

    async def __call__(self) -> None:
        await asyncio.wait_for(self._allowed.acquire(), 60)  # beyond every test's own waits

    def go(self, chunks: int = 1) -> None:
        for _ in range(chunks):
            self._allowed.release()


def holding(pair: InProcessPair, request_id: str, block: int) -> bool:
    """Whether some block of the decode pool holds the prompt's block ``block`` (random bytes: never by chance)."""
    want = procs.expected_block(pair.decode.pool.layout, request_id, block)
    return any(bool((pair.decode.pool.blocks[b] == want).all()) for b in range(pair.decode.pool.num_blocks))


async def soon(predicate, what: str, timeout_s: float = 10.0) -> None:
    async def check() -> bool:
        return predicate()
    await until(check, what, timeout_s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


def test_plan_pieces_split_runs_at_multiples_of_the_piece():
    layout = BlockLayout(procs.CONFIG)
    whole = plan_transfer(layout, list(range(10)), list(range(20, 30)), 0, 1, ring_live_range(procs.CONFIG, 601))
    pieces = plan_transfer(layout, list(range(10)), list(range(20, 30)), 0, 1, ring_live_range(procs.CONFIG, 601),
                           piece_blocks=4)
    bb = layout.block_bytes
    assert [p.src.nbytes // bb for p in whole.pairs[:-1]] == [10]
    assert [p.src.nbytes // bb for p in pieces.pairs[:-1]] == [4, 4, 2]
    assert pieces.total_bytes == whole.total_bytes
    with pytest.raises(ValueError, match="piece_blocks must be an integer >= 0, got -1"):
        plan_transfer(layout, [0], [1], 0, 1, ring_live_range(procs.CONFIG, 1), piece_blocks=-1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_chunks_blocks_land_before_the_next_chunk_is_computed(transport):
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(2 * BLOCK, steps)
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            n = 6 * BLOCK + 9  # 7 blocks: 3 chunks of 2 blocks, then a last chunk of 9 tokens
            prompt = list(range(1, n + 1))
            grant = await peer.prefill("r", prompt, pipelined=True)
            assert grant.pipelined and grant.first_token == 0 and grant.piece_blocks == 1
            pull = asyncio.ensure_future(pull_into(pair.d_cache, peer, grant, transport=transport, integrity=True))
            for chunk in range(3):
                steps.go()
                for block in (2 * chunk, 2 * chunk + 1):
                    await soon(lambda b=block: holding(pair, "r", b), f"block {block} landing")
                assert (pull.done(), engine.chunks_done) == (False, chunk + 1)
            assert not holding(pair, "r", 6), "the prompt's last block must wait for its last chunk"
            steps.go()
            with await pull as landed:
                differences, compared = procs.landed_differences(pair.decode.pool, landed, "r", n)
                assert not differences and compared > 0
                assert landed.first_token == sum(prompt) % 50000
                assert landed.times.prefill_ms > 0 and landed.times.transfer_ms > 0
            await peer.release(grant.grant_id)
            await soon(lambda: pair.free() == start, "everything freed")
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_computation_longer_than_the_transfer_deadline_still_lands(transport):
    """A pipelined pull may take the computation's time (rpc_timeout_s) on top of the transfer's: the Pull
    call's own gRPC deadline is that whole budget, not transfer_timeout_s alone."""
    config = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=5.0, transfer_timeout_s=0.5, piece_tokens=BLOCK)

    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(2 * BLOCK, steps)
        async with InProcessPair(engine=engine, config=config, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            n = 3 * BLOCK + 5  # two chunks
            grant = await peer.prefill("slow", list(range(1, n + 1)), pipelined=True)
            pull = asyncio.ensure_future(pull_into(pair.d_cache, peer, grant, transport=transport))
            steps.go()
            await asyncio.sleep(1.0)  # twice the transfer deadline before the last chunk
            assert not pull.done()
            steps.go()
            with await pull as landed:
                differences, compared = procs.landed_differences(pair.decode.pool, landed, "slow", n)
                assert not differences and compared > 0
            await soon(lambda: pair.free() == start, "everything freed")
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_computation_failing_mid_prompt_fails_the_pull_and_frees_both_nodes(transport):
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(BLOCK, steps, fail_after=2)
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("r", [3] * (4 * BLOCK), pipelined=True)
            allocation = allocation_for(pair.d_cache, grant)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=transport))
            steps.go()
            await soon(lambda: holding(pair, "r", 0), "block 0 landing")  # the pull is under way
            steps.go(2)
            with pytest.raises(StatusError) as failed:
                await pull
            assert failed.value.code is grpc.StatusCode.INTERNAL
            assert "injected failure before chunk 2" in failed.value.message
            assert not allocation.released  # the caller's, failed or not
            await soon(lambda: pair.free()[:2] == start[:2], "the prefill node's blocks freed")
            assert pair.free()[2:] == (start[2] - grant.num_blocks, start[3] - 1)
            allocation.release()
            assert pair.free() == start
            assert len(pair.prefill.leases) == 0
    run(scenario())


@pytest.mark.parametrize("how", ["cancelled", "released"])
def test_a_pull_cancelled_or_a_grant_released_mid_prompt_stops_the_computation_and_frees_both_nodes(how):
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(BLOCK, steps)
        async with InProcessPair(engine=engine, config=CONFIG) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("r", [3] * (6 * BLOCK), pipelined=True)
            allocation = allocation_for(pair.d_cache, grant)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=Transport.GRPC_STREAM))
            steps.go(2)
            await soon(lambda: holding(pair, "r", 1), "block 1 landing")
            if how == "cancelled":
                pull.cancel()  # the caller left: the pull releases the grant in the background
                with pytest.raises(asyncio.CancelledError):
                    await pull
            else:  # the pull in flight fails at once: nobody computes the rest of the prompt
                await peer.release(grant.grant_id)
                with pytest.raises(StatusError, match="its grant was released"):
                    await asyncio.wait_for(pull, 5)
            assert not allocation.released  # the caller's, whichever way the pull ended
            await soon(lambda: pair.free()[:2] == start[:2], "the prefill node's blocks freed")
            allocation.release()
            assert pair.free() == start
            steps.go(10)
            await asyncio.sleep(0.1)
            assert engine.chunks_done == 2, "the prompt's later chunks must not run"
    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prompt_written_before_its_computation_returns_still_brings_its_first_token(transport):
    """Every piece and the ring may move before the engine returns the first token: the pull waits for it."""
    async def scenario():
        steps = Steps()
        engine = procs.ChunkedFillEngine(BLOCK, steps, linger_s=0.3)
        async with InProcessPair(engine=engine, config=CONFIG, transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            prompt = [5] * (2 * BLOCK + 3)
            grant = await peer.prefill("r", prompt, pipelined=True)
            pull = asyncio.ensure_future(pull_into(pair.d_cache, peer, grant, transport=transport))
            steps.go(3)
            with await pull as landed:
                assert landed.first_token == sum(prompt) % 50000
                differences, _ = procs.landed_differences(pair.decode.pool, landed, "r", len(prompt))
                assert not differences
            await soon(lambda: pair.free() == start, "everything freed")
    run(scenario())


def test_send_clock_counts_overlapping_sends_once_and_the_time_after_a_moment():
    from kpool_pd.connector.prefill.outbound import SendClock

    clock = SendClock()
    for region, start, end in [(0, 1.0, 1.5), (1, 1.2, 1.7), (2, 2.0, 2.1), (3, 2.05, 2.08)]:
        clock.add(region, start, end)
    assert clock.busy_ms == pytest.approx(800.0)  # [1.0, 1.7] and [2.0, 2.1]
    assert clock.after_ms(2.0) == pytest.approx(100.0) and clock.after_ms(3.0) == 0.0
    assert SendClock().busy_ms == 0.0
