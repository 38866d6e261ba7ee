"""The secrets a decode engine holds, one per prefill node, which every call to that node presents.

A prefill node binds an engine id to the engine whose Handshake first claimed it; a call naming the id
without its secret is refused PERMISSION_DENIED. The decode engine draws the secret itself, before its
first Handshake with a node, and presents it there: the node holds the id under it (or answers with the
one it holds, which replaces it here). So a Handshake whose reply was lost (the engine gave up waiting while
the node admitted it) is retried with the same secret and admitted as the same engine, never locked out;
a new channel to the same node presents it too, and a node that forgot the engine (or restarted) takes it
again. A new process is a new engine (its engine id names its pid) with secrets of its own.
"""

from __future__ import annotations

import secrets

SECRET_BYTES = 32  # as a prefill node's (connector.prefill.decode_engines.SECRET_BYTES)


class EngineSecrets:
    """This engine's secret on each prefill node, by the node's address (``host:port``). One event loop."""

    __slots__ = ("_by_address",)

    def __init__(self) -> None:
        self._by_address: dict[str, bytes] = {}

    def get(self, address: str) -> bytes:
        """The secret to present to ``address`` (drawn at the first call for it)."""
        secret = self._by_address.get(address)
        if secret is None:
            secret = self._by_address[address] = secrets.token_bytes(SECRET_BYTES)
        return secret

    def keep(self, address: str, secret: bytes) -> None:
        """The secret ``address`` answered a Handshake with (a node that sends none keeps the old)."""
        if secret:
            self._by_address[address] = bytes(secret)

    def __repr__(self) -> str:
        return f"EngineSecrets({sorted(self._by_address)})"
