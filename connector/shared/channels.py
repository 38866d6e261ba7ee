"""gRPC channels to peers: TLS with a ``TlsConfig`` (its roots, its identity, its server name
override), else plaintext."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from connector.shared.config import TlsConfig


def open_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` (``host:port``)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    extra = [("grpc.ssl_target_name_override", tls.server_name_override)] if tls.server_name_override else []
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *extra])
