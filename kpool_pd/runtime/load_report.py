"""A node's load, carried on the health checks its peers already send (no extra round trip).

A prefill node reports how much work it has: the prompt tokens admitted and not yet computed, its free
blocks (and the tokens a block holds, so that a peer can tell whether a prompt fits), the prefill steps
running, and the grants it holds (pulls still to be served). The report rides in the trailing metadata of
its grpc.health.v1 ``Check`` answers, under ``LOAD_METADATA_KEY``, as ``name=value`` pairs joined by ``;``
(the way gRPC's ORCA reports ride in trailers); a node that reports nothing sends no such key, and a
checker treats its load as unknown. Names it does not know are skipped, so that a field can be added
without breaking older checkers.

``LoadReportingHealth`` is the health servicer that attaches the report; ``NodeLoad.from_metadata`` reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from grpc_health.v1 import health

LOAD_METADATA_KEY = "kpoolpd-load"


@dataclass(frozen=True, kw_only=True)
class NodeLoad:
    """One load report. Counts are non-negative integers; ``block_tokens`` is positive."""

    queued_prompt_tokens: int  # admitted, not yet computed (a prompt's remaining chunks included)
    free_blocks: int
    block_tokens: int  # tokens a block holds
    steps_in_flight: int  # prefill steps running now
    grants_held: int = 0  # grants whose blocks are held for a pull

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"NodeLoad.{f.name} must be an integer >= 0, got {value!r}")
        if self.block_tokens == 0:
            raise ValueError("NodeLoad.block_tokens must be > 0, got 0")

    def blocks_for(self, tokens: int) -> int:
        """Blocks a prompt of ``tokens`` tokens takes on this node."""
        return -(-tokens // self.block_tokens)

    def to_metadata(self) -> tuple[tuple[str, str]]:
        text = ";".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return ((LOAD_METADATA_KEY, text),)

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> NodeLoad | None:
        """The report in ``metadata`` (a call's trailing metadata), None when there is none; ValueError naming
        the text when it is malformed or misses a field."""
        text = next((v for k, v in metadata or () if k == LOAD_METADATA_KEY), None)
        if text is None:
            return None
        if isinstance(text, bytes):
            text = text.decode("ascii", errors="replace")
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, int] = {}
        for pair in text.split(";"):
            name, sep, value = pair.partition("=")
            if not sep or not value.strip().isdigit():
                raise ValueError(f"malformed load report {text!r}: {pair!r} is not name=count")
            if name.strip() in known:
                values[name.strip()] = int(value)
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"load report {text!r} lacks a field: {exc}") from None


class LoadReportingHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose ``Check`` answers carry ``load()`` in their trailing metadata (when ``load`` is
    given). ``load`` runs on the server's event loop and must not block."""

    def __init__(self, load: Callable[[], NodeLoad] | None = None) -> None:
        super().__init__()
        self.load = load

    async def Check(self, request, context):  # noqa: N802 (gRPC's method name)
        if self.load is not None:
            context.set_trailing_metadata(self.load().to_metadata())
        return await super().Check(request, context)
