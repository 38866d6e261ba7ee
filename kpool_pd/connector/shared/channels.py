"""gRPC channels to peers: TLS with a ``TlsConfig`` (its roots, its identity, its server name
override), else plaintext; with a peer token, every call in a session proved through PeerAuth."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kpool_pd.connector.shared.config import TlsConfig
from kpool_pd.connector.shared.peer_client import PeerProver


def open_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = (), *,
                 peer_token: str | None = None, challenge_timeout_s: float | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` (``host:port``).

    With ``peer_token`` (a decode node's channel to a prefill node) the channel's first call proves the
    token through ``kpoolpd.v1.PeerAuth/Challenge`` within ``challenge_timeout_s`` (required then; the
    connector's ``rpc_timeout_s``) and has the server prove it back; every call then carries the session's
    credential, never the token (``kpool_pd.connector.shared.peer_client``: what a refusal looks like, and how a
    forgotten session is recovered). ValueError for a peer token without a positive timeout."""
    interceptors, prover = (), None
    if peer_token is not None:
        if challenge_timeout_s is None:
            raise ValueError(f"open_channel to {address} with a peer token needs challenge_timeout_s (seconds > 0)")
        prover = PeerProver(peer_token, address, challenge_timeout_s=challenge_timeout_s)
        interceptors = prover.interceptors
    if tls is None:
        channel = grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors or None)
    else:
        extra = [("grpc.ssl_target_name_override", tls.server_name_override)] if tls.server_name_override else []
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *extra],
                                          interceptors=interceptors or None)
    if prover is not None:
        prover.bind(channel)
    return channel
