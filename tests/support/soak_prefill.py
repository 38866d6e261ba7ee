"""The prefill daemon for the soak test (``python -m tests.support.soak_prefill <prefill flags>``): the real
daemon, except that it holds a request at one step for ``HOLD_S`` when the request's id asks for
it, so that a client's cancel lands in that step on the decode node:

- ``@prefilling``: the prefill waits before it starts (before its blocks are allocated: a pipelined
  Prefill call is answered once they are, a whole one once the prompt is computed, so either way the
  call is still unanswered);
- ``@pulling``: the pull waits before it starts (before any byte, and before its grant message), in a
  Pull call or on a pull session; a push (PrefillPush) waits after its grant message, before its PullDone
  (its bytes may have moved: the decode node holds the request in its pull until PullDone);
- ``@releasing``: the Release waits before it frees the grant.

Nothing else changes: a held call that its caller cancels ends as the real one would.
"""

from __future__ import annotations

import asyncio
import os
import sys

from kpool_pd.connector import PrefillConnector
from kpool_pd.connector.prefill.pushes import PushDesk
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine
from kpool_pd.prefill_worker.daemon import main

HOLD_S = float(os.environ.get("KPOOLPD_SOAK_HOLD_S", "2.0"))


def _asks(request_id: str, step: str) -> bool:
    return f"@{step}" in request_id


def install_holds() -> None:
    """Patch the prefill node's steps (before the daemon registers its servicer)."""
    real_prefill, real_pull, real_release = (BatchingPrefillEngine.prefill, PrefillConnector.pull_messages,
                                             PrefillConnector.Release)

    async def prefill(self, request, cache):
        if _asks(request.request_id, "prefilling"):
            await asyncio.sleep(HOLD_S)
        return await real_prefill(self, request, cache)

    async def pull(self, request):
        grant = self.leases.live(request.grant_id)
        if grant is not None and _asks(grant.request_id, "pulling"):
            await asyncio.sleep(HOLD_S)  # before any byte: UCX sends start as the real pull begins
        stream = real_pull(self, request)
        try:
            async for message in stream:
                yield message
        finally:
            await stream.aclose()

    async def release(self, request, context):
        grant = self.leases.live(request.grant_id)
        if grant is not None and _asks(grant.request_id, "releasing"):
            await asyncio.sleep(HOLD_S)
        return await real_release(self, request, context)

    real_push = PushDesk.push_messages

    async def push(self, request):
        stream = real_push(self, request)
        try:
            async for message in stream:
                yield message
                granted = not isinstance(message, bytes) and message.WhichOneof("message") == "granted"
                if granted and _asks(request.prefill.request_id, "pulling"):
                    await asyncio.sleep(HOLD_S)
        finally:
            await stream.aclose()

    BatchingPrefillEngine.prefill = prefill
    PrefillConnector.pull_messages = pull
    PushDesk.push_messages = push
    PrefillConnector.Release = release


if __name__ == "__main__":
    install_holds()
    sys.exit(main())
