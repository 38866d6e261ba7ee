"""The raw ucxx baseline in K tagged messages (``kpool_pd.bench.ucxx_baseline``), which the transfer bench puts
beside a connector series of K messages a pull: the parts cover the bytes in order, and the bytes of a send
in several messages land where they belong, over both kinds of endpoint."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.bench.ucxx_baseline import UcxxEndpoint, message_parts, ucxx_tag_gbps
from kpool_pd.connector import UCX_NO_SHARED_MEMORY, ucx_available


@pytest.mark.parametrize("nbytes,messages", [(1, 1), (7, 7), (10, 3), (4096, 61)], ids=["one-byte", "a-byte-each",
                                                                                        "uneven", "61-parts"])
def test_message_parts_cover_the_bytes_in_order(nbytes, messages):
    data = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    parts = message_parts(data, messages)
    assert len(parts) == messages
    assert max(p.numel() for p in parts) - min(p.numel() for p in parts) <= 1
    assert torch.equal(torch.cat(parts), data)
    assert all(p.data_ptr() == data[sum(q.numel() for q in parts[:i]):].data_ptr() for i, p in enumerate(parts))


@pytest.mark.parametrize("messages", [0, 11])
def test_message_counts_outside_the_bytes_are_refused(messages):
    with pytest.raises(ValueError, match=rf"messages must lie in \[1, 10\].*got {messages}"):
        message_parts(torch.zeros(10, dtype=torch.uint8), messages)
    with pytest.raises(ValueError, match=rf"got {messages}"):
        ucxx_tag_gbps(10, 1, "cpu", "cpu", UCX_NO_SHARED_MEMORY, messages=messages)


@pytest.mark.skipif(not ucx_available(), reason="needs ucxx")
@pytest.mark.parametrize("endpoint", list(UcxxEndpoint), ids=lambda e: e.name.lower())
def test_a_send_in_several_messages_lands_its_bytes(endpoint):
    # an uneven split: a part landing in another part's place would change the bytes (checked by the receiver)
    assert ucxx_tag_gbps(300_001, 1, "cpu", "cpu", UCX_NO_SHARED_MEMORY, endpoint=endpoint, messages=5) > 0
