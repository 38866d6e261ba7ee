"""Which ranks of a producer engine each rank of a consumer engine reads, under tensor parallelism (TP),
following vLLM's rules for heterogeneous TP (NixlConnector's ``TransferTopology`` and ``compute_tp_mapping``).

Every worker rank of an engine serves its own pulls (``rank_port``) and holds its own part of the KV cache:

- caches split by head (``Sharding.BY_HEAD``: full and sliding-window attention): rank ``r`` of ``T`` holds
  heads ``[r * K / T, (r + 1) * K / T)`` of the model's ``K`` KV heads, or, when ``T > K``, the one head
  ``r * K // T`` (vLLM replicates it). A consumer rank reads each head it holds from a producer rank that
  holds it: with producer TP 2 and consumer TP 1 the one consumer rank reads one half of its heads from
  each producer rank; with producer TP 1 and consumer TP 2 each consumer rank reads its half of the one
  producer rank's heads. Where several producer ranks hold a head (``T > K``), the first of the ranks
  NixlConnector would read is read, and the others not at all.
- replicated caches (``Sharding.REPLICATED``: MLA, the indexer pages, the rings): every rank holds the
  whole cache; consumer rank ``d`` reads the one producer rank ``d * Tp // Td``.
- caches of both kinds in one model (``Sharding.MIXED``): only equal TP, rank ``d`` reading rank ``d``.

A producer rank holds each request as one **grant** of all its head slots (the whole grant) and, when it
holds more than one head slot of a cache split by head, one grant per slot (``slot_key``): a consumer rank
that needs all of a producer rank's slots pulls the whole grant, one that needs some pulls their slot
grants. A grant is claimed by the one consumer rank that pulls it (grants are per decode engine), so
no two consumer ranks may read the same grant: a plan that would (a consumer TP above the producer's for
a replicated cache, or above the number of KV heads) is refused with a ValueError naming the sizes.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

MAX_TP = 1024  # ranks a kv_transfer_params' producer may name


class Sharding(enum.Enum):
    """How the KV cache groups a connector moves lie across an engine's TP ranks."""

    BY_HEAD = "by_head"  # every group moved splits its KV heads across the ranks
    REPLICATED = "replicated"  # every group moved is whole on every rank (MLA, indexer pages, rings)
    MIXED = "mixed"  # groups of both kinds


def _check_tp(name: str, value: int) -> None:
    if type(value) is not int or not 1 <= value <= MAX_TP:
        raise ValueError(f"{name} must be an integer 1 to {MAX_TP}, got {value!r}")


