"""A PackedPull batch's message packed piece by piece on the prefill node
(``kpool_pd.connector.prefill.packed_message.pack_in_pieces``): each piece is handed out as soon as its bytes are
written and before a later piece's are, spans crossing pieces and gaps (refused pulls) included; a gap goes out as
zeros, never as what the reused buffer held, and the buffer holds only the pieces a span touches (a refused pull
claiming a GiB costs nothing); and the staging buffers a worker makes at start (``kpool_pd.vllm.loop.warm_staging``)
serve the first batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kpool_pd.connector import StagingBuffers
from kpool_pd.connector.prefill.packed_message import PackedMessage, pack_in_pieces
from kpool_pd.connector.shared.packed_staging import pieces
from kpool_pd.vllm.loop import STAGING_WARM_BUFFERS, STAGING_WARM_BYTES, warm_staging

POISON = 0xAB


def _spans(layout: list[tuple[int, int]], seed: int) -> list[tuple[int, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(at, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)) for at, n in layout]


CASES = {
    "one-span-in-one-piece": (16, 64, [(0, 16)]),
    "spans-crossing-pieces-with-gaps": (100, 16, [(0, 5), (5, 40), (60, 17), (77, 1), (90, 10)]),
    "span-ending-on-a-piece-boundary": (48, 16, [(0, 16), (16, 32)]),
    "gap-over-whole-pieces": (64, 8, [(0, 3), (40, 24)]),
    "no-span": (20, 8, []),
    "one-byte-pieces": (7, 1, [(1, 5)]),
}


@pytest.mark.parametrize("total, piece_bytes, layout", CASES.values(), ids=CASES.keys())
def test_each_piece_is_written_when_handed_out_and_later_ones_are_not_yet(total, piece_bytes, layout):
    spans = _spans(layout, seed=total)
    expected = torch.zeros((total,), dtype=torch.uint8)  # gaps: zeros
    for at, src in spans:
        expected[at:at + src.numel()] = src
    message = PackedMessage(layout, total, piece_bytes)
    buffer = torch.full((message.nbytes + 3,), POISON, dtype=torch.uint8)  # a reused buffer: stale bytes
    handed, sent = [], []
    for begin, length, piece in pack_in_pieces(spans, message, buffer):
        assert torch.equal(piece, expected[begin:begin + length]), f"piece at {begin} handed out before its bytes"
        later = [home for home in message.home[len(handed) + 1:] if home is not None]
        if later:
            assert bool((buffer[later[0]:message.nbytes] == POISON).all()), \
                f"bytes after the piece at {begin} packed before it went"
        handed.append((begin, length))
        sent.append(piece.clone())
    assert handed == pieces(total, piece_bytes)
    assert torch.equal(torch.cat(sent) if sent else torch.zeros(0, dtype=torch.uint8), expected)
    for at, src in spans:  # each span lies whole in the buffer where ``at`` says (the integrity check reads it)
        assert torch.equal(buffer[message.at(at):message.at(at) + src.numel()], src)


def test_a_gap_claiming_a_gib_costs_the_buffer_only_the_pieces_with_served_bytes():
    piece_bytes, gib = 1 << 20, 1 << 30
    layout = [(0, 100), (100 + gib, 5000)]  # served, a refused pull's claimed GiB, served
    total = 100 + gib + 5000
    message = PackedMessage(layout, total, piece_bytes)
    assert message.nbytes == piece_bytes + 5100  # the first piece and the last (100 bytes of gap, then the span)
    spans = _spans(layout, seed=3)
    buffer = torch.full((message.nbytes,), POISON, dtype=torch.uint8)
    lengths = 0
    for begin, length, piece in pack_in_pieces(spans, message, buffer):
        lengths += length
        if message.home[begin // piece_bytes] is None:
            assert not bool(piece.any()), f"the piece at {begin} holds no span: zeros"
    assert lengths == total  # every piece the decode node waits for still goes
    assert torch.equal(buffer[message.at(layout[1][0]):][:5000], spans[1][1])


def test_a_worker_makes_its_staging_buffers_at_start_and_the_first_batch_takes_one():
    staging = StagingBuffers(torch.device("cpu"))
    pool = SimpleNamespace(planes=(torch.zeros(3000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)))
    nbytes = warm_staging(staging, pool)
    assert nbytes == 4096  # the cache's 4,000 bytes, to a power of two
    warmed = [staging.take(nbytes) for _ in range(STAGING_WARM_BUFFERS)]
    assert len({b.data_ptr() for b in warmed}) == STAGING_WARM_BUFFERS
    assert all(b.numel() == nbytes and bool((b == 0).all()) for b in warmed)  # touched at start
    for buffer in warmed:
        staging.give(buffer)
    assert staging.take(3999).data_ptr() in {b.data_ptr() for b in warmed}


def test_a_large_cache_warms_buffers_of_the_cap_only():
    staging = StagingBuffers(torch.device("cpu"))
    pool = SimpleNamespace(planes=(torch.empty(STAGING_WARM_BYTES + 1, dtype=torch.uint8),))
    assert warm_staging(staging, pool) == STAGING_WARM_BYTES
