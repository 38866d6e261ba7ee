"""A pull cancelled while its UCX sends are in flight stops only its own sends: another pull to the same
decode engine, in flight beside it, lands byte for byte, and the prefill node's next pull to that engine works.

Both nodes run in this event loop over real UCX (CPU memory). The decode node holds back the receives of
both pulls, so that the prefill node's rendezvous sends (regions of more than UCX's 4 MiB threshold for host
memory) are known to be in flight, unmatched at the decode worker, when pull 1 is cancelled; pull 2's
receives are posted only once the prefill node has finished pull 1. A cancel that aborted every send to the
engine would have cancelled pull 2's with it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from kpool_pd.connector import ConnectorConfig, Transport, ucx_available
from kpool_pd.connector.shared.ucx import ReceiveBatch, region_tag
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import pull_into

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
UCX = Transport.UCX
CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(10), transfer_timeout_s=patient(10))
PROMPT_BLOCKS = 480  # 480 blocks of 18,624 B: one region of 8.5 MiB, sent by rendezvous
NUM_BLOCKS = 3 * PROMPT_BLOCKS + 16


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(90)))


async def soon(predicate, what: str, timeout_s: float = 10.0) -> None:
    async def check() -> bool:
        return predicate()
    await until(check, what, timeout_s)


class HeldReceives:
    """Stands in for a pull's ReceiveBatch: its receives are posted on the worker only at ``post()``. Until
    then the sender's messages wait unmatched at the worker, and there is nothing to retire."""

    def __init__(self, post_receives, views, tag_base: int) -> None:
        self._post_receives, self._views, self._tag_base = post_receives, views, tag_base
        self.tags = [region_tag(tag_base, i) for i in range(len(views))]
        loop = asyncio.get_running_loop()
        self.futures = [loop.create_future() for _ in views]
        self.posted: ReceiveBatch | None = None

    def post(self) -> None:
        self.posted = self._post_receives(self._views, self._tag_base)
        for real, mine in zip(self.posted.futures, self.futures):
            real.add_done_callback(lambda done, mine=mine: _copy_outcome(done, mine))

    def pending(self) -> list[int]:
        return [i for i, f in enumerate(self.futures) if not f.done()] if self.posted is not None else []

    async def wait(self) -> None:
        await asyncio.gather(*(asyncio.shield(f) for f in self.futures))


def _copy_outcome(source: asyncio.Future, target: asyncio.Future) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def hold_receives(pair: InProcessPair) -> list[HeldReceives]:
    """Every pull's receives on the decode node, held back (in the order the pulls posted them)."""
    held, real = [], pair.decode.ucx.post_receives

    def post_later(views, tag_base):
        held.append(HeldReceives(real, views, tag_base))
        return held[-1]
    pair.decode.ucx.post_receives = post_later
    return held


def watch_pull_ends(pair: InProcessPair) -> dict[str, asyncio.Event]:
    """grant id -> set once the prefill node's ``pull_messages`` of it has ended (its cleanup run)."""
    ended, real = {}, pair.prefill.pull_messages

    async def watched(request):
        ended.setdefault(request.grant_id, asyncio.Event())
        try:
            async with contextlib.aclosing(real(request)) as messages:
                async for message in messages:
                    yield message
        finally:
            ended[request.grant_id].set()
    pair.prefill.pull_messages = watched  # before the pull session opens: it binds the method then
    return ended


def waiting_at_the_worker(held: HeldReceives) -> bool:
    """Whether a message of every region of the pull has reached the (shared) worker, unmatched."""
    from ucxx.core import _get_ctx  # the process's ucxx context: its worker is both nodes' here
    ctx = _get_ctx()
    return all(ctx.tag_probe(tag).matched for tag in held.tags)


def same_bytes_as_the_prefill_node(pair: InProcessPair, landed, grant) -> bool:
    """The landed prompt blocks and ring hold exactly the bytes of the grant's blocks and ring on the prefill node."""
    src, dst = pair.prefill.pool, pair.decode.pool
    src_blocks = src.blocks[list(grant.src_block_ids)]
    dst_blocks = dst.blocks[list(landed.block_ids[:grant.num_blocks])]
    slots = procs.live_slots(src.config, grant.prompt_len)
    src_ring = src.rings[grant.src_ring_id].view(src.layout.ring_slots, src.layout.ring_slot_bytes)[slots]
    dst_ring = dst.rings[landed.ring_id].view(dst.layout.ring_slots, dst.layout.ring_slot_bytes)[slots]
    return torch.equal(src_blocks, dst_blocks) and torch.equal(src_ring, dst_ring)


def test_a_pull_cancelled_mid_send_leaves_the_other_pulls_to_its_engine_alone():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,), num_blocks=NUM_BLOCKS) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            real_post = pair.decode.ucx.post_receives
            held, ended = hold_receives(pair), watch_pull_ends(pair)
            tokens = PROMPT_BLOCKS * procs.CONFIG.block_size
            grants = [await peer.prefill(f"p{i}", [i + 1] * tokens) for i in (1, 2)]
            pulls = []
            for grant in grants:  # one after the other: held[k] is pull k's
                pulls.append(asyncio.ensure_future(pull_into(pair.d_cache, peer, grant, transport=UCX)))
                await soon(lambda: len(held) == len(pulls), "the pull's receives (held) to be posted")
            await soon(lambda: all(waiting_at_the_worker(h) for h in held),
                       "both pulls' sends to be in flight, unmatched at the decode worker")

            pulls[0].cancel()  # the caller of pull 1 leaves while its sends are in flight
            with pytest.raises(asyncio.CancelledError):
                await pulls[0]
            await asyncio.wait_for(ended[grants[0].grant_id].wait(), 10)  # the prefill node stopped pull 1
            assert not pulls[1].done()
            assert pair.prefill_sample("transfer_failures_total", cause="pull_aborted") == 1

            held[1].post()  # pull 2's sends, still in flight, now find their receives
            with await asyncio.wait_for(pulls[1], 20) as landed:
                assert same_bytes_as_the_prefill_node(pair, landed, grants[1])
                differences, compared = procs.landed_differences(pair.decode.pool, landed, "p2", tokens)
                assert not differences and compared >= PROMPT_BLOCKS * pair.decode.pool.layout.block_bytes

            pair.decode.ucx.post_receives = real_post
            third = await peer.prefill("p3", [3] * tokens)
            with await asyncio.wait_for(pull_into(pair.d_cache, peer, third, transport=UCX), 20) as landed:
                assert same_bytes_as_the_prefill_node(pair, landed, third)
                assert not procs.landed_differences(pair.decode.pool, landed, "p3", tokens)[0]

            await soon(lambda: pair.free() == start, "every block and ring free again on both sides")
            assert pair.prefill.grants_held == 0
            assert pair.prefill_sample("transfer_failures_total", cause="ucx_send") == 0
    run(main())


def test_a_pull_that_completes_gives_its_endpoint_back_for_the_next():
    """No endpoint is made per pull (UCX would wire each one up on its first message): pulls one after the
    other all send on the endpoint that the Handshake made and warmed up."""
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            made = pair.prefill.engines.get(pair.decode.engine_id).link.endpoints
            for i in range(3):
                grant = await peer.prefill(f"seq{i}", [i + 1] * 200)
                with await pull_into(pair.d_cache, peer, grant, transport=UCX) as landed:
                    assert not procs.landed_differences(pair.decode.pool, landed, f"seq{i}", 200)[0]
                await soon(lambda: pair.free() == start, "the pull ended on both nodes")
            assert len(made) == 1 and pair.prefill.engines.get(pair.decode.engine_id).link.endpoints == made
    run(main())
