"""Baseline for the gRPC stream transport: one server-streaming gRPC call between two processes on
loopback, host memory to host memory, in messages of the connector's chunk size, with no protobuf
(the messages are the bytes themselves) and nothing done with them but landing them in a buffer.
What a gRPC-stream pull can reach on this host at best; the transfer bench prints it beside the
connector's gRPC stream."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import grpc
import numpy as np

from kpool_pd.connector import ConnectorConfig
from kpool_pd.runtime.launch import child_context, start_child

_METHOD = "/bench.RawStream/Send"


def _passthrough(data: bytes) -> bytes:
    return data


def _server_proc(conn, nbytes: int, chunk: int, options: list) -> None:
    payload = np.random.default_rng(0).integers(0, 256, min(nbytes, chunk), dtype=np.uint8).tobytes()

    async def send(request: bytes, context):
        for offset in range(0, nbytes, chunk):
            yield payload[: min(chunk, nbytes - offset)]

    async def main():
        server = grpc.aio.server(options=options)
        handler = grpc.unary_stream_rpc_method_handler(send, request_deserializer=_passthrough,
                                                       response_serializer=_passthrough)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.RawStream", {"Send": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await server.stop(0)
    asyncio.run(main())
    os._exit(0)


def grpc_stream_gbps(nbytes: int, reps: int) -> float:
    """GB/s of one raw gRPC stream of ``nbytes`` into a host buffer: median of ``reps`` after one warm-up."""
    config = ConnectorConfig()
    options = list(config.grpc_options())
    conn, child = child_context().Pipe()
    proc = start_child(_server_proc, child, nbytes, config.chunk_bytes, options)
    if not conn.poll(60):
        raise RuntimeError("the gRPC baseline server did not start in 60 s")
    port = conn.recv()
    dst = np.empty(nbytes, dtype=np.uint8)

    async def main() -> list[float]:
        times = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream(_METHOD, request_serializer=_passthrough, response_deserializer=_passthrough)
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                landed = 0
                async for data in call(b"", timeout=120):
                    dst[landed:landed + len(data)] = np.frombuffer(data, dtype=np.uint8)
                    landed += len(data)
                times.append(time.perf_counter() - t0)
                if landed != nbytes:
                    raise RuntimeError(f"the gRPC baseline stream ended after {landed} of {nbytes} bytes")
        return times

    try:
        times = asyncio.run(main())
    finally:
        conn.send("stop")
        proc.join(30)
    return nbytes / statistics.median(times[1:]) / 1e9
