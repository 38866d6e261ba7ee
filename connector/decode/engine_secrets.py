"""The secrets a decode engine holds, one per prefill node: what each node's first Handshake of this engine
returned (``HandshakeResponse.engine_secret``), which every later call to that node presents.

A prefill node binds an engine id to the engine whose Handshake first claimed it; a call naming the id
without its secret is refused PERMISSION_DENIED. The decode engine therefore keeps each node's secret for
as long as it runs: a new channel to the same node (the router handshakes again after a failure) presents
it, and a node that forgot the engine (or restarted) hands out a new one, which replaces it here. A new
process is a new engine (its engine id names its pid) and starts with none.
"""

from __future__ import annotations


class EngineSecrets:
    """This engine's secret on each prefill node, by the node's address (``host:port``). One event loop."""

    __slots__ = ("_by_address",)

    def __init__(self) -> None:
        self._by_address: dict[str, bytes] = {}

    def get(self, address: str) -> bytes:
        """The secret to present to ``address`` (empty before its first Handshake)."""
        return self._by_address.get(address, b"")

    def keep(self, address: str, secret: bytes) -> None:
        """The secret ``address`` answered a Handshake with (a node that sends none keeps the old)."""
        if secret:
            self._by_address[address] = bytes(secret)

    def __repr__(self) -> str:
        return f"EngineSecrets({sorted(self._by_address)})"
