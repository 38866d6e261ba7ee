"""The producer's board of grants announced to decode engines by name (``OfferBoard``): only an engine that asked
has a queue, a waiting call hears of an announcement at once, a queue is bounded, an engine that stopped asking is
forgotten, and a wait out of range is refused."""

from __future__ import annotations

import asyncio

import pytest

from kpool_pd.connector.prefill import offer_board
from kpool_pd.connector.prefill.offer_board import Announcement, OfferBoard


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_only_an_engine_that_asked_gets_announcements_and_a_waiting_call_hears_at_once():
    async def scenario():
        board = OfferBoard()
        assert not board.post("e1", Announcement("k0", "{}"))  # never asked: nothing kept
        assert await board.take("e1", 0) == []
        waiting = asyncio.ensure_future(board.take("e1", 20))
        await asyncio.sleep(0)
        assert board.post("e1", Announcement("k1", "{}"))
        taken = await asyncio.wait_for(waiting, 5)  # well before its 20 s
        assert [a.key for a in taken] == ["k1"] and board.waiting("e1") == 0
        assert not board.post("e2", Announcement("k2", "{}"))
    run(scenario())


def test_a_queue_keeps_its_newest_announcements(monkeypatch):
    monkeypatch.setattr(offer_board, "MAX_ANNOUNCED", 3)

    async def scenario():
        board = OfferBoard()
        await board.take("e1", 0)
        for k in range(5):
            board.post("e1", Announcement(f"k{k}", "{}"))
        assert [a.key for a in await board.take("e1", 0)] == ["k2", "k3", "k4"] and board.dropped == 2
    run(scenario())


def test_an_engine_that_stopped_asking_is_forgotten():
    now = [1000.0]

    async def scenario():
        board = OfferBoard(clock=lambda: now[0])
        await board.take("e1", 0)
        assert board.post("e1", Announcement("k1", "{}"))
        now[0] += offer_board.STALE_S + 1
        assert not board.post("e1", Announcement("k2", "{}")) and not board.listening("e1")
    run(scenario())


@pytest.mark.parametrize("wait_s", [-1, offer_board.MAX_WAIT_S + 1])
def test_a_wait_out_of_range_is_refused(wait_s):
    with pytest.raises(ValueError, match="wait_s must lie in"):
        run(OfferBoard().take("e1", wait_s))
