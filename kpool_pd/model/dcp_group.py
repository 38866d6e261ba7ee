"""The ranks of one decode-context-parallel (DCP) decode instance, joined by ``torch.distributed``.

NCCL joins ranks whose caches live on GPUs (one GPU each), gloo ranks on the CPU. Every method
of ``DcpGroup`` is a collective: each rank calls it in the same order with tensors of the same
shape and dtype, and it returns when every rank has; a group of one rank needs no
``torch.distributed`` and returns at once. A rank that died or stopped calling makes the others'
collective fail once the group's timeout (given at ``join``) has passed, or sooner where the
backend sees the connection close: every wait has a deadline.

The ranks of a group are processes of one host, so their traffic (gloo's listeners, NCCL's
bootstrap) stays on the loopback interface, whatever the hostname resolves to and whatever
``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` said: nothing off the host reaches a rank. gloo
connects every pair of ranks while they join (never lazily: ``TORCH_GLOO_LAZY_INIT`` is turned off),
so each rank then seals the listeners the join opened (``kpool_pd.model.sealed_listeners``): a local process
can no longer open a connection to a rank, which gloo would keep until the rank ran out of fds and
aborted. NCCL may connect ranks at their first collective, so its listeners stay open.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

from kpool_pd.kvcache import DcpShard
from kpool_pd.model.sealed_listeners import listening_sockets, seal_new_listeners

logger = logging.getLogger(__name__)


SOCKET_INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
GLOO_LAZY_INIT_ENV = "TORCH_GLOO_LAZY_INIT"  # "1": pairs connect at their first collective, through the listener


def loopback_interface() -> str:
    """The name of this host's loopback interface (``lo`` on Linux); RuntimeError when it has none."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0", *names):
        if name in names and name.startswith("lo"):
            return name
    raise RuntimeError(f"no loopback interface among {names}: DCP ranks talk over loopback only")


def keep_on_loopback(environ: dict[str, str] | None = None) -> str:
    """Point gloo and NCCL at the loopback interface in ``environ`` (default ``os.environ``), before
    the group is joined; returns the interface's name."""
    environ = os.environ if environ is None else environ
    name = loopback_interface()
    for variable in SOCKET_INTERFACE_ENV:
        environ[variable] = name
    return name


def backend_for(device: torch.device | str) -> str:
    """The collective backend for ranks whose caches live on ``device``: NCCL on CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class DcpGroup:
    """One rank's handle on its DCP group (``shard`` says which rank of how many)."""

    def __init__(self, shard: DcpShard, device: torch.device | str, process_group: dist.ProcessGroup | None = None):
        if shard.size > 1 and process_group is None and not dist.is_initialized():
            raise ValueError(f"a DCP group of {shard.size} ranks needs torch.distributed: call DcpGroup.join")
        self.shard = shard
        self.device = torch.device(device)
        self._group = process_group

    @classmethod
    def join(cls, shard: DcpShard, *, init_method: str, device: torch.device | str,
             timeout_s: float) -> DcpGroup:
        """Join the group as ``shard.rank`` (blocks until every rank has joined, at most ``timeout_s``;
        the same timeout then bounds every collective). ``init_method``: a ``tcp://host:port`` or
        ``file://path`` rendezvous that every rank names alike."""
        device = torch.device(device)
        if shard.size == 1:
            return cls(shard, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = backend_for(device)
        keep_on_loopback()
        os.environ[GLOO_LAZY_INIT_ENV] = "0"
        listening = listening_sockets()
        dist.init_process_group(backend, init_method=init_method, world_size=shard.size, rank=shard.rank,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
        sealed = seal_new_listeners(listening) if backend == "gloo" else 0
        logger.info("DCP rank %d of %d joined over %s (%d listeners sealed)", shard.rank, shard.size, backend, sealed)
        return cls(shard, device, dist.group.WORLD)

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def rank(self) -> int:
        return self.shard.rank

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order.

        # tensor: [*S] -> [size, *S] (same dtype and device)
        """
        if self.size == 1:
            return tensor[None].clone()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self._group)
        return torch.stack(parts)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over ranks (a new tensor; the caller's is left alone).

        # tensor: [*S] int64 or float -> [*S]
        """
        total = tensor.clone()
        if self.size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._group)
        return total

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` on rank 0 (rank order); None on the others.

        # tensor: [*S] (same shape on every rank) -> size x [*S] on rank 0
        """
        if self.size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor.contiguous(), parts, dst=0, group=self._group)
        return parts

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self._group)

    def leave(self) -> None:
        """Leave the group (idempotent); the process may then exit without hanging its peers' teardown."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
