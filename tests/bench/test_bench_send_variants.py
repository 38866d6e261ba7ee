"""The send-variants probe (``kpool_pd.bench.send_variants``): a pooled variant's reps land in the pool's
slots in turn, each a view of the pool's own memory; every variant moves its bytes intact between two
processes; bad sizes are refused before any process starts."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.bench.send_variants import POOL_SLOTS, SendVariant, message_view, send_variant_ms
from kpool_pd.connector import ucx_available


def test_a_pooled_variant_moves_through_the_slots_and_a_standalone_one_stays_put():
    standalone = torch.zeros(16, dtype=torch.uint8)
    pool = torch.zeros(16 * POOL_SLOTS, dtype=torch.uint8)
    starts = [message_view(pool, standalone, SendVariant.POOLED, rep).data_ptr() - pool.data_ptr()
              for rep in range(POOL_SLOTS + 1)]
    assert starts == [16 * (rep % POOL_SLOTS) for rep in range(POOL_SLOTS + 1)]
    assert message_view(pool, standalone, SendVariant.NODE, 3).data_ptr() == standalone.data_ptr()
    assert message_view(pool, standalone, SendVariant.NODE_POOLED, 3).numel() == 16


@pytest.mark.parametrize("nbytes,reps", [(0, 1), (10, 0)])
def test_empty_sizes_and_no_reps_are_refused(nbytes, reps):
    with pytest.raises(ValueError, match=rf"got {nbytes} and {reps}"):
        send_variant_ms(nbytes, reps, "cpu")


@pytest.mark.skipif(not ucx_available(), reason="needs ucxx")
def test_every_variant_lands_its_bytes_between_two_processes():
    # the receiver compares every rep's landed bytes with the sent ones and raises on a difference
    ms = send_variant_ms(100_003, 2, "cpu")
    assert set(ms) == {v.value for v in SendVariant}
    assert all(value > 0 for value in ms.values())
