"""``GrantReleaser``: the router gives a producer's grant back when the decode half of a PD request will not
happen (every decode instance unreachable, or each refused the request before it pulled), so that the
producer frees the prompt's blocks at once rather than when the grant's lease ends.

It calls the producer connector's ``Release`` naming no decode engine, which releases an offered grant no
engine has claimed yet (``kpool_pd.connector.prefill.grants.GrantKeeper.release``); the grant's key (its id bound to
its prompt, ``kpool_pd.transfer_params``) is the claim, and the call proves the fleet's peer token through
the PeerAuth challenge (``connector.open_channel``), which never sends the token itself. The address is the
one the producer's own answer named (the router chose that producer; the client's body plays no part).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kpool_pd.connector import open_channel, prefill_api
from kpool_pd.transfer_params import release_target

logger = logging.getLogger(__name__)


class GrantReleaser:
    """Releases producers' grants over gRPC, one short-lived channel a release. ``peer_token``: the fleet's
    (``--peer-token``); ``timeout_s`` bounds each release, the challenge included."""

    def __init__(self, *, peer_token: str | None, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self._token, self._timeout_s = peer_token, timeout_s
        self._tasks: set[asyncio.Task] = set()

    async def release(self, params: dict, request_id: str) -> bool:
        """Release the grant ``params`` (a prefill's ``kv_transfer_params``) name; True when the producer
        released it. Never raises: a failure is logged, and the grant's lease frees it."""
        target = release_target(params) if isinstance(params, dict) else None
        if target is None:
            logger.warning("request %s: its kv_transfer_params name no grant to release", request_id)
            return False
        address, key = target
        task = asyncio.ensure_future(self._release(address, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            released = await asyncio.shield(task)
        except asyncio.CancelledError:
            raise  # the release goes on in its task; close() waits for it
        except Exception as exc:
            logger.warning("request %s: the grant on %s was not released (its lease frees it): %s", request_id,
                           address, exc)
            return False
        logger.info("request %s: the grant on %s %s", request_id, address,
                    "was released" if released else "was already gone")
        return released

    async def _release(self, address: str, key: str) -> bool:
        channel = open_channel(address, None, peer_token=self._token, challenge_timeout_s=self._timeout_s)
        try:
            stub = prefill_api.PrefillServiceStub(channel)
            answer = await stub.Release(prefill_api.ReleaseRequest(grant_id=key), timeout=self._timeout_s)
            return answer.released
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"{exc.code().name}: {exc.details()}") from None
        finally:
            await channel.close()

    async def close(self) -> None:
        """Wait (within ``timeout_s``) for the releases still running; the router's clean-up calls it."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self._timeout_s)
