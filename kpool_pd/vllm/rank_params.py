"""The ranks of a producer as a decode request's ``kv_transfer_params`` name them, checked field by field.

A producer of TP ``T`` hands out, besides the fields ``kpool_pd.transfer_params.DecodeParams`` reads:

| field | meaning |
|---|---|
| ``remote_tp_size`` | ``T``, the producer's TP size (absent: 1) |
| ``remote_rank_addresses`` | ``T`` ``"host:port"`` strings, rank ``r``'s PrefillService at index ``r`` (absent with ``T`` 1: ``[remote_address]``); rank 0's is ``remote_address`` |

Each address is one the consumer's ``producers`` must allow before it is dialed, as ``remote_address`` is.
Rank 0 is dialed at ``remote_address`` (a proxy that rewrites it is followed, as with one rank), whatever
the list's first entry says. A field of the wrong type or out of range, or a list of another length than
``remote_tp_size``, is a ValueError naming the field (``kpool_pd.vllm.guard`` answers it
HTTP 400; inside the engine the request computes its prompt itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kpool_pd.transfer_params import MAX_ADDRESS_CHARS, split_host_port
from kpool_pd.vllm.ranks import MAX_TP

TP_FIELD = "remote_tp_size"
ADDRESSES_FIELD = "remote_rank_addresses"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True, kw_only=True)
class RankParams:
    """The checked ranks of a producer: ``addresses[r]`` is rank ``r``'s (``tp_size`` of them)."""

    tp_size: int
    addresses: tuple[str, ...]

    @classmethod
    def parse(cls, params: Mapping) -> "RankParams":
        """The ranks of ``params`` (a decode request's, whose ``remote_address`` ``DecodeParams.parse``
        checked); ValueError naming the first bad field."""
        address = params.get("remote_address")
        tp_size = params.get(TP_FIELD, 1)
        if type(tp_size) is not int or not 1 <= tp_size <= MAX_TP:
            raise ValueError(f"kv_transfer_params[{TP_FIELD!r}] must be an integer 1 to {MAX_TP}, got {_shown(tp_size)}")
        if ADDRESSES_FIELD not in params:
            if tp_size != 1:
                raise ValueError(f"kv_transfer_params[{ADDRESSES_FIELD!r}] is missing: a producer of "
                                 f"{TP_FIELD} {tp_size} names one address a rank")
            return cls(tp_size=1, addresses=(address,))
        addresses = params[ADDRESSES_FIELD]
        if not isinstance(addresses, list) or len(addresses) != tp_size:
            raise ValueError(f"kv_transfer_params[{ADDRESSES_FIELD!r}] must be a list of {tp_size} addresses (one "
                             f"per rank of {TP_FIELD} {tp_size}), got {_shown(addresses)}")
        for rank, value in enumerate(addresses):
            where = f"kv_transfer_params[{ADDRESSES_FIELD!r}][{rank}]"
            if not isinstance(value, str) or len(value) > MAX_ADDRESS_CHARS:
                raise ValueError(f"{where} must be a 'host:port' string of at most {MAX_ADDRESS_CHARS} "
                                 f"characters, got {_shown(value)}")
            split_host_port(value, where)
        return cls(tp_size=tp_size, addresses=(address, *addresses[1:]))  # rank 0: remote_address
