"""The caller's side of the peer token's challenge (``kpool_pd.connector.shared.peer_auth``): the interceptors that
``open_channel`` attaches to a channel opened with a peer token.

One ``PeerProver`` per channel. The channel's first call runs ``PeerAuth/Challenge`` (deadline:
``challenge_timeout_s``) with a fresh 32-byte nonce, and goes on only once the server proved the token;
calls that arrive meanwhile wait for that same Challenge. The session's credential is then added to
every call (any ``authorization`` entry the caller gave is replaced: the peer token never goes out).

- A server that does not prove the token (a wrong proof, another token, no PeerAuth) fails the call with
  UNAUTHENTICATED, "peer <address> did not prove the peer token (...)", and nothing else is sent to it;
  the next call challenges again. A Challenge that fails otherwise (UNAVAILABLE, its deadline) fails the
  call with that status.
- A server that does not hold the session (it forgot it, or it is a new process on that address) answers
  ``UNKNOWN_SESSION``: the session is dropped. A unary call then challenges again and is sent once more,
  within its own deadline (the refused call reached no handler, so sending it again is safe); a stream
  fails as any refused stream does, and the channel's next call challenges again.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from dataclasses import dataclass

import grpc

from kpool_pd.connector.shared.peer_auth import (CHALLENGE_METHOD, NONCE_BYTES, SERVICE_NAME, UNKNOWN_SESSION, ChallengeRequest,
                                        PeerAuthStub, client_credential, peer_authorization, server_proof)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerSession:
    """A session the server proved: its name there and the credential every call presents."""

    server_nonce: bytes
    credential: bytes

    @property
    def authorization(self) -> str:
        return peer_authorization(self.server_nonce, self.credential)

    def __repr__(self) -> str:  # the credential is a secret: never in a log line
        return f"PeerSession({self.server_nonce.hex()[:8]}...)"


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A failure as the channel's calls report theirs (callers map AioRpcError to StatusError)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _is_unknown_session(code: grpc.StatusCode, details: str | None) -> bool:
    return code is grpc.StatusCode.UNAUTHENTICATED and details == UNKNOWN_SESSION


class PeerProver:
    """The peer session of one channel to ``address`` (``host:port``, for messages): made by ``open_channel``
    before the channel, ``bind`` to it after; used on the channel's event loop only. ``interceptors`` are the
    four that the channel is made with."""

    def __init__(self, token: str, address: str, *, challenge_timeout_s: float) -> None:
        if not isinstance(token, str) or not token.strip():
            raise ValueError("the peer token must be a non-empty string")
        if not isinstance(challenge_timeout_s, (int, float)) or not 0 < challenge_timeout_s < float("inf"):
            raise ValueError(f"challenge_timeout_s must be a finite number of seconds > 0, got {challenge_timeout_s!r}")
        self._token = token
        self.address = address
        self.challenge_timeout_s = float(challenge_timeout_s)
        self._stub: PeerAuthStub | None = None
        self._session: PeerSession | None = None
        self._challenging: asyncio.Task | None = None
        self._watching: set[asyncio.Task] = set()  # ended streams whose status is being read
        self.challenges = 0  # Challenges sent (diagnosis and tests)
        self.interceptors = (_UnaryUnary(self), _UnaryStream(self), _StreamUnary(self), _StreamStream(self))

    def bind(self, channel: grpc.aio.Channel) -> None:
        """The channel the Challenges go on (the one made with ``interceptors``); once, before its first call."""
        if self._stub is not None:
            raise RuntimeError(f"the peer prover of {self.address} is bound already")
        self._stub = PeerAuthStub(channel)

    @property
    def session(self) -> PeerSession | None:
        """The proved session, None before the first Challenge answered or after the server forgot it."""
        return self._session

    async def _proved(self, deadline: float | None) -> PeerSession:
        """The session, challenging first when there is none (one Challenge for every call that waits)."""
        if self._session is not None:
            return self._session
        if self._challenging is None:
            self._challenging = asyncio.ensure_future(self._challenge())
            self._challenging.add_done_callback(self._challenged)
        wait_s = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        try:  # shielded: a caller that leaves (cancelled, its deadline) leaves the others' Challenge running
            return await asyncio.wait_for(asyncio.shield(self._challenging), wait_s)
        except asyncio.TimeoutError:
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, f"the call's deadline passed while {SERVICE_NAME}/Challenge "
                         f"to {self.address} was unanswered") from None

    def _challenged(self, task: asyncio.Task) -> None:
        if self._challenging is task:
            self._challenging = None
        if not task.cancelled() and task.exception() is not None:  # read here: its waiters may all have left
            logger.debug("peer challenge of %s failed: %s", self.address, task.exception())

    async def _challenge(self) -> PeerSession:
        if self._stub is None:
            raise RuntimeError(f"the peer prover of {self.address} was not bound to its channel")
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        self.challenges += 1
        failure = None
        try:
            r = await self._stub.Challenge(ChallengeRequest(client_nonce=client_nonce),
                                           timeout=self.challenge_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # Raised below, outside this block: an error chained to ``exc`` would keep the failed call, and with it
            # the connection, alive past the channel's close (until the garbage collector ran).
            failure = exc.code(), exc.details()
        if failure is not None:
            code, details = failure
            if code is grpc.StatusCode.UNIMPLEMENTED:
                raise self._unproved(f"it does not serve {SERVICE_NAME}")
            raise _error(code, f"{SERVICE_NAME}/Challenge to {self.address}: {details}")
        expected = server_proof(self._token, client_nonce, r.server_nonce)
        if len(r.server_nonce) != NONCE_BYTES or not hmac.compare_digest(r.server_proof, expected):
            raise self._unproved("its proof is wrong: another token, or not a prefill node of this fleet")
        self._session = PeerSession(server_nonce=r.server_nonce,
                                    credential=client_credential(self._token, client_nonce, r.server_nonce))
        return self._session

    def _unproved(self, why: str) -> grpc.aio.AioRpcError:
        logger.warning("peer %s did not prove the peer token (%s); nothing was sent to it", self.address, why)
        return _error(grpc.StatusCode.UNAUTHENTICATED, f"peer {self.address} did not prove the peer token ({why})")

    def _forget(self, session: PeerSession) -> None:
        """Drop ``session`` if it is still the channel's (another call may have replaced it already)."""
        if self._session is session:
            self._session = None
            logger.info("peer %s does not know this channel's session (it forgot it, or restarted); "
                        "challenging again", self.address)

    # the calls -------------------------------------------------------------------------------
    @staticmethod
    def _exempt(details: grpc.aio.ClientCallDetails) -> bool:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        return method == CHALLENGE_METHOD

    @staticmethod
    def _deadline(details: grpc.aio.ClientCallDetails) -> float | None:
        return None if details.timeout is None else asyncio.get_running_loop().time() + details.timeout

    @staticmethod
    def _with(details: grpc.aio.ClientCallDetails, session: PeerSession,
              deadline: float | None) -> grpc.aio.ClientCallDetails:
        """``details`` with the session's credential in place of any ``authorization``, and the time left."""
        metadata = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != "authorization"])
        metadata.add("authorization", session.authorization)
        timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        return details._replace(metadata=metadata, timeout=timeout)

    async def unary(self, continuation, details, request):
        """A unary-response call: sent in the session; sent again once, in a new one, if the server forgot it."""
        if self._exempt(details):
            return await continuation(details, request)
        deadline = self._deadline(details)
        session = await self._proved(deadline)
        call = await continuation(self._with(details, session, deadline), request)
        try:
            code = await call.code()
        except asyncio.CancelledError:  # the caller left: the call goes too (a Prefill's grant is not made)
            call.cancel()
            raise
        if not _is_unknown_session(code, await call.details()):
            return call
        self._forget(session)
        if deadline is not None and deadline <= asyncio.get_running_loop().time():
            return call
        session = await self._proved(deadline)
        return await continuation(self._with(details, session, deadline), request)

    async def stream(self, continuation, details, requests):
        """A streaming-response (or streaming-request) call: sent in the session; if the server forgot it,
        the call fails as refused and the session is dropped for the channel's next call."""
        if self._exempt(details):
            return await continuation(details, requests)
        deadline = self._deadline(details)
        session = await self._proved(deadline)
        call = await continuation(self._with(details, session, deadline), requests)
        call.add_done_callback(lambda ended: self._watch(ended, session))
        return call

    def _watch(self, call, session: PeerSession) -> None:
        task = asyncio.ensure_future(self._forget_if_unknown(call, session))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _forget_if_unknown(self, call, session: PeerSession) -> None:
        if _is_unknown_session(await call.code(), await call.details()):
            self._forget(session)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, prover: PeerProver) -> None:
        self._prover = prover

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._prover.unary(continuation, client_call_details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, prover: PeerProver) -> None:
        self._prover = prover

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._prover.stream(continuation, client_call_details, request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, prover: PeerProver) -> None:
        self._prover = prover

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._prover.stream(continuation, client_call_details, request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, prover: PeerProver) -> None:
        self._prover = prover

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._prover.stream(continuation, client_call_details, request_iterator)
