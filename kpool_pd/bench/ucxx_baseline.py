"""The raw ucxx baseline of the transfer benchmark: one region of the same bytes sent with a ucxx tag send
from another process, after an 8-byte request, with the connector's UCX options, at the connector's
placement (the sender's memory on the prefill device, the receiver's on the decode device). What a pull
costs above it is the connector's own work (``kpool_pd.bench.transfer`` prints the ratio from the same run).

Two kinds of endpoint (``UcxxEndpoint``): a listener's connection, request and bytes on it (the baseline
the ratio is taken over), and the connector's own kind, where the sender's endpoint is made from the
receiver's worker address (endpoint error handling off) and the bytes go under a forced tag into a
receive posted on the receiver's worker before its request; that one shows whether the connector's
kind of endpoint costs anything by itself.

``messages`` > 1 sends the same bytes as that many tagged messages (nearly equal parts, posted together
and awaited with ``asyncio.gather``, each into its own receive), the way a pull of that many regions moves
them: beside the one-message send it shows what UCX's per-message cost is at that count."""

from __future__ import annotations

import asyncio
import enum
import statistics
import time
from collections.abc import Sequence

import torch

from kpool_pd.connector import UcxProgress, progress_mode_for, ucx_available
from kpool_pd.runtime.launch import child_context, start_child

REQUEST_BYTES = 8
REQUEST_TAG = 7  # the worker-address kind: the requests' tag on the sender's worker
START_S = 120.0


class UcxxEndpoint(enum.Enum):
    LISTENER = "listener"  # the receiver connects to the sender's listener; request and bytes on that connection
    WORKER_ADDRESS = "worker address"  # as the connector: endpoints from worker addresses, a forced tag
    WORKER_ADDRESS_PEER_ERRORS = "worker address, error handling on"  # the same with UCX's peer error handling

    @property
    def from_worker_address(self) -> bool:
        return self is not UcxxEndpoint.LISTENER

    @property
    def peer_error_handling(self) -> bool:
        return self is UcxxEndpoint.WORKER_ADDRESS_PEER_ERRORS


def import_ucxx():
    """ucxx, imported as the connector imports it (its UCX defaults applied as its libraries load)."""
    if not ucx_available():
        raise RuntimeError("ucxx does not import: no raw ucxx baseline")
    import ucxx  # noqa: PLC0415 (the ucx extra)
    return ucxx


def ucxx_buffer(tensor: torch.Tensor):
    """What ucxx sends from or receives into: the tensor itself on CUDA, its numpy view on the host."""
    return tensor if tensor.is_cuda else tensor.numpy()


def sent_bytes(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on the host: what the sender sends, which the receiver checks it got (seeded by the size)."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))


def message_parts(tensor: torch.Tensor, messages: int) -> list[torch.Tensor]:
    """``tensor`` (uint8 [n], contiguous) as ``messages`` views of nearly equal size, in order; ValueError unless
    1 <= messages <= n.

    # tensor: [n] uint8 -> messages views [~n / messages] uint8
    """
    if not 1 <= messages <= tensor.numel():
        raise ValueError(f"messages must lie in [1, {tensor.numel()}] (the bytes sent), got {messages}")
    return list(tensor.tensor_split(messages))


def baseline_progress_mode(device: str) -> str | None:
    """The progress mode a connector node with its pool on ``device`` gives ucxx (``ConnectorConfig``'s default),
    so that the baseline's processes progress their workers as the connector's do."""
    return progress_mode_for(UcxProgress.AUTO, torch.device(device).type)


def worker_address_endpoint(ucxx, address: bytes, error_handling: bool = False):
    """An endpoint to a peer's worker ``address``, as the connector makes them (error handling off unless
    ``error_handling``)."""
    return ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address),
                                                    endpoint_error_handling=error_handling)


def _sender(conn, nbytes: int, reps: int, device: str, options: Sequence[tuple[str, str]],
            endpoint: UcxxEndpoint, messages: int) -> None:
    ucxx = import_ucxx()

    async def main() -> None:
        ucxx.init(options=dict(options), progress_mode=baseline_progress_mode(device))
        src = sent_bytes(nbytes).to(device)
        parts = message_parts(src, messages)
        request = torch.empty(REQUEST_BYTES, dtype=torch.uint8)
        if endpoint.from_worker_address:  # the receiver's address in, ours out; each request names a tag
            conn.send(bytes(ucxx.get_worker_address()))
            ep = await worker_address_endpoint(ucxx, conn.recv(), endpoint.peer_error_handling)
            for _ in range(reps + 1):
                await ucxx.recv(ucxx_buffer(request), tag=REQUEST_TAG)
                base = int(request.view(torch.int64)[0])
                await asyncio.gather(*(ep.send(ucxx_buffer(part), tag=base + i, force_tag=True)
                                       for i, part in enumerate(parts)))
            await asyncio.get_running_loop().run_in_executor(None, conn.poll, START_S)  # until the receiver is done
            return
        done = asyncio.Event()

        async def serve(endpoint) -> None:
            for _ in range(reps + 1):
                await endpoint.recv(ucxx_buffer(request))
                if messages == 1:
                    await endpoint.send(ucxx_buffer(src))
                else:  # part i under tag i (hashed with the connection's tag)
                    await asyncio.gather(*(endpoint.send(ucxx_buffer(part), tag=i) for i, part in enumerate(parts)))
            await endpoint.close()
            done.set()

        listener = ucxx.create_listener(serve)
        conn.send(listener.port)
        await asyncio.wait_for(done.wait(), START_S + 60 * (reps + 1))
        listener.close()
    asyncio.run(main())


