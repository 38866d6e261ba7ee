"""What a control message costs between two processes on loopback, as the connector's pull request pays it:
on gRPC, a new server-streaming call per request (the Pull RPC) beside one message on a bidirectional stream
that stays open (the PullSession, one stream per peer); and, where ucxx imports, a ucxx tag message over the
connector's kind of UCX endpoint (``kpool_pd.bench.control_ucx``), the way a pull request could travel beside its
bytes. Each with 8-byte requests, no protobuf and nothing done in the handler but answering. Prints, per
way, the median time from the client's request to the server's handler (perf_counter is one clock for both
processes) and to the answer back, and the ratios to the open stream.

    python -m kpool_pd.bench.control_latency --requests 300     (kpool-pd bench control)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import grpc

from kpool_pd.bench.arguments import bench_parser
from kpool_pd.bench.control_ucx import measure_ucx
from kpool_pd.connector import UCX_NO_SHARED_MEMORY, UCX_SAME_HOST_ZERO_COPY, ucx_available
from kpool_pd.runtime.launch import child_context, start_child

_SERVICE = "bench.Control"


def _passthrough(data: bytes) -> bytes:
    return data


def _stamp() -> bytes:
    return repr(time.perf_counter()).encode()


def _server_proc(ports) -> None:
    async def call(request: bytes, context):
        yield _stamp()

    async def stream(requests, context):
        async for _ in requests:
            yield _stamp()

    async def main():
        server = grpc.aio.server()
        handlers = {"Call": grpc.unary_stream_rpc_method_handler(call, request_deserializer=_passthrough,
                                                                 response_serializer=_passthrough),
                    "Stream": grpc.stream_stream_rpc_method_handler(stream, request_deserializer=_passthrough,
                                                                    response_serializer=_passthrough)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


async def _measure(port: int, requests: int, deadline_s: float) -> dict[str, dict[str, float]]:
    """{way: {"to_handler_ms", "round_trip_ms"}} medians over ``requests`` requests each."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), deadline_s)
        call = channel.unary_stream(f"/{_SERVICE}/Call", request_serializer=_passthrough,
                                    response_deserializer=_passthrough)
        open_stream = channel.stream_stream(f"/{_SERVICE}/Stream", request_serializer=_passthrough,
                                            response_deserializer=_passthrough)
        samples: dict[str, tuple[list[float], list[float]]] = {"new call": ([], []), "open stream": ([], [])}
        for _ in range(requests + 1):  # the first of each way warms it up
            started = time.perf_counter()
            rpc = call(b"pull-req", timeout=deadline_s)
            stamp = await rpc.read()
            samples["new call"][0].append(float(stamp) - started)
            samples["new call"][1].append(time.perf_counter() - started)
            await rpc.read()  # its end
        stream = open_stream(timeout=deadline_s)
        for _ in range(requests + 1):
            started = time.perf_counter()
            await stream.write(b"pull-req")
            stamp = await stream.read()
            samples["open stream"][0].append(float(stamp) - started)
            samples["open stream"][1].append(time.perf_counter() - started)
        await stream.done_writing()
        if await stream.read() is not grpc.aio.EOF or await stream.code() is not grpc.StatusCode.OK:
            raise RuntimeError("the control stream did not end cleanly")  # read to its end: nothing left pending
    return {way: {"to_handler_ms": statistics.median(to[1:]) * 1e3, "round_trip_ms": statistics.median(back[1:]) * 1e3}
            for way, (to, back) in samples.items()}


def measure(requests: int, deadline_s: float = 60.0, *, ucx: bool = True) -> dict[str, dict[str, float]]:
    """Start the gRPC server process, time its two ways, stop it; then the UCX way in two processes of its
    own when ``ucx``."""
    ports = child_context().Queue()
    server = start_child(_server_proc, ports)
    try:
        port = ports.get(timeout=deadline_s)
        rows = asyncio.run(_measure(port, requests, deadline_s))
    finally:
        server.kill()
        server.join(10)
    if ucx:  # both same-host UCX configurations of the connector (ConnectorConfig.ucx_options)
        rows["ucx tag"] = measure_ucx(requests, deadline_s, options=UCX_NO_SHARED_MEMORY)
        rows["ucx tag shm"] = measure_ucx(requests, deadline_s, options=UCX_SAME_HOST_ZERO_COPY)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench control", __doc__)
    parser.add_argument("--requests", type=int, default=300, help="requests each way (default 300)")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    parser.add_argument("--no-ucx", action="store_true", help="leave the two ucxx tag ways out (they are left out, "
                        "saying so, where ucxx does not import)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    ucx = not args.no_ucx and ucx_available()
    if not args.no_ucx and not ucx:
        sys.stdout.write("ucx tag: skipped: ucxx does not import (install the ucx extra)\n")
    rows = measure(args.requests, ucx=ucx)
    stream = rows["open stream"]
    sys.stdout.write(f"{'way':<12} {'to handler ms':>14} {'round trip ms':>14} {'x open stream':>14}\n")
    for way, row in rows.items():
        sys.stdout.write(f"{way:<12} {row['to_handler_ms']:>14.3f} {row['round_trip_ms']:>14.3f} "
                         f"{row['to_handler_ms'] / stream['to_handler_ms']:>14.2f}\n")
    ratio = rows["new call"]["to_handler_ms"] / stream["to_handler_ms"]
    sys.stdout.write(f"a new call reaches the handler {ratio:.1f}x later than a message on an open stream "
                     f"(median of {args.requests})\n")
    for way in ("ucx tag", "ucx tag shm") if ucx else ():
        sys.stdout.write(f"a {way} message reaches the handler in {rows[way]['to_handler_ms'] / stream['to_handler_ms']:.2f}x "
                         "the open stream's time\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
