"""A PackedPull batch landing piece by piece on the decode node (``kpool_pd.connector.decode.packed_pull``): in host
memory each region's bytes are copied into its blocks as soon as the pieces holding them landed, in order, and no
copy follows a failed piece or the batch's end (its landing cancelled)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kpool_pd.connector.decode.packed_pull import _land_as_pieces_come, _Planned
from kpool_pd.connector.shared.packed_staging import PIECE_BYTES, pieces
from kpool_pd.connector.shared.ucx import ReceiveBatch

POISON = 0xCD
TOTAL = 3 * PIECE_BYTES - 100  # three pieces, the last one short
# (offset of the pull in the message, its regions' sizes): a region inside piece 0, one across 0-1, one across 1-2
PULLS = [(0, (1000, PIECE_BYTES)), (PIECE_BYTES + 1000 + 50, (PIECE_BYTES + 10, 500))]


def _batch(loop: asyncio.AbstractEventLoop):
    message = torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    planned = [_Planned(index=i, plan=None, views=tuple(torch.full((n,), POISON, dtype=torch.uint8) for n in sizes),
                        offset=offset) for i, (offset, sizes) in enumerate(PULLS)]
    futures = [loop.create_future() for _ in pieces(TOTAL, PIECE_BYTES)]
    return message, planned, ReceiveBatch(list(range(len(futures))), futures)


def _regions(planned: list[_Planned]):
    """(start, end, view) of every region in the message."""
    out = []
    for pull in planned:
        at = pull.offset
        for view in pull.views:
            out.append((at, at + view.numel(), view))
            at += view.numel()
    return out


def _check(message: torch.Tensor, planned: list[_Planned], landed_end: int) -> None:
    """Bytes before ``landed_end`` copied, the rest still poison."""
    for start, end, view in _regions(planned):
        copied = max(0, min(end, landed_end) - start)
        assert torch.equal(view[:copied], message[start:start + copied]), f"region at {start} not copied"
        assert bool((view[copied:] == POISON).all()), f"region at {start} copied past the pieces landed"


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_each_piece_is_copied_into_its_regions_as_it_lands():
    async def main():
        message, planned, receive = _batch(asyncio.get_running_loop())
        landing = asyncio.ensure_future(_land_as_pieces_come(message, receive, planned))
        await _turns()
        _check(message, planned, 0)
        for k, (begin, length) in enumerate(pieces(TOTAL, PIECE_BYTES)):
            receive.futures[k].set_result(None)
            await _turns()
            _check(message, planned, begin + length)
        await asyncio.wait_for(landing, 5)
    asyncio.run(main())


@pytest.mark.parametrize("end", ["cancelled", "failed-piece"])
def test_nothing_is_copied_after_the_batch_ended_or_a_piece_failed(end):
    async def main():
        message, planned, receive = _batch(asyncio.get_running_loop())
        landing = asyncio.ensure_future(_land_as_pieces_come(message, receive, planned))
        receive.futures[0].set_result(None)
        await _turns()
        _check(message, planned, PIECE_BYTES)
        if end == "cancelled":
            landing.cancel()
        else:
            receive.futures[1].set_exception(RuntimeError("the receive failed in UCX"))
        await _turns()
        receive.futures[2].set_result(None)
        await _turns()
        _check(message, planned, PIECE_BYTES)  # the third piece landed, but nothing more was copied
        assert landing.done()
        if end == "failed-piece":
            receive.futures[1].exception()  # retrieved (the batch's wait raises it)
    asyncio.run(main())