def _receiver(conn, peer, nbytes: int, reps: int, device: str, options: Sequence[tuple[str, str]],
              endpoint: UcxxEndpoint, messages: int) -> None:
    ucxx = import_ucxx()

    async def main() -> list[float]:
        ucxx.init(options=dict(options), progress_mode=baseline_progress_mode(device))
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        parts = message_parts(dst, messages)
        request = torch.zeros(REQUEST_BYTES, dtype=torch.uint8)
        times = []
        if endpoint.from_worker_address:  # ``peer``: the sender's worker address
            conn.send(bytes(ucxx.get_worker_address()))
            ep = await worker_address_endpoint(ucxx, peer, endpoint.peer_error_handling)
            for rep in range(reps + 1):
                started = time.perf_counter()
                base = REQUEST_TAG + 1 + rep * messages  # part i under base + i
                landed = asyncio.gather(*(ucxx.recv(ucxx_buffer(part), tag=base + i)  # posted before the request
                                          for i, part in enumerate(parts)))
                request.view(torch.int64)[0] = base
                await ep.send(ucxx_buffer(request), tag=REQUEST_TAG, force_tag=True)
                await landed
                if dst.is_cuda:
                    torch.cuda.synchronize(dst.device)
                times.append(time.perf_counter() - started)
            return times, bool(torch.equal(dst.cpu(), sent_bytes(nbytes)))
        ep = await ucxx.create_endpoint("127.0.0.1", peer)  # ``peer``: the sender's listener port
        for _ in range(reps + 1):
            started = time.perf_counter()
            await ep.send(ucxx_buffer(request))
            if messages == 1:
                await ep.recv(ucxx_buffer(dst))
            else:
                await asyncio.gather(*(ep.recv(ucxx_buffer(part), tag=i) for i, part in enumerate(parts)))
            if dst.is_cuda:
                torch.cuda.synchronize(dst.device)
            times.append(time.perf_counter() - started)
        await ep.close()
        return times, bool(torch.equal(dst.cpu(), sent_bytes(nbytes)))  # the last send's bytes, checked untimed
    conn.send(asyncio.run(main()))


def end_children(*procs) -> None:
    """Each of ``procs`` (None: never started) joined within 30 s, else killed."""
    for proc in procs:
        if proc is not None:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def ucxx_tag_gbps(nbytes: int, reps: int, src_device: str, dst_device: str, options: Sequence[tuple[str, str]],
                  endpoint: UcxxEndpoint = UcxxEndpoint.LISTENER, messages: int = 1) -> float:
    """GB/s of a ucxx tag send of ``nbytes`` from one process's ``src_device`` memory into another's
    ``dst_device`` memory over ``endpoint``'s kind, as ``messages`` tagged messages (``message_parts``), timed by
    the receiver from its 8-byte request to the last byte; median of ``reps`` after one warm-up. Both ends are
    child processes (ucxx initialises once a process). ValueError (nothing started) unless
    1 <= messages <= nbytes; RuntimeError if the last send's bytes did not all land where they belong (checked
    after the clock stopped)."""
    if not 1 <= messages <= nbytes:
        raise ValueError(f"messages must lie in [1, {nbytes}] (the bytes sent), got {messages}")
    sender_conn, sender_end = child_context().Pipe()
    receiver_conn, receiver_end = child_context().Pipe()
    sender = start_child(_sender, sender_end, nbytes, reps, src_device, tuple(options), endpoint, messages)
    receiver = None
    try:
        if not sender_conn.poll(START_S):
            raise RuntimeError("the ucxx sender process did not start")
        receiver = start_child(_receiver, receiver_end, sender_conn.recv(), nbytes, reps, dst_device, tuple(options),
                               endpoint, messages)
        if endpoint.from_worker_address:  # the receiver's worker address, to the sender
            if not receiver_conn.poll(START_S):
                raise RuntimeError("the ucxx receiver process did not start")
            sender_conn.send(receiver_conn.recv())
        if not receiver_conn.poll(START_S + 60 * (reps + 1)):
            raise RuntimeError(f"the ucxx receiver got no {nbytes} B within the deadline")
        times, intact = receiver_conn.recv()
        if endpoint.from_worker_address:
            sender_conn.send("done")
    finally:
        end_children(receiver, sender)
    if not intact:
        raise RuntimeError(f"the raw ucxx send of {nbytes} B in {messages} messages landed other bytes than were sent")
    return nbytes / statistics.median(times[1:]) / 1e9
