"""Where a connector send's time goes beyond a raw ucxx send of the same bytes: one pair of processes
(sender and receiver, each with the connector's UCX options) moves the same bytes four ways, side by side,
each rep timed by the receiver from its 8-byte request to the last byte landed (and synchronised):

- ``raw``: standalone buffers, ucxx's ``Endpoint.send`` and ``ucxx.recv`` (the transfer bench's baseline);
- ``pooled``: the same calls, the sender's bytes a slice of a large pool and the receiver's a slice of
  another, at an offset that moves from rep to rep (as a pull's blocks do);
- ``node``: standalone buffers posted through the connector's ``UcxNode`` (``post_send``, ``post_receives``:
  ucxx's request API, one loop step less than ``Endpoint.send``);
- ``node pooled``: the connector's posting and the pool slices together, i.e. the connector's data path
  without its control path.

If ``node pooled`` costs what ``raw`` does, a pull's extra time lies in its control path (the hops before
and after the send); if ``pooled`` costs more than ``raw``, it lies in the memory (UCX's registration or
IPC handle caches missing as the slices move).

    python -m kpool_pd.bench.send_variants --device cuda --mib 41,164 --reps 9
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import statistics
import time

import torch

from kpool_pd.bench.arguments import count, counts
from kpool_pd.bench.ucxx_baseline import (REQUEST_BYTES, START_S, baseline_progress_mode, end_children, import_ucxx,
                                          sent_bytes, ucxx_buffer)
from kpool_pd.connector import UCX_NO_SHARED_MEMORY, UcxNode
from kpool_pd.runtime.launch import child_context, start_child

logger = logging.getLogger(__name__)

REQUEST_TAG = 7
POOL_SLOTS = 8  # the pool holds this many messages' bytes; a rep lands in slot rep % POOL_SLOTS


class SendVariant(enum.Enum):
    RAW = "raw"
    POOLED = "pooled"
    NODE = "node"
    NODE_POOLED = "node pooled"

    @property
    def pooled(self) -> bool:
        return self in (SendVariant.POOLED, SendVariant.NODE_POOLED)

    @property
    def through_node(self) -> bool:
        return self in (SendVariant.NODE, SendVariant.NODE_POOLED)


def message_view(pool: torch.Tensor, standalone: torch.Tensor, variant: SendVariant, rep: int) -> torch.Tensor:
    """The bytes a rep sends from or lands in: ``standalone`` itself, or, for a pooled variant, the slot
    ``rep % POOL_SLOTS`` of ``pool`` (each slot a message's size, the pool ``POOL_SLOTS`` of them).

    # pool: [POOL_SLOTS * n] uint8, standalone: [n] uint8 -> [n] uint8 (a view)
    """
    if not variant.pooled:
        return standalone
    n = standalone.numel()
    slot = rep % POOL_SLOTS
    return pool[slot * n:(slot + 1) * n]


def _sender(conn, nbytes: int, reps: int, device: str, variants: tuple[SendVariant, ...]) -> None:
    async def main() -> None:
        node = UcxNode(UCX_NO_SHARED_MEMORY, progress_mode=baseline_progress_mode(device))
        ucxx = import_ucxx()
        standalone = sent_bytes(nbytes).to(device)
        pool = standalone.repeat(POOL_SLOTS)
        request = torch.empty(REQUEST_BYTES, dtype=torch.uint8)
        conn.send(node.address)
        ep = await node.endpoint_to(conn.recv())
        for variant in variants:
            for rep in range(reps + 1):
                await ucxx.recv(ucxx_buffer(request), tag=REQUEST_TAG)
                tag = int(request.view(torch.int64)[0])
                view = message_view(pool, standalone, variant, rep)
                if variant.through_node:
                    await node.post_send(ep, view, tag)
                else:
                    await ep.send(ucxx_buffer(view), tag=tag, force_tag=True)
        await asyncio.get_running_loop().run_in_executor(None, conn.poll, START_S)
    asyncio.run(main())


def _receiver(conn, peer: bytes, nbytes: int, reps: int, device: str, variants: tuple[SendVariant, ...]) -> None:
    async def main() -> dict[str, list[float]]:
        node = UcxNode(UCX_NO_SHARED_MEMORY, progress_mode=baseline_progress_mode(device))
        ucxx = import_ucxx()
        conn.send(node.address)
        ep = await node.endpoint_to(peer)
        standalone = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pool = torch.empty(nbytes * POOL_SLOTS, dtype=torch.uint8, device=device)
        request = torch.zeros(REQUEST_BYTES, dtype=torch.uint8)
        expected = sent_bytes(nbytes)
        times: dict[str, list[float]] = {}
        tag = REQUEST_TAG + 1
        for variant in variants:
            for rep in range(reps + 1):
                view = message_view(pool, standalone, variant, rep)
                started = time.perf_counter()
                if variant.through_node:
                    landed = node.post_receives([view], tag).wait()
                else:  # a task, so that the receive is posted before the request leaves, as the node's are
                    landed = asyncio.ensure_future(ucxx.recv(ucxx_buffer(view), tag=tag))
                request.view(torch.int64)[0] = tag
                await ep.send(ucxx_buffer(request), tag=REQUEST_TAG, force_tag=True)
                await landed
                if view.is_cuda:
                    torch.cuda.synchronize(view.device)
                if rep:  # the first is a warm-up
                    times.setdefault(variant.value, []).append(time.perf_counter() - started)
                if not torch.equal(view.cpu(), expected):
                    raise RuntimeError(f"{variant.value}: rep {rep} landed other bytes than were sent")
                tag += 1
        return times
    conn.send(asyncio.run(main()))


def send_variant_ms(nbytes: int, reps: int, device: str,
                    variants: tuple[SendVariant, ...] = tuple(SendVariant)) -> dict[str, float]:
    """Median ms of each of ``variants`` moving ``nbytes`` from one process to another on ``device`` (both
    processes' memory there), over ``reps`` reps after a warm-up each; every rep's bytes are checked.
    RuntimeError when a process does not start, a deadline passes or bytes land wrong."""
    if nbytes < 1 or reps < 1:
        raise ValueError(f"nbytes and reps must be at least 1, got {nbytes} and {reps}")
    sender_conn, sender_end = child_context().Pipe()
    receiver_conn, receiver_end = child_context().Pipe()
    sender = start_child(_sender, sender_end, nbytes, reps, device, variants)
    receiver = None
    try:
        if not sender_conn.poll(START_S):
            raise RuntimeError("the sender process did not start")
        receiver = start_child(_receiver, receiver_end, sender_conn.recv(), nbytes, reps, device, variants)
        if not receiver_conn.poll(START_S):
            raise RuntimeError("the receiver process did not start")
        sender_conn.send(receiver_conn.recv())
        if not receiver_conn.poll(START_S + 10 * reps * len(variants)):
            raise RuntimeError(f"the receiver did not finish {len(variants)} variants of {reps} reps in time")
        times = receiver_conn.recv()
        sender_conn.send("done")
    finally:
        end_children(receiver, sender)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mib", type=counts, default=[41, 164],
                        help="message sizes in whole MiB, comma-separated (default 41,164)")
    parser.add_argument("--reps", type=count, default=9, help="timed reps a variant (default 9)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = args.mib
    header = f"{'MiB':>6} " + " ".join(f"{v.value:>12}" for v in SendVariant) + "   (ms, median; receiver's clock)"
    logger.info(header)
    for mib in sizes:
        ms = send_variant_ms(mib << 20, args.reps, args.device)
        logger.info(f"{mib:>6} " + " ".join(f"{ms[v.value]:>12.3f}" for v in SendVariant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
