"""The decode node's side of a PullSession (``kpool_pd.connector.prefill.pull_session_server`` is the prefill node's): one
stream to a prefill node, opened at the first UCX pull and kept, on which each UCX pull is one message
instead of a new Pull call.

``open(request)`` starts a pull and returns its ``SessionPull``, which ``InboundPull`` reads as it reads a
Pull call: ``read()`` gives the pull's messages in order, and raises the StatusError the pull failed with;
``cancel()`` stops it on the prefill node. When the stream ends or breaks (the prefill node died, its
connection reset), every pull on it fails with UNAVAILABLE and the next ``open`` makes a new stream. A
prefill node that does not serve PullSession answers UNIMPLEMENTED: ``supported`` turns False, and the
caller pulls with Pull calls from then on.

With a prefill node that takes batches (``HandshakeResponse.pull_batches``), the pulls opened in one turn of
the event loop (the requests of one engine step, started together) go out as one message
(``PullSessionRequest.pulls``), written once, where each would be a message of its own. The writer takes
them at its next step (no step of their own to gather them first).

The prefill node ends a session idle for its limit (``HandshakeResponse.pull_session_idle_ms``); so that no
pull races that end, ``open`` replaces a session that has been idle for half the limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared import hops
from kpool_pd.connector.shared.errors import StatusError, status_code

logger = logging.getLogger(__name__)


_BATCH = object()  # in the writer's queue: the pulls opened and not yet taken (``_take_batch``) go here


class SessionPull:
    """One pull on a session: its messages (PullResponse) and its end, as ``InboundPull`` reads a Pull call."""

    def __init__(self, session: "PullSession", grant_id: str) -> None:
        self.session, self.grant_id = session, grant_id
        self.messages: asyncio.Queue[pb.PullResponse | StatusError] = asyncio.Queue()
        self.ended = False
        self.written = False  # its request was handed to gRPC
        self._on_written: list[Callable[[], None]] = []
        # done once gRPC has the request (its write submitted, not completed) or the session ended: the pull posts
        # its receives then, while the request travels (UCX keeps a message that comes first until they are posted)
        self.handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _handed(self) -> None:
        if not self.handed.done():
            self.handed.set_result(None)

    def when_written(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the pull's request has been handed to gRPC (at once if it was already): work
        that can wait until the request is on its way."""
        if self.written:
            callback()
        else:
            self._on_written.append(callback)

    def _written(self) -> None:
        self.written = True
        callbacks, self._on_written = self._on_written, []
        for callback in callbacks:
            callback()

    async def read(self) -> pb.PullResponse:
        item = await self.messages.get()
        if isinstance(item, StatusError):
            self.ended = True
            raise item
        if item.WhichOneof("message") == "done":
            self.ended = True
        return item

    def cancel(self) -> None:
        """Stop the pull on the prefill node (nothing to do once it ended); idempotent."""
        if not self.ended:
            self.ended = True
            self.session.cancel(self.grant_id)


