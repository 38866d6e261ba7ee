"""The one liveness loop a decode node runs per prefill peer (owned by its ``PrefillPeer``).

Every ``period_s`` it sends one Heartbeat naming the grants the peer is pulling now (their leases are
renewed while their pulls run; an empty Heartbeat otherwise: the prefill node forgets engines it does not
hear from). When the prefill node answers that it does not know this engine (it forgot it after a long
silence, or restarted), the loop handshakes again on the same channel, reusing the first Handshake's
request (no warm-up message: the endpoint to this engine is warm) and this engine's secret on the node;
the secret the node answers with is kept (``EngineSecrets``). Failures are left to the router's
health checks and the calls' own errors; the loop ends when the peer closes (``stop``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.decode.engine_secrets import EngineSecrets
from kpool_pd.connector.shared.config import ConnectorConfig

logger = logging.getLogger(__name__)


class KeepAlive:
    """The loop of one peer: ``stub`` its channel's, ``handshake`` the request its Handshake sent,
    ``secrets`` this engine's (read and renewed here), ``grants`` what to renew now (the peer's pulls in
    flight)."""

    def __init__(self, stub: pb.PrefillServiceStub, handshake: pb.HandshakeRequest, config: ConnectorConfig,
                 secrets: EngineSecrets, *, address: str, period_s: float, grants: Callable[[], list[str]]) -> None:
        if not period_s > 0:
            raise ValueError(f"keep-alive period must be > 0 s, got {period_s!r}")
        self.stub, self.handshake, self.config, self.address = stub, handshake, config, address
        self.secrets = secrets
        self.period_s, self.grants = period_s, grants
        self.beats = 0  # Heartbeats answered (tests and diagnosis)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the loop on the running event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"keepalive-{self.address}")

    async def stop(self) -> None:
        """End the loop and wait until it ended (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.beat()
            except grpc.aio.AioRpcError as exc:
                logger.debug("keep-alive of %s: %s %s", self.address, exc.code().name, exc.details())

    async def beat(self) -> None:
        """One Heartbeat (renewing ``grants()``), and a Handshake if the prefill node does not know us;
        the call's AioRpcError propagates."""
        engine_id = self.handshake.engine_id
        try:
            r = await self.stub.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id, grant_ids=self.grants(),
                                                              engine_secret=self.secrets.get(self.address)),
                                          timeout=self.config.rpc_timeout_s)
            unknown = r.engine_unknown
        except grpc.aio.AioRpcError as exc:  # a node that refuses unknown engines outright
            if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
            unknown = True
        self.beats += 1
        if unknown:
            logger.info("prefill node %s does not know engine %s (any more); handshaking again", self.address,
                        engine_id)
            self.handshake.engine_secret = self.secrets.get(self.address)
            r = await self.stub.Handshake(self.handshake, timeout=self.config.rpc_timeout_s)
            self.secrets.keep(self.address, r.engine_secret)
