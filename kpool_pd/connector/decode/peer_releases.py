"""How a decode node's peer gives a prefill node's grants back: a Release now (``release``), in the background
until the node answers (``release_soon``), or waited on for a while (``release_within``). ``PrefillPeer`` is one
(``kpool_pd.connector.decode.peer``); the background Releases are the connector's (``kpool_pd.connector.decode.releases``),
so that they outlive a closed peer."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.errors import rpc_failure

logger = logging.getLogger(__name__)


class PeerReleases:
    """The Release calls of a peer (``PrefillPeer``, which provides ``context``, ``address``, ``lease_s``, its
    stub, its open grants and background Releases, its secret and ``_check_open``)."""

    def _release_abandoned(self, call: asyncio.Task) -> None:
        """Done-callback of a Prefill whose caller was cancelled: release the grant it returned, if any."""
        self._background.discard(call)
        if call.cancelled() or call.exception() is not None:
            return  # no grant: the call was cancelled in time, or failed
        grant_id = call.result().grant_id
        logger.info("prefill of %s was granted as its caller left; releasing grant %s",
                    call.result().request_id, grant_id)
        self.release_soon(grant_id)

    def release_soon(self, grant_id: str, *, dcp_rank: int = 0, all_ranks: bool = False) -> asyncio.Task:
        """Release ``grant_id`` in the background and return the task; never blocks nor raises. The
        task is the connector's (``kpool_pd.connector.decode.releases``), not this peer's: a Release that
        fails or gets no answer (each try within ``rpc_timeout_s``) is sent again after a backoff until the
        node answers it, refuses it for good (an unknown engine or another's grant, which holds nothing of
        ours) or the grant's lease has run out (nobody renews it now: the node frees it by then), and once
        this peer is closed it goes on through the connector's newest open peer of this address (the node
        handshaken again). For callers that cannot wait (they were cancelled) or need not (a failure path);
        ``release_within`` waits for the answer. The peer stays ``busy`` until the task ends."""
        self._open_grants.pop(grant_id, None)
        task = self.context.releases.start(self, grant_id, lease_s=self.lease_s, dcp_rank=dcp_rank,
                                           all_ranks=all_ranks)
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        return task

    async def release_within(self, grant_id: str, wait_s: float, *, dcp_rank: int = 0) -> None:
        """``release_soon``, waiting at most ``wait_s`` for it to end: a caller whose bytes have
        landed waits for the Release's answer (the grant is freed when it returns, on a node that
        answers in time) but not for the tries after ``wait_s``; cancelling the caller leaves the
        Release going on. Never raises but CancelledError."""
        task = self.release_soon(grant_id, dcp_rank=dcp_rank)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), wait_s)

    async def release(self, grant_id: str, *, dcp_rank: int = 0, all_ranks: bool = False,
                      timeout_s: float | None = None) -> bool:
        """Idempotent: False when the grant was already released or expired. A DCP rank releases its
        own share (``dcp_rank``); rank 0 may release every rank's at once (``all_ranks``). StatusError
        (DEADLINE_EXCEEDED: no answer within ``timeout_s``, by default ``rpc_timeout_s``)."""
        self._open_grants.pop(grant_id, None)
        self._check_open(f"Release of {grant_id}")
        try:
            r = await self._stub.Release(pb.ReleaseRequest(grant_id=grant_id, engine_id=self.context.engine_id,
                                                           engine_secret=self._secret,
                                                           dcp_rank=dcp_rank, all_ranks=all_ranks),
                                         timeout=timeout_s or self.context.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_failure(exc, f"Release of {grant_id} on {self.address}") from None
        return r.released
