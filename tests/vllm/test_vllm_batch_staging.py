"""The staging buffers a PackedPull batch passes through on each node (``kpool_pd.connector.shared.packed_staging``):
a batch takes the smallest kept buffer that fits, buffers of other sizes kept side by side, and the message's
pieces cover it exactly; the copies of a batch land each region where it belongs."""

from __future__ import annotations

import torch

from kpool_pd.connector.shared.packed_staging import KEPT, StagingBuffers, copy_all, pieces


def test_a_batch_takes_the_smallest_kept_buffer_that_fits_among_several_sizes():
    staging = StagingBuffers(torch.device("cpu"))
    small, large = staging.take(3 << 20), staging.take(9 << 20)
    assert (small.numel(), large.numel()) == (4 << 20, 16 << 20)  # powers of two
    staging.give(large)
    staging.give(small)
    again = staging.take(2 << 20)
    assert again.data_ptr() == small.data_ptr()  # the kept one, not a new one
    bigger = staging.take(5 << 20)
    assert bigger.data_ptr() == large.data_ptr()
    assert staging.take(1 << 20).data_ptr() not in (small.data_ptr(), large.data_ptr())  # both lent: a new one


def test_at_most_a_few_buffers_are_kept():
    staging = StagingBuffers(torch.device("cpu"))
    buffers = [staging.take(1 << k) for k in range(10, 10 + KEPT + 3)]
    for buffer in buffers:
        staging.give(buffer)
    kept = [staging.take(1) for _ in range(KEPT)]
    assert sorted(b.numel() for b in kept) == sorted(b.numel() for b in buffers)[-KEPT:]  # the largest few


def test_pieces_cover_the_message_exactly():
    assert pieces(0, 4) == []
    assert pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert pieces(8, 4) == [(0, 4), (4, 4)]


def test_copy_all_puts_each_region_in_place():
    generator = torch.Generator().manual_seed(3)
    source = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=generator)
    regions = [source[10:110], source[500:503], source[900:1000]]
    message = torch.zeros(203, dtype=torch.uint8)
    copy_all([message[0:100], message[100:103], message[103:203]], regions)
    assert torch.equal(message, torch.cat(regions))
    back = torch.zeros(1000, dtype=torch.uint8)
    copy_all([back[10:110], back[500:503], back[900:1000]], [message[0:100], message[100:103], message[103:203]])
    assert torch.equal(back[10:110], source[10:110]) and torch.equal(back[900:1000], source[900:1000])
    assert int(back[:10].sum()) == 0
