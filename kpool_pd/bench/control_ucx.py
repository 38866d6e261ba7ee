"""The UCX way of the control-latency bench (``kpool_pd.bench.control_latency``): an 8-byte request as a ucxx tag
message between two processes, as a pull request would travel if it went over the data plane's own
endpoints instead of gRPC. The endpoints are the connector's kind: made from each other's worker address,
endpoint error handling off, under one of the connector's same-host UCX configurations (as in
``kpool_pd.bench.ucxx_baseline``, without the host-memory thresholds the connector adds on the CPU, which concern
messages of 16 KiB and more). The responder keeps one receive posted under a request tag on its worker
and, once it completed, answers with its clock under the tag the request names, into a receive the
requester posted before sending. Nothing is done in between but answering.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from kpool_pd.bench.ucxx_baseline import import_ucxx, ucxx_buffer, worker_address_endpoint
from kpool_pd.runtime.launch import child_context, start_child

REQUEST_TAG = 11  # the requests' tag on the responder's worker
ANSWER_TAG = 12  # the first answer's tag on the requester's worker (one more each request)


async def _endpoint_to_peer(ucxx, conn, deadline_s: float):
    """Our worker address out, the peer's in: an endpoint to the peer's worker."""
    conn.send(bytes(ucxx.get_worker_address()))
    if not await asyncio.get_running_loop().run_in_executor(None, conn.poll, deadline_s):
        raise RuntimeError("the peer's worker address did not come")
    return await worker_address_endpoint(ucxx, conn.recv())


def _responder(conn, requests: int, deadline_s: float, options: dict[str, str]) -> None:
    ucxx = import_ucxx()

    async def main() -> None:
        ucxx.init(options=options)
        ep = await _endpoint_to_peer(ucxx, conn, deadline_s)
        request = torch.zeros(1, dtype=torch.int64)  # the answer's tag
        stamp = torch.zeros(1, dtype=torch.float64)
        for _ in range(requests + 1):
            await asyncio.wait_for(ucxx.recv(ucxx_buffer(request), tag=REQUEST_TAG), deadline_s)
            stamp[0] = time.perf_counter()
            await asyncio.wait_for(ep.send(ucxx_buffer(stamp), tag=int(request[0]), force_tag=True), deadline_s)
        await asyncio.get_running_loop().run_in_executor(None, conn.poll, deadline_s)  # until the requester is done
    asyncio.run(main())


def _requester(conn, requests: int, deadline_s: float, options: dict[str, str]) -> None:
    ucxx = import_ucxx()

    async def main() -> tuple[list[float], list[float]]:
        ucxx.init(options=options)
        ep = await _endpoint_to_peer(ucxx, conn, deadline_s)
        request = torch.zeros(1, dtype=torch.int64)
        answer = torch.zeros(1, dtype=torch.float64)
        to_handler, round_trip = [], []
        for rep in range(requests + 1):  # the first warms the endpoints up
            started = time.perf_counter()
            request[0] = ANSWER_TAG + rep
            answered = asyncio.ensure_future(ucxx.recv(ucxx_buffer(answer), tag=ANSWER_TAG + rep))
            await asyncio.wait_for(ep.send(ucxx_buffer(request), tag=REQUEST_TAG, force_tag=True), deadline_s)
            await asyncio.wait_for(answered, deadline_s)
            round_trip.append(time.perf_counter() - started)
            to_handler.append(float(answer[0]) - started)
        return to_handler, round_trip
    try:
        conn.send(asyncio.run(main()))
    except Exception as exc:  # the parent reports it
        conn.send(RuntimeError(f"the ucxx requester failed: {type(exc).__name__}: {exc}"))


def measure_ucx(requests: int, deadline_s: float, *, options: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """{"to_handler_ms", "round_trip_ms"}: medians over ``requests`` ucxx tag requests (after one warm-up)
    between two child processes (ucxx initialises once a process), under one of the connector's UCX configurations, ``options``.
    RuntimeError when ucxx does not import or a process does not answer within ``deadline_s``."""
    import_ucxx()  # fails here, before any process starts, when ucxx does not import
    responder_conn, responder_end = child_context().Pipe()
    requester_conn, requester_end = child_context().Pipe()
    responder = start_child(_responder, responder_end, requests, deadline_s, dict(options))
    requester = start_child(_requester, requester_end, requests, deadline_s, dict(options))
    try:
        for here, there in ((responder_conn, requester_conn), (requester_conn, responder_conn)):
            if not here.poll(deadline_s):
                raise RuntimeError("a ucxx control process did not start")
            there.send(here.recv())
        while not requester_conn.poll(1.0):  # each request has its own deadline there
            if not requester.is_alive():
                raise RuntimeError(f"the ucxx requester ended (exit code {requester.exitcode}) without its times")
        outcome = requester_conn.recv()
        responder_conn.send("done")
        if isinstance(outcome, Exception):
            raise outcome
        to_handler, round_trip = outcome
    finally:
        for proc in (requester, responder):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return {"to_handler_ms": statistics.median(to_handler[1:]) * 1e3,
            "round_trip_ms": statistics.median(round_trip[1:]) * 1e3}
