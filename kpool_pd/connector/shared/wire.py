"""Conversions between the connector's types and the kpoolpd.v1 messages (enums map one to one)."""

from __future__ import annotations

import enum
import json

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.plan import PoolKind, Region, RingRange
from kpool_pd.kvcache import BlockLayout


# The connector protocol this build speaks, stated by both sides in the Handshake; a peer of another version is
# refused by name (an older one states none: 0). 2: a Pull carries the decode node's plan, served as it is.
PROTOCOL_VERSION = 2


def protocol_name(version: int) -> str:
    """A protocol version as messages name it."""
    return f"connector protocol {version}" if version else "a connector protocol older than 2 (it states no version)"


class Transport(enum.Enum):
    """Data plane of a pull; values match ``kpoolpd.v1.Transport``."""

    UCX = pb.TRANSPORT_UCX
    GRPC_STREAM = pb.TRANSPORT_GRPC_STREAM

    @property
    def label(self) -> str:
        return "ucx" if self is Transport.UCX else "grpc"

    @classmethod
    def parse(cls, name: str) -> "Transport":
        names = {"ucx": cls.UCX, "grpc": cls.GRPC_STREAM, "grpc_stream": cls.GRPC_STREAM}
        if name not in names:
            raise ValueError(f"transport must be one of {sorted(names)}, got {name!r}")
        return names[name]



_TRANSPORT_VALUES = frozenset(t.value for t in Transport)


def transports_from(values) -> tuple[Transport, ...]:
    """The transports a message lists, in its order; values this build does not know are skipped
    (a newer peer may offer more)."""
    return tuple(Transport(v) for v in values if v in _TRANSPORT_VALUES)

def layout_message(layout: BlockLayout) -> pb.Layout:
    return pb.Layout(
        layout_hash=layout.layout_hash,
        fields_json=json.dumps(layout.config.hash_fields(), sort_keys=True),
        block_bytes=layout.block_bytes,
        ring_block_bytes=layout.ring_block_bytes,
    )


def ring_message(live: RingRange) -> pb.RingRange:
    return pb.RingRange(start_slot=live.start_slot, num_slots=live.num_slots)


def ring_from(msg: pb.RingRange) -> RingRange:
    return RingRange(start_slot=msg.start_slot, num_slots=msg.num_slots)


def region_message(region: Region) -> pb.Region:
    return pb.Region(kind=region.kind.value, offset=region.offset, nbytes=region.nbytes, plane=region.plane)


def region_from(msg: pb.Region) -> Region:
    """ValueError naming the value for a pool kind this build does not know."""
    if msg.kind not in _POOL_KIND_VALUES:
        raise ValueError(f"pool kind {msg.kind} is none of {sorted(_POOL_KIND_VALUES)}")
    return Region(PoolKind(msg.kind), msg.offset, msg.nbytes, msg.plane)


_POOL_KIND_VALUES = frozenset(k.value for k in PoolKind)
