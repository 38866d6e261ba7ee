"""The raw ucxx baseline of the transfer benchmark: one region of the same bytes sent with a ucxx tag send
from another process, after an 8-byte request, with the connector's UCX options, at the connector's
placement (the sender's memory on the prefill device, the receiver's on the decode device). What a pull
costs above it is the connector's own work (``bench.transfer`` prints the ratio from the same run)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence

import torch

from connector import ucx_available
from runtime.launch import child_context, start_child

REQUEST_BYTES = 8
START_S = 120.0


def _ucxx():
    """ucxx, imported as the connector imports it (its UCX defaults applied as its libraries load)."""
    if not ucx_available():
        raise RuntimeError("ucxx does not import: no raw ucxx baseline")
    import ucxx  # noqa: PLC0415 (the ucx extra)
    return ucxx


def _buffer(tensor: torch.Tensor):
    """What ucxx sends from or receives into: the tensor itself on CUDA, its numpy view on the host."""
    return tensor if tensor.is_cuda else tensor.numpy()


def _sender(conn, nbytes: int, reps: int, device: str, options: Sequence[tuple[str, str]]) -> None:
    ucxx = _ucxx()

    async def main() -> None:
        ucxx.init(options=dict(options))
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        request = torch.empty(REQUEST_BYTES, dtype=torch.uint8)
        done = asyncio.Event()

        async def serve(endpoint) -> None:
            for _ in range(reps + 1):
                await endpoint.recv(_buffer(request))
                await endpoint.send(_buffer(src))
            await endpoint.close()
            done.set()

        listener = ucxx.create_listener(serve)
        conn.send(listener.port)
        await asyncio.wait_for(done.wait(), START_S + 60 * (reps + 1))
        listener.close()
    asyncio.run(main())


def _receiver(conn, port: int, nbytes: int, reps: int, device: str, options: Sequence[tuple[str, str]]) -> None:
    ucxx = _ucxx()

    async def main() -> list[float]:
        ucxx.init(options=dict(options))
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        request = torch.zeros(REQUEST_BYTES, dtype=torch.uint8)
        endpoint = await ucxx.create_endpoint("127.0.0.1", port)
        times = []
        for _ in range(reps + 1):
            started = time.perf_counter()
            await endpoint.send(_buffer(request))
            await endpoint.recv(_buffer(dst))
            if dst.is_cuda:
                torch.cuda.synchronize(dst.device)
            times.append(time.perf_counter() - started)
        await endpoint.close()
        return times
    conn.send(asyncio.run(main()))


def ucxx_tag_gbps(nbytes: int, reps: int, src_device: str, dst_device: str,
                  options: Sequence[tuple[str, str]]) -> float:
    """GB/s of a ucxx tag send of ``nbytes`` from one process's ``src_device`` memory into another's
    ``dst_device`` memory, timed by the receiver from its 8-byte request to the last byte; median of
    ``reps`` after one warm-up. Both ends are child processes (ucxx initialises once a process)."""
    sender_conn, sender_end = child_context().Pipe()
    receiver_conn, receiver_end = child_context().Pipe()
    sender = start_child(_sender, sender_end, nbytes, reps, src_device, tuple(options))
    receiver = None
    try:
        if not sender_conn.poll(START_S):
            raise RuntimeError("the ucxx sender process did not start")
        receiver = start_child(_receiver, receiver_end, sender_conn.recv(), nbytes, reps, dst_device, tuple(options))
        if not receiver_conn.poll(START_S + 60 * (reps + 1)):
            raise RuntimeError(f"the ucxx receiver got no {nbytes} B within the deadline")
        times = receiver_conn.recv()
    finally:
        for proc in (receiver, sender):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    return nbytes / statistics.median(times[1:]) / 1e9
