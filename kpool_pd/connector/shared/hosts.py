"""Bind hosts and the addresses local clients dial for them.

A daemon binds its servers to ``--host``; a wildcard host (``WILDCARD_HOSTS``: every interface) is
not an address one can dial, so a client on the same machine (the drain's listener probe, rank 0 of a
DCP instance reaching its ranks) dials the loopback address instead.
"""

from __future__ import annotations

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
LOOPBACK = "127.0.0.1"


def dial_host(bind_host: str) -> str:
    """The address a client on this machine dials to reach a server bound to ``bind_host``: the
    loopback address for a wildcard host, the host itself (without IPv6 brackets) otherwise."""
    host = bind_host.strip()
    return LOOPBACK if host in WILDCARD_HOSTS else host.strip("[]")


def dial_target(bind_host: str, port: int) -> str:
    """``dial_host(bind_host)`` and ``port`` as a gRPC target (``host:port``, IPv6 in brackets)."""
    host = dial_host(bind_host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
