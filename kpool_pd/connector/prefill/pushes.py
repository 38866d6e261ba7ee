"""The PrefillPush RPC on the prefill node: a decode node's Prefill and its pull in one call, so that the
transfer starts from the prompt's completion with no message from the decode node after it.

The call is checked whole before the engine sees it: the engine's identity and secret, the prompt
(``PrefillDesk.check``), the transport (``PullDesk.transport_for``) and every region against the grant the prompt
will make (``kpool_pd.connector.prefill.pushed_plan``). The prompt is then held as a grant made once the engine
allocated (``PrefillDesk.hold``), which the first message states; the regions are bound to its blocks and served
as a Pull of it is (``PullDesk.serve``): each region moves as soon as the prompt's chunks wrote it, its UCX send
posted from the engine's ``PrefillProgress.advance``. The grant is then the decode node's to release, under lease,
as any grant. A caller that leaves before PullDone (its call cancelled, its connection broken) abandons the
grant: the computation stops and the blocks are freed once no send reads them.
"""

from __future__ import annotations

import contextlib
import logging

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.prefills import PrefillDesk
from kpool_pd.connector.prefill.pulls import PullDesk
from kpool_pd.connector.prefill.pushed_plan import bind_pushed, check_pushed
from kpool_pd.connector.shared import hops
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.kvcache import CachePool

logger = logging.getLogger(__name__)


class PushDesk:
    """Serves PrefillPush calls through the node's Prefill desk (the grant) and Pull desk (the transfer)."""

    def __init__(self, *, pool: CachePool, prefills: PrefillDesk, pulls: PullDesk) -> None:
        self.pool, self.prefills, self.pulls = pool, prefills, pulls

    async def push_messages(self, request: pb.PushRequest):
        """The messages of one push: ``granted``, then a Pull stream's; StatusError for a push refused before
        the prompt ran (nothing held), or failed (the grant is abandoned)."""
        prefill = request.prefill
        self.prefills.check(prefill)  # PERMISSION_DENIED before anything else, for an engine without its secret
        if prefill.dcp_engine_ids:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a push serves one decode engine; a DCP instance's "
                              "ranks pull their shares with Prefill and Pull")
        engine = self.pulls.grants.authenticate(prefill.engine_id, prefill.engine_secret, "PrefillPush")
        transport, link = self.pulls.transport_for(engine, request.transport, request.ucx_tag_base)
        relative = check_pushed(self.pool.layout, len(prefill.prompt_token_ids), request.regions)
        grant = await self.prefills.hold(prefill, pipelined=True)
        hops.stamp(grant.grant_id, "checked")
        try:
            plan, views = bind_pushed(self.pool, grant, relative)
        except BaseException:
            self.pulls.grants.abandon(grant, f"its push to {prefill.engine_id} could not be bound to its blocks")
            raise
        granted = pb.PullResponse(granted=self.prefills.response(grant))
        async with contextlib.aclosing(self.pulls.serve(grant, plan, views, transport=transport,
                                                        engine_id=prefill.engine_id, link=link,
                                                        tag_base=request.ucx_tag_base, integrity=request.integrity,
                                                        first=granted, abandon_if_left=True)) as messages:
            async for message in messages:
                yield message
