"""Conversions between the connector's types and the kpoolpd.v1 messages (enums map one to one)."""

from __future__ import annotations

import enum
import json

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.plan import RingRange
from kpool_pd.kvcache import BlockLayout


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
