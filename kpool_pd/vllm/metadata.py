"""What the scheduler side tells the worker side each step (vLLM's ``KVConnectorMetadata``), and the
``kv_transfer_params`` a producer hands out for its consumers (NixlConnector's request protocol)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connector import PrefillGrant, RingRange


@dataclass(frozen=True, kw_only=True)
class Offer:
    """Producer: request ``request_id``'s prompt is computed by the end of this step in ``block_ids``;
    hold them as grant ``grant_id``."""

    request_id: str
    grant_id: str
    block_ids: tuple[int, ...]
    prompt_len: int


@dataclass(frozen=True, kw_only=True)
class Load:
    """Consumer: pull the grant of ``params`` into ``block_ids`` (vLLM's blocks for request ``request_id``)."""

    request_id: str
    params: dict
    block_ids: tuple[int, ...]


@dataclass
class KpoolPdMetadata(KVConnectorMetadata):
    offers: list[Offer] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    idle: bool = False  # the step schedules no token: vLLM steps only to hear about transfers


def is_idle(scheduler_output) -> bool:
    """A step that schedules no token (vLLM steps on while requests wait on transfers)."""
    return scheduler_output.total_num_scheduled_tokens == 0


def producer_params(offer: Offer, *, address: str, engine_id: str, lease_s: float) -> dict:
    """The prefill request's output ``kv_transfer_params``: what the decode request sends back."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_address": address, "remote_request_id": offer.request_id, "remote_grant_id": offer.grant_id,
            "remote_block_ids": list(offer.block_ids), "remote_num_tokens": offer.prompt_len,
            "remote_lease_ms": int(lease_s * 1000)}


def is_remote_prefill(params: dict | None) -> bool:
    """A decode request whose prompt waits on a kpool-pd producer."""
    return bool(params) and bool(params.get("do_remote_prefill")) and bool(params.get("remote_grant_id"))


def grant_from(params: dict) -> PrefillGrant:
    """The grant the params name; ValueError naming the key for params that cannot be one."""
    try:
        block_ids = tuple(int(b) for b in params["remote_block_ids"])
        return PrefillGrant(grant_id=str(params["remote_grant_id"]), request_id=str(params["remote_request_id"]),
                            prompt_len=int(params["remote_num_tokens"]), num_blocks=len(block_ids),
                            ring_live=RingRange(0, 0), first_token=0,
                            lease_s=int(params.get("remote_lease_ms", 30000)) / 1000,
                            src_block_ids=block_ids, src_ring_id=0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"kv_transfer_params do not name a kpool-pd grant: {type(exc).__name__}: {exc}") from None
