"""A pull's UCX receives are posted on the worker within ``UcxNode.post_receives``, every one before it returns
(no task a receive, no loop step in between), and land what a sender sends under their tags."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kpool_pd.connector import ucx_available
from kpool_pd.connector.shared.ucx import UcxNode, region_tag

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")

REGIONS = 5


def test_every_receive_is_posted_before_post_receives_returns_and_each_lands():
    async def main():
        node = UcxNode()
        import ucxx
        worker = ucxx.core._ctx.worker
        posted = []
        real = worker.tag_recv

        class CountingWorker:  # the worker's tag_recv, counted
            def tag_recv(self, array, tag):
                posted.append(tag.value)
                return real(array, tag)
        ucxx.core._ctx.worker = CountingWorker()
        try:
            views = [torch.zeros(64 * (i + 1), dtype=torch.uint8) for i in range(REGIONS)]
            batch = node.post_receives(views, tag_base=1 << 40)
            assert posted == [region_tag(1 << 40, i) for i in range(REGIONS)], "receives left for a later loop step"
        finally:
            ucxx.core._ctx.worker = worker
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(node.address))
        sent = [torch.full((64 * (i + 1),), i + 1, dtype=torch.uint8) for i in range(REGIONS)]
        await asyncio.gather(*(ep.send(s.numpy(), tag=region_tag(1 << 40, i), force_tag=True)
                               for i, s in enumerate(sent)))
        await asyncio.wait_for(batch.wait(), 30)
        assert all(torch.equal(v, s) for v, s in zip(views, sent))
        await ep.close()
    asyncio.run(asyncio.wait_for(main(), 60))
