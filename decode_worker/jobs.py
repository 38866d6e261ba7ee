"""One Generate request inside the decode node, and what it holds."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from connector.decode import LandedRequest
from model import DecodeSequence


class JobState(enum.Enum):
    WAITING = "waiting"      # queued for room in the batch
    FETCHING = "fetching"    # prefill, transfer
    DECODING = "decoding"    # in the running batch (the decode loop owns its blocks)
    DONE = "done"


@dataclass(kw_only=True, eq=False)
class Job:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    need_blocks: int
    arrived: float = field(default_factory=time.perf_counter)
    state: JobState = JobState.WAITING
    admitted: asyncio.Future | None = None
    landed: LandedRequest | None = None
    extra_blocks: list[int] = field(default_factory=list)
    reserved: bool = False
    seq: DecodeSequence | None = None
    cancelled: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefill_address: str = ""
    prefill_engine_id: str = ""
    ttft_ms: float = 0.0

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000
