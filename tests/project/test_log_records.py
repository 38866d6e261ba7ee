"""tests/support/log_records.py: grpc.aio's report of a call whose event loop closed is told apart from
errors a test's own code logs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.log_records import errors_logged, own_records

DEADLINE_S = 30.0


class _HeldCheck(health_pb2_grpc.HealthServicer):
    """Answers each Check once ``release`` is set (a thread-pool server: no event loop of its own)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.arrived = threading.Event()

    def Check(self, request, context):
        self.arrived.set()
        self.release.wait(DEADLINE_S)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_a_call_answered_after_its_loop_closed_is_not_counted_as_the_next_tests_error(caplog):
    caplog.set_level(logging.INFO)
    servicer = _HeldCheck()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    left_pending = []
    try:
        async def earlier_test():  # leaves a call pending when its loop closes
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
            left_pending.append((channel, asyncio.ensure_future(call)))
            while not servicer.arrived.is_set():
                await asyncio.sleep(0.01)

        earlier = asyncio.new_event_loop()
        earlier.run_until_complete(asyncio.wait_for(earlier_test(), DEADLINE_S))
        earlier.close()

        def closed_loop_reports():
            return [r for r in caplog.records if r.levelno >= logging.ERROR and "Event loop is closed" in str(r.exc_info)]

        async def this_test():  # its loop reads the earlier call's answer
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            servicer.release.set()
            deadline = time.monotonic() + DEADLINE_S
            while not closed_loop_reports() and time.monotonic() < deadline:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
            logging.getLogger("kpool_pd.connector.test").error("an error of this test's own")
            await channel.close()

        asyncio.run(this_test())
    finally:
        servicer.release.set()
        server.stop(None)

    assert closed_loop_reports(), "the earlier loop's call was never reported"
    assert errors_logged(caplog.records) == ["an error of this test's own"]
    assert all("Event loop is closed" not in str(r.exc_info) for r in own_records(caplog.records))