def rank_heads(rank: int, tp_size: int, total_heads: int) -> tuple[int, ...]:
    """The model's KV heads (of ``total_heads``) that TP rank ``rank`` of ``tp_size`` holds, in slot order.
    ValueError naming the values for a rank out of range or sizes vLLM does not run."""
    _check_tp("tp_size", tp_size)
    if type(rank) is not int or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be 0 to {tp_size - 1} for TP {tp_size}, got {rank!r}")
    if type(total_heads) is not int or total_heads < 1:
        raise ValueError(f"total_heads must be a positive integer, got {total_heads!r}")
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} KV heads do not split over TP {tp_size}")
        per = total_heads // tp_size
        return tuple(range(rank * per, (rank + 1) * per))
    if tp_size % total_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of the {total_heads} KV heads it replicates")
    return (rank * total_heads // tp_size,)


def slot_key(key: str, slot: int) -> str:
    """The key of the grant of head slot ``slot`` of the request a producer rank holds as grant ``key``."""
    return f"{key}.h{slot}"


def rank_port(base: int, *, dp_index: int, tp_size: int, tp_rank: int) -> int:
    """The port TP rank ``tp_rank`` of DP rank ``dp_index`` serves on when the engine's settings name
    ``base``: ``base + dp_index * tp_size + tp_rank`` (each DP rank an engine of its own, its ranks next to
    each other). ValueError naming the values when it passes 65535."""
    _check_tp("tp_size", tp_size)
    if type(dp_index) is not int or dp_index < 0 or type(tp_rank) is not int or not 0 <= tp_rank < tp_size:
        raise ValueError(f"DP index {dp_index!r} and TP rank {tp_rank!r} of TP {tp_size}: a DP index >= 0 and "
                         f"a rank 0 to {tp_size - 1}")
    port = base + dp_index * tp_size + tp_rank
    if not 0 < port < 65536:
        raise ValueError(f"port {base} + DP index {dp_index} * TP {tp_size} + rank {tp_rank} = {port} is not a "
                         "port (1..65535): give a lower 'listen' port")
    return port


@dataclass(frozen=True, kw_only=True)
class Read:
    """One pull of a consumer rank: producer rank ``remote_rank``'s head slots ``remote_slots`` land in this
    rank's slots ``local_slots`` (one each, in order) of every block. ``whole``: the producer rank's whole
    grant (all its slots); else the one-slot grant of ``remote_slots[0]``."""

    remote_rank: int
    remote_slots: tuple[int, ...]
    local_slots: tuple[int, ...]
    whole: bool

    def __post_init__(self) -> None:
        if len(self.remote_slots) != len(self.local_slots) or not self.remote_slots:
            raise ValueError(f"a read of slots {self.remote_slots} into {self.local_slots}: one local slot each")
        if not self.whole and len(self.remote_slots) != 1:
            raise ValueError(f"a slot grant holds one slot, not {self.remote_slots}")


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What every consumer rank of TP ``local_tp`` reads from a producer of TP ``remote_tp``: ``reads[d]``
    rank ``d``'s pulls; ``local_units`` and ``remote_units`` the head slots a rank holds in each block
    (1 for replicated caches); ``unread`` the producer ranks whose whole grant no consumer rank pulls
    (released once the request's load ended: their slot grants go with them)."""

    local_tp: int
    remote_tp: int
    local_units: int
    remote_units: int
    reads: tuple[tuple[Read, ...], ...]

    @property
    def unread(self) -> tuple[int, ...]:
        pulled = {read.remote_rank for reads in self.reads for read in reads if read.whole}
        return tuple(rank for rank in range(self.remote_tp) if rank not in pulled)

    @property
    def slot_grants(self) -> bool:
        """Whether a producer rank holds slot grants besides its whole grant (more than one head slot)."""
        return self.remote_units > 1


@functools.lru_cache(maxsize=64)  # a pure function of its sizes, which the scheduler and workers ask on every request
def plan_reads(*, local_tp: int, remote_tp: int, total_heads: int, sharding: Sharding) -> RankPlan:
    """The reads of every consumer rank (``local_tp`` ranks) from a producer of ``remote_tp`` ranks of the
    same model (``total_heads`` KV heads). ValueError naming the sizes for TP sizes that do not divide each
    other, or a plan in which two consumer ranks would read one grant."""
    _check_tp("the consumer's TP", local_tp)
    _check_tp("the producer's TP (kv_transfer_params['remote_tp_size'])", remote_tp)
    if max(local_tp, remote_tp) % min(local_tp, remote_tp):
        raise ValueError(f"producer TP {remote_tp} and consumer TP {local_tp}: one must divide the other")
    if sharding is Sharding.MIXED and local_tp != remote_tp:
        raise ValueError(f"producer TP {remote_tp} and consumer TP {local_tp}: a model with caches split by head "
                         "and replicated caches moves only between engines of equal TP")
    if sharding is not Sharding.BY_HEAD:
        if local_tp > remote_tp:
            raise ValueError(f"producer TP {remote_tp} and consumer TP {local_tp}: each producer rank's grant of a "
                             f"replicated cache is pulled by one consumer rank, and {local_tp // remote_tp} "
                             "would read each")
        reads = tuple((Read(remote_rank=d * remote_tp // local_tp, remote_slots=(0,), local_slots=(0,), whole=True),)
                      for d in range(local_tp))
        return RankPlan(local_tp=local_tp, remote_tp=remote_tp, local_units=1, remote_units=1, reads=reads)
    remote_heads = [rank_heads(p, remote_tp, total_heads) for p in range(remote_tp)]
    all_reads, taken = [], {}
    for d in range(local_tp):
        mine = rank_heads(d, local_tp, total_heads)
        first = d * remote_tp // local_tp
        candidates = [first] if local_tp >= remote_tp else range(first, (d + 1) * remote_tp // local_tp)
        by_rank: dict[int, list[tuple[int, int]]] = {}
        for local_slot, head in enumerate(mine):
            rank = next(p for p in candidates if head in remote_heads[p])  # divisibility makes one hold it
            by_rank.setdefault(rank, []).append((remote_heads[rank].index(head), local_slot))
        reads = []
        for rank, pairs in sorted(by_rank.items()):
            remote_slots, local_slots = zip(*pairs)
            if remote_slots == tuple(range(len(remote_heads[rank]))):
                reads.append(Read(remote_rank=rank, remote_slots=remote_slots, local_slots=local_slots, whole=True))
            else:
                reads += [Read(remote_rank=rank, remote_slots=(j,), local_slots=(i,), whole=False) for j, i in pairs]
        for read in reads:
            grants = ["whole", *read.remote_slots] if read.whole else [read.remote_slots[0]]
            for grant in grants:
                other = taken.setdefault((read.remote_rank, grant), d)
                if other != d:
                    raise ValueError(f"producer TP {remote_tp} and consumer TP {local_tp} with {total_heads} KV heads: "
                                     f"consumer ranks {other} and {d} would both read head slot {grant} of producer "
                                     f"rank {read.remote_rank}, whose grants one consumer rank pulls")
        all_reads.append(tuple(reads))
    return RankPlan(local_tp=local_tp, remote_tp=remote_tp, local_units=len(rank_heads(0, local_tp, total_heads)),
                    remote_units=len(remote_heads[0]), reads=tuple(all_reads))


@dataclass(frozen=True, kw_only=True)
class EngineRanks:
    """An engine's TP size, its model's KV heads and how its moved caches lie across ranks: what its
    scheduler and each of its workers plan reads from. The default is an engine of one rank."""

    tp_size: int = 1
    total_heads: int = 1
    sharding: Sharding = Sharding.REPLICATED

    def __post_init__(self) -> None:
        _check_tp("tp_size", self.tp_size)
        if type(self.total_heads) is not int or self.total_heads < 1:
            raise ValueError(f"total_heads must be a positive integer, got {self.total_heads!r}")

    def plan(self, remote_tp: int) -> RankPlan:
        """``plan_reads`` from a producer of ``remote_tp`` ranks of this engine's model."""
        return plan_reads(local_tp=self.tp_size, remote_tp=remote_tp, total_heads=self.total_heads,
                          sharding=self.sharding)

    def units(self, rank: int) -> int:
        """Head slots rank ``rank`` holds in each block (1 unless the caches split by head)."""
        if self.sharding is not Sharding.BY_HEAD:
            return 1
        return len(rank_heads(rank, self.tp_size, self.total_heads))


@dataclass(frozen=True, kw_only=True)
class RankSeat:
    """Where one worker sits in its engine: TP rank ``tp_rank`` of ``tp_size``, in DP rank ``dp_index`` (each
    DP rank an engine of its own). The default is an engine of one rank."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_index: int = 0

    def __post_init__(self) -> None:
        rank_port(1, dp_index=self.dp_index, tp_size=self.tp_size, tp_rank=self.tp_rank)  # checks the values

    def port(self, base: int) -> int:
        """The port this rank serves on when the settings name ``base`` (``rank_port``)."""
        return rank_port(base, dp_index=self.dp_index, tp_size=self.tp_size, tp_rank=self.tp_rank)

    def engine_id(self, engine_id: str) -> str:
        """This rank's id towards peers: the engine's, with the TP rank when there are several (a producer
        admits each consumer rank as an engine of its own)."""
        return engine_id if self.tp_size == 1 else f"{engine_id}-tp{self.tp_rank}"
