"""One Generate request inside the decode node, what it holds, and the events its handler receives."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from kpool_pd.connector import LandedRequest, StatusError
from kpool_pd.kvcache import CacheAllocation
from kpool_pd.model import DecodeSequence


class JobState(enum.Enum):
    """Where a request is; the value labels ``kpoolpd_decode_cancelled_total``."""

    WAITING = "waiting"          # queued for room in the batch
    PREFILLING = "prefilling"    # admitted (``allocation`` holds its blocks and ring); a Prefill call on a prefill node
    PULLING = "pulling"          # the pull of its grant into its allocation
    RELEASING = "releasing"      # landed; the grant's Release
    DECODING = "decoding"        # streaming its first token, then in the running batch (the loop owns its blocks)
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Tokens:
    """Tokens one decode step committed, in order."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed after it started streaming; the handler aborts the call with ``error``."""

    error: StatusError


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """The request's last event: its digests (the colocated run reproduces them) and counters."""

    output_digest: str
    state_digest: str
    num_tokens: int
    steps: int
    drafts_proposed: int
    drafts_accepted: int
    ttft_ms: float
    total_ms: float


JobEvent = Tokens | Failed | Finished


@dataclass(kw_only=True, eq=False)
class Job:
    """A request from submission to ``DecodeScheduler.finish``. Admission allocates ``need_blocks``
    blocks (the prompt's and the output's) and a ring as ``allocation``, which the pull lands the
    prompt into and ``finish`` releases; ``landed`` says how the pull went; ``events`` carry
    ``JobEvent``s from the decode loop to the handler."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    need_blocks: int
    mrope_positions: tuple[tuple[int, int, int], ...] = ()  # the prompt's, checked; (): text
    arrived: float = field(default_factory=time.perf_counter)
    state: JobState = JobState.WAITING
    admitted: asyncio.Future | None = None
    allocation: CacheAllocation | None = None
    landed: LandedRequest | None = None
    seq: DecodeSequence | None = None
    cancelled: bool = False
    events: asyncio.Queue[JobEvent] = field(default_factory=asyncio.Queue)
    prefill_address: str = ""
    prefill_engine_id: str = ""
    ttft_ms: float = 0.0
    transfer_bytes: int = 0  # the prompt's transfer, every DCP rank's summed
    transfer_regions: int = 0
    transfer_ms: float = 0.0  # the slowest rank's

    def pulling(self) -> None:
        """Its prompt's blocks were granted and its pull began (a push's, from inside its Prefill call)."""
        self.state = JobState.PULLING

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000
