"""What `kpool-pd up` prints per request and in its summary: where each request's time to first token
went (prefill, the whole transfer, the part of it exposed after the prefill)."""

from __future__ import annotations

import json

import grpc

from kpool_pd.decode_worker.client import RequestFailed
from kpool_pd.report import json_lines, plural, summary, summary_text, table
from kpool_pd.model.colocated import RequestResult

MODEL = {"family": "kpool", "kpool": 4, "compress_ratio": 4, "num_spec": 3, "layers": 2, "block_size": 64}


def _result(request_id: str, prefill: float, transfer: float, exposed: float) -> RequestResult:
    return RequestResult(request_id=request_id, prompt_len=4096, tokens=(1, 2), output_digest="a" * 64,
                         state_digest="b" * 64, transfer_bytes=5 << 20, transfer_ms=transfer, prefill_ms=prefill,
                         exposed_transfer_ms=exposed, ttft_ms=prefill + exposed + 3, transport="ucx")


def test_the_table_json_and_summary_carry_prefill_transfer_and_exposed_transfer():
    results = [_result("req-0", 300.0, 40.0, 6.0), _result("req-1", 100.0, 20.0, 2.0)]
    lines = table(results).splitlines()
    assert lines[0].split()[:9] == ["request", "prompt", "tokens", "transfer", "prefill", "ms", "xfer", "ms",
                                    "exposed"]
    assert lines[2].split()[5:9] == ["300.00", "40.00", "6.00", "309.0"]
    report = summary(results, mode="pd", wall_s=1.0, model=MODEL, transport="ucx")
    assert (report["prefill_ms_mean"], report["transfer_ms_mean"], report["exposed_transfer_ms_mean"]) == (
        200.0, 30.0, 4.0)
    assert ("mean transfer 30.00 ms a request (moving its bytes); the first token waited 4.00 ms after the prefill "
            "for the last byte (exposed); mean prefill 200.00 ms") in summary_text(report)
    rows = [json.loads(line) for line in json_lines(results, report).splitlines()]
    assert [(r["prefill_ms"], r["transfer_ms"], r["exposed_transfer_ms"]) for r in rows[:2]] == [
        (300.0, 40.0, 6.0), (100.0, 20.0, 2.0)]


def test_an_exposed_time_longer_than_the_transfer_is_not_called_a_part_of_it():
    """The exposed time runs from the end of the prefill to the last byte landed, waiting for a send included:
    it may exceed the transfer time (1.55 ms moving, 113.94 ms exposed), and the summary says each for what it is."""
    report = summary([_result("req-0", 50.0, 1.55, 113.94)], mode="pd", wall_s=1.0, model=MODEL, transport="ucx")
    text = summary_text(report)
    assert "mean transfer 1.55 ms a request (moving its bytes)" in text
    assert "the first token waited 113.94 ms after the prefill for the last byte (exposed)" in text
    assert "of it" not in text


def test_a_run_whose_every_request_failed_names_no_transport_plainly():
    failed = [RequestFailed("req-0", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")]
    report = summary(failed, mode="pd", wall_s=1.0, model=MODEL, transport="")
    first = summary_text(report).splitlines()[0]
    assert first.startswith("summary: 0/1 requests ok (pd, transport none (no request reached the decode node); "), first
    assert "transport ;" not in first


def test_plural_counts_one_as_one():
    assert [plural(n, "request") for n in (0, 1, 2)] == ["0 requests", "1 request", "2 requests"]
