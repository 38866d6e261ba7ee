"""A prefill connector behind a daemon's gRPC server, for tests that run one without the daemon."""

from __future__ import annotations

from kpool_pd.connector import MAX_PEER_SESSIONS, PrefillConnector
from kpool_pd.runtime import GrpcServer


async def serve_prefill(node: PrefillConnector, *, host: str = "127.0.0.1", port: int = 0,
                        serving: bool = True, max_peer_sessions: int = MAX_PEER_SESSIONS) -> GrpcServer:
    """Start ``node`` and a server for it (the connector's peer token, TLS and message limits); the
    bound port is ``server.port``. ``serving``: the server's health gate opens once it started (as a
    daemon's does after its warm-up), else it stays closed (NOT_SERVING). ``max_peer_sessions``: the
    server's bound on peer sessions (``GrpcServer``)."""
    await node.start()  # before the server's threads exist: it may initialise UCX (see runtime.daemon.serve)
    config = node.config
    server = GrpcServer(peer_token=config.peer_token, tls=config.tls, options=config.grpc_options(),
                        max_peer_sessions=max_peer_sessions)
    server.add(node)
    await server.start(host, port)
    if serving:
        await server.health.open(server)
    return server


async def stop_prefill(server: GrpcServer, node: PrefillConnector) -> None:
    """Stop the server (calls in flight are cut), then the node (frees every grant)."""
    await server.stop(0)
    await node.stop()
