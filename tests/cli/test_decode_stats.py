"""kpool-pd up's decode line: the decode daemon's step totals read from its metrics endpoint, and what a run
added to them."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app

from kpool_pd.decode_stats import DecodeSteps, read_decode_steps


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def served():
    """A metrics endpoint serving ``registry`` (its URL)."""
    registry = CollectorRegistry()
    server = make_server("127.0.0.1", 0, make_wsgi_app(registry), handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join(timeout=30)


def test_a_run_is_the_difference_of_two_reads(served):
    registry, url = served
    seconds = Histogram("kpoolpd_decode_step_seconds", "step", registry=registry)
    requests = Histogram("kpoolpd_decode_step_requests", "batch", registry=registry)
    seconds.observe(0.5)  # the warm-up's step, before the run
    requests.observe(1)
    before = read_decode_steps(url)
    for batch in (4, 8, 8, 4):
        seconds.observe(0.25)
        requests.observe(batch)
    run = read_decode_steps(url).since(before)
    assert run == DecodeSteps(steps=4, seconds=1.0, requests=24.0)
    assert run.describe(2.0) == ("decode: 4 steps of 6.0 requests on average, 250.00 ms a step; stepping 1.00 s "
                                 "of the 2.00 s run (50%)")
    assert DecodeSteps(steps=0, seconds=0.0, requests=0.0).describe(1.0) == "decode: no step"


def test_an_endpoint_without_the_decode_metrics_is_refused(served):
    _, url = served
    with pytest.raises(ValueError, match="serves no decode step metrics"):
        read_decode_steps(url)
