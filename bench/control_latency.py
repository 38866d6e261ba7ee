"""What a control message costs on gRPC between two processes on loopback, as the connector's Pull pays it:
a new server-streaming call per request (the Pull RPC today) beside one message on a bidirectional stream
that stays open (one stream per peer), both with 8-byte requests, no protobuf and nothing done in the
handler but answering. Prints, per way, the median time from the client's request to the server's handler
(perf_counter is one clock for both processes) and to the answer back, and the ratio of the two ways.

    python -m bench.control_latency --requests 300     (kpool-pd bench control)
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

from bench.arguments import bench_parser
from runtime.launch import child_context, start_child

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
    return {way: {"to_handler_ms": statistics.median(to[1:]) * 1e3, "round_trip_ms": statistics.median(back[1:]) * 1e3}
            for way, (to, back) in samples.items()}


def measure(requests: int, deadline_s: float = 60.0) -> dict[str, dict[str, float]]:
    """Start the server process, time both ways, stop it."""
    ports = child_context().Queue()
    server = start_child(_server_proc, ports)
    try:
        port = ports.get(timeout=deadline_s)
        return asyncio.run(_measure(port, requests, deadline_s))
    finally:
        server.kill()
        server.join(10)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench control", __doc__)
    parser.add_argument("--requests", type=int, default=300, help="requests each way (default 300)")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    rows = measure(args.requests)
    sys.stdout.write(f"{'way':<12} {'to handler ms':>14} {'round trip ms':>14}\n")
    for way, row in rows.items():
        sys.stdout.write(f"{way:<12} {row['to_handler_ms']:>14.3f} {row['round_trip_ms']:>14.3f}\n")
    ratio = rows["new call"]["to_handler_ms"] / rows["open stream"]["to_handler_ms"]
    sys.stdout.write(f"a new call reaches the handler {ratio:.1f}x later than a message on an open stream "
                     f"(median of {args.requests})\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
