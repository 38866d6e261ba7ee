"""The prefill node's side of a PullSession: one stream on which a decode node starts and cancels its
UCX pulls, so that a pull opens no gRPC call (a new call costs about five times a message on an open
stream: ``kpool-pd bench control``).

Each ``pull`` request (or each pull of a ``pulls`` batch, which a decode node sends for the pulls it starts
together) runs the node's ``pull_messages`` (what a Pull stream would send) in a task of its
own; its messages go back under its grant id, and a pull that fails ends with a ``failure`` carrying the
status a Pull call would have ended with. ``cancel_grant_id`` stops that pull (its sends stop at once).
When the decode node closes the stream, or it breaks (the node died, its connection reset), every pull
still running on it is stopped, as a cancelled Pull call stops. Only UCX pulls travel here: the gRPC
stream transport keeps its Pull calls (its chunks would hold up every other pull on the stream).

A session with no pull running on which the decode node sends nothing for ``idle_s`` is ended with
DEADLINE_EXCEEDED (a ``StatusError``), so that an authenticated peer cannot hold sessions open for ever;
the decode node opens a new one at its next pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared import hops
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.wire import Transport

logger = logging.getLogger(__name__)

MAX_SESSION_PULLS = 4096  # pulls running on one session at once (a decode node runs far fewer)


_IDLE = object()  # the session was idle for its limit


async def serve_pull_session(requests: AsyncIterator[pb.PullSessionRequest],
                             pull_messages: Callable[[pb.PullRequest], AsyncIterator[pb.PullResponse]], *,
                             idle_s: float) -> AsyncIterator[pb.PullSessionResponse]:
    """The session's responses, until the decode node has closed its side and every pull on it ended.
    StatusError DEADLINE_EXCEEDED once no pull ran and no request came for ``idle_s``."""
    out: asyncio.Queue = asyncio.Queue()  # responses; None: the session is over; _IDLE: it idled out
    pulls: dict[str, asyncio.Task] = {}
    reading = True
    loop = asyncio.get_running_loop()
    active_at = loop.time()  # the last request, or the end of the last pull

    def failure(grant_id: str, code: grpc.StatusCode, message: str) -> pb.PullSessionResponse:
        return pb.PullSessionResponse(grant_id=grant_id, failure=pb.PullFailure(code=code.value[0], message=message))

    def ended(grant_id: str) -> None:
        nonlocal active_at
        pulls.pop(grant_id, None)
        active_at = loop.time()
        if not reading and not pulls:
            out.put_nowait(None)

    async def watch() -> None:
        """Put _IDLE once the session has been idle for ``idle_s``."""
        while True:
            left = active_at + idle_s - loop.time()
            if left <= 0 and not pulls:
                out.put_nowait(_IDLE)
                return
            await asyncio.sleep(max(left, idle_s / 10))

    async def run(request: pb.PullRequest) -> None:
        try:
            async with contextlib.aclosing(pull_messages(request)) as messages:
                async for message in messages:
                    out.put_nowait(pb.PullSessionResponse(grant_id=request.grant_id, response=message))
        except StatusError as exc:
            out.put_nowait(failure(request.grant_id, exc.code, exc.message))
        except Exception as exc:  # a bug here fails this pull only, as it would fail its Pull call
            logger.exception("pull of grant %s on a pull session failed", request.grant_id)
            out.put_nowait(failure(request.grant_id, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            ended(request.grant_id)

    def start(request: pb.PullRequest) -> None:
        grant_id = request.grant_id
        if request.transport != Transport.UCX.value:
            out.put_nowait(failure(grant_id, grpc.StatusCode.INVALID_ARGUMENT,
                                   "a pull session carries UCX pulls only; pull over the gRPC stream with Pull"))
        elif grant_id in pulls:
            out.put_nowait(failure(grant_id, grpc.StatusCode.ALREADY_EXISTS,
                                   f"grant {grant_id!r} is already being pulled on this session"))
        elif len(pulls) >= MAX_SESSION_PULLS:
            out.put_nowait(failure(grant_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{len(pulls)} pulls already run on this session (limit {MAX_SESSION_PULLS})"))
        else:
            pulls[grant_id] = asyncio.create_task(run(request), name=f"session-pull-{grant_id[:16]}")

    def touch() -> None:
        nonlocal active_at
        active_at = loop.time()

    async def read() -> None:
        nonlocal reading
        try:
            async for request in requests:
                touch()
                kind = request.WhichOneof("message")
                if kind == "pull":
                    hops.stamp(request.pull.grant_id, "read")
                    start(request.pull)
                elif kind == "pulls":  # a batch: each pull starts as a message of its own would
                    for pull in request.pulls.pulls:
                        hops.stamp(pull.grant_id, "read")
                        start(pull)
                elif kind == "cancel_grant_id" and request.cancel_grant_id in pulls:
                    pulls[request.cancel_grant_id].cancel()
        except Exception:  # the stream broke: the session ends now, stopping every pull on it
            out.put_nowait(None)
            raise
        finally:  # the decode node closed its side (the pulls running finish) or the stream broke
            reading = False
            if not pulls:
                out.put_nowait(None)

    reader = asyncio.create_task(read(), name="pull-session-reader")
    watcher = asyncio.create_task(watch(), name="pull-session-idle")
    try:
        while (message := await out.get()) is not None:
            if message is _IDLE:
                logger.info("pull session idle for %.1f s: ending it", idle_s)
                raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"pull session idle (no pull, no message) for "
                                  f"{idle_s:g} s, its limit: ended; open a new one for the next pull")
            yield message
        reader.result()  # a stream that broke raises here, and every pull on it was stopped
    finally:
        reader.cancel()
        watcher.cancel()
        running = list(pulls.values())
        for task in running:
            task.cancel()
        await asyncio.gather(reader, watcher, *running, return_exceptions=True)
