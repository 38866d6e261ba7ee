"""Decode-context parallel (DCP): which rank of a decode instance holds which token (DESIGN section 2).

A DCP decode instance of ``size`` ranks deals a request's positions round-robin at an interleave of
``interleave`` tokens: position ``pos`` lives on rank ``(pos // interleave) % size``, and so does the
compressed entry of its pool (the interleave is a multiple of the pool, so a pool never straddles two
ranks). Each rank stores only its own tokens, densely: its ``local`` position of an owned ``pos`` is

    local = (pos // (interleave * size)) * interleave + pos % interleave

so rank r's cache is an ordinary request cache of its own tokens in local positions (its blocks
hold ``block_size`` local tokens each), and its memory is ``1 / size`` of the request's. With an
interleave that is a multiple of the block size, a rank's local blocks are whole blocks of the
request (a transfer moves large regions); a smaller interleave cuts blocks into runs of
``interleave`` tokens. Every rank also keeps the request's whole tail ring (not sharded).

Every function takes a plain ``int`` or an integer tensor (elementwise) unless it says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from kpool_pd.kvcache.family import family_spec_type
from kpool_pd.kvcache.specs import CacheFamily

if TYPE_CHECKING:
    from kpool_pd.kvcache.config import CacheConfig

Pos = TypeVar("Pos", int, torch.Tensor)


def family_supports_dcp(family: CacheFamily) -> bool:
    """Whether a cache family can be sharded over DCP ranks: kpool yes; QSA declares no DCP support."""
    return family_spec_type(family).supports_dcp


@dataclass(frozen=True, kw_only=True)
class DcpConfig:
    """A decode instance's DCP shape: ``size`` ranks dealt ``interleave`` tokens at a time.

    ``size == 1`` is an ordinary decode instance (one rank holds everything).
    """

    size: int = 1
    interleave: int

    def __post_init__(self) -> None:
        for name, value in (("dcp size", self.size), ("dcp interleave", self.interleave)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def for_cache(cls, cache: CacheConfig, *, size: int, interleave: int | None = None) -> DcpConfig:
        """The DCP shape of a decode instance over ``cache``; ``interleave`` None means the block size.

        ValueError (naming DCP and the numbers) for a family that declares no DCP support with
        ``size > 1``, or an interleave that is not a multiple of the tokens per compressed entry.
        """
        config = cls(size=size, interleave=cache.block_size if interleave is None else interleave)
        if size > 1 and not family_supports_dcp(cache.family):
            raise ValueError(f"the {cache.family.value} cache family declares no decode-context parallel (DCP) "
                             f"support: dcp size must be 1, got {size}")
        group = cache.tokens_per_entry
        if config.interleave % group:
            raise ValueError(f"dcp interleave ({config.interleave} tokens) must be a multiple of kpool ({group})")
        return config

    def rank_blocks_for_request(self, cache: CacheConfig, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks of ``cache`` each rank reserves for a request at its largest: the most any rank needs for
        its share of ``cache.positions_written``, so that ranks' pools of one size, admitted by rank 0's
        count, never run short (size 1: ``cache.blocks_for_request``). ValueError as that."""
        written = cache.positions_written(prompt_len, max_new_tokens)
        return max(shard.blocks_for_tokens(cache, written) for shard in self.shards())

    def shard(self, rank: int) -> DcpShard:
        return DcpShard(size=self.size, rank=rank, interleave=self.interleave)

    def shards(self) -> list[DcpShard]:
        return [self.shard(rank) for rank in range(self.size)]


@dataclass(frozen=True, kw_only=True)
class DcpShard:
    """Rank ``rank`` of a DCP decode instance: its ownership arithmetic."""

    size: int
    rank: int
    interleave: int

    def __post_init__(self) -> None:
        DcpConfig(size=self.size, interleave=self.interleave)
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"dcp rank must be in [0, {self.size}), got {self.rank!r}")

    @property
    def cycle(self) -> int:
        """Tokens in one round of every rank: interleave * size."""
        return self.interleave * self.size

    def owner(self, pos: Pos) -> Pos:
        """The rank holding position ``pos``."""
        return (pos // self.interleave) % self.size

    def owns(self, pos: Pos) -> bool | torch.Tensor:
        return self.owner(pos) == self.rank

    def local_position(self, pos: Pos) -> Pos:
        """This rank's local position of an owned ``pos`` (meaningless for another rank's)."""
        return (pos // self.cycle) * self.interleave + pos % self.interleave

    def global_position(self, local: Pos) -> Pos:
        """The position whose local position on this rank is ``local``."""
        return (local // self.interleave) * self.cycle + self.rank * self.interleave + local % self.interleave

    def owned_tokens(self, num_tokens: Pos) -> Pos:
        """How many of positions ``[0, num_tokens)`` this rank holds (its local length)."""
        full, rest = num_tokens // self.cycle, num_tokens % self.cycle
        mine = rest - self.rank * self.interleave
        if isinstance(mine, torch.Tensor):
            mine = mine.clamp(0, self.interleave)
        else:
            mine = min(max(mine, 0), self.interleave)
        return full * self.interleave + mine

    def owned_runs(self, start: int, end: int) -> list[tuple[int, int]]:
        """This rank's positions within ``[start, end)`` as (first position, length) runs, in order;
        each run lies within one interleave chunk, so its local positions are consecutive too."""
        runs: list[tuple[int, int]] = []
        chunk = start // self.interleave
        while chunk * self.interleave < end:
            lo, hi = max(start, chunk * self.interleave), min(end, (chunk + 1) * self.interleave)
            if chunk % self.size == self.rank and lo < hi:
                runs.append((lo, hi - lo))
            chunk += 1
        return runs

    def blocks_for_tokens(self, cache: CacheConfig, num_tokens: int) -> int:
        """Local blocks of ``cache`` this rank needs for its share of positions ``[0, num_tokens)``."""
        return cache.blocks_for_tokens(self.owned_tokens(num_tokens))