class PullSession:
    """The session to one prefill node: ``open`` pulls on it; ``close`` ends it (every pull on it fails)."""

    def __init__(self, open_stream: Callable[[], grpc.aio.StreamStreamCall], address: str, *,
                 idle_s: float | None = None, batches: bool = False) -> None:
        self._open_stream, self.address, self.idle_s, self.batches = open_stream, address, idle_s, batches
        self._batch: list[pb.PullRequest] = []  # pulls opened and not yet taken by the writer
        self.supported = True
        self._active_at = time.monotonic()  # the last pull opened or message read
        self._call: grpc.aio.StreamStreamCall | None = None
        self._outgoing: asyncio.Queue[pb.PullSessionRequest | object] = asyncio.Queue()  # or _BATCH
        self._pulls: dict[str, SessionPull] = {}
        self._tasks: list[asyncio.Task] = []

    def open(self, request: pb.PullRequest) -> SessionPull:
        """Start a pull of ``request`` (its receives are posted): the message goes out at once."""
        if request.grant_id in self._pulls:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"grant {request.grant_id!r} is already being pulled")
        now = time.monotonic()
        if self._call is not None and not self._pulls and self.idle_s and now - self._active_at >= self.idle_s / 2:
            self._end(f"idle for {now - self._active_at:.1f} s; the prefill node ends sessions idle {self.idle_s:g} s")
        self._active_at = now
        if self._call is None:
            self._start()
        pull = self._pulls[request.grant_id] = SessionPull(self, request.grant_id)
        if self.batches:
            if not self._batch:  # the writer takes the batch at its next step, as it stands then
                self._outgoing.put_nowait(_BATCH)
            self._batch.append(request)
        else:
            self._outgoing.put_nowait(pb.PullSessionRequest(pull=request))
        hops.stamp(request.grant_id, "request")
        return pull

    def _take_batch(self) -> pb.PullSessionRequest | None:
        """The pulls opened since the writer last took them (those of the last turn of the loop, or more while
        it wrote), in one message (one pull: as a ``pull`` of its own); None if all were cancelled."""
        batch, self._batch = self._batch, []
        if not batch:
            return None
        return pb.PullSessionRequest(pull=batch[0]) if len(batch) == 1 else \
            pb.PullSessionRequest(pulls=pb.PullBatch(pulls=batch))

    def cancel(self, grant_id: str) -> None:
        if self._pulls.pop(grant_id, None) is None:
            return
        batch = [request for request in self._batch if request.grant_id != grant_id]
        if len(batch) < len(self._batch):  # not written yet: it never leaves
            self._batch = batch
        elif self._call is not None:
            self._outgoing.put_nowait(pb.PullSessionRequest(cancel_grant_id=grant_id))

    def _start(self) -> None:
        call = self._call = self._open_stream()
        self._outgoing = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._write(call, self._outgoing), name=f"pull-session-write-{self.address}"),
                       asyncio.create_task(self._read(call), name=f"pull-session-read-{self.address}")]

    async def _write(self, call: grpc.aio.StreamStreamCall, outgoing: asyncio.Queue) -> None:
        try:
            while True:
                message = await outgoing.get()
                if message is _BATCH and (message := self._take_batch()) is None:
                    continue
                kind = message.WhichOneof("message")
                pulls = (message.pull,) if kind == "pull" else message.pulls.pulls if kind == "pulls" else ()
                opened = [pull for request in pulls if (pull := self._pulls.get(request.grant_id)) is not None]
                loop = asyncio.get_running_loop()
                for pull in opened:  # runs once ``write`` below has handed the message to gRPC and waits
                    loop.call_soon(pull._handed)
                await call.write(message)
                for request in pulls:
                    hops.stamp(request.grant_id, "written")
                for pull in opened:
                    pull._written()
        except Exception as exc:  # the stream ended (an RPC error, or writes after its end): ``_read`` fails the pulls
            logger.debug("pull session to %s: write failed: %s: %s", self.address, type(exc).__name__, exc)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        why = "the prefill node ended it"
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                self._active_at = time.monotonic()
                pull = self._pulls.get(message.grant_id)
                if pull is None:  # a pull cancelled here, whose last messages were under way
                    continue
                if message.WhichOneof("message") == "failure":
                    del self._pulls[message.grant_id]
                    failure = message.failure
                    pull.messages.put_nowait(StatusError(status_code(failure.code), f"Pull from {self.address}: "
                                                         f"{failure.message}"))
                    continue
                if message.response.WhichOneof("message") == "done":
                    del self._pulls[message.grant_id]
                pull.messages.put_nowait(message.response)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                why = "the prefill node does not serve PullSession"
            else:
                why = f"{exc.code().name}: {exc.details()}"
        finally:
            if self._call is call:
                self._end(why)

    def _end(self, why: str) -> None:
        """Fail every pull on the stream (UNAVAILABLE) and forget the stream; the next ``open`` makes one."""
        call, self._call = self._call, None
        self._batch = []  # their pulls fail below
        if call is not None:
            call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        pulls, self._pulls = self._pulls, {}
        for pull in pulls.values():
            pull._handed()  # nothing will hand it on: it reads its failure
            pull.messages.put_nowait(StatusError(grpc.StatusCode.UNAVAILABLE,
                                                 f"Pull from {self.address}: the pull session ended ({why})"))
        if pulls:
            logger.warning("pull session to %s ended with %d pulls on it: %s", self.address, len(pulls), why)

    def close(self) -> None:
        """End the session (idempotent); pulls on it fail with UNAVAILABLE."""
        if self._call is not None:
            self._end("the session was closed")
