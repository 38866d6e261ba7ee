"""The control-latency bench (kpool_pd/bench/control_latency.py) measures every way and answers every request."""

from __future__ import annotations

import json

import pytest

from kpool_pd.bench import control_latency
from kpool_pd.bench.control_latency import main, measure
from kpool_pd.connector import ucx_available

GRPC_WAYS = {"new call", "open stream"}


def _timed(way: str, row: dict[str, float]) -> None:
    assert 0 < row["to_handler_ms"] < row["round_trip_ms"] < 10_000, (way, row)


def test_the_grpc_ways_are_timed_and_each_answer_comes_after_its_request_reached_the_handler():
    rows = measure(requests=20, ucx=False)
    assert set(rows) == GRPC_WAYS
    for way, row in rows.items():
        _timed(way, row)


@pytest.mark.skipif(not ucx_available(), reason="needs ucxx (the ucx extra)")
def test_the_ucx_ways_are_timed_in_both_same_host_configurations(tmp_path, capsys):
    out = tmp_path / "control.json"
    assert main(["--requests", "20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == GRPC_WAYS | {"ucx tag", "ucx tag shm"}
    for way, row in rows.items():
        _timed(way, row)
    printed = capsys.readouterr().out
    assert "a ucx tag message reaches the handler in" in printed and "a ucx tag shm message" in printed


def test_without_ucxx_the_ucx_ways_are_left_out_saying_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(control_latency, "ucx_available", lambda: False)
    out = tmp_path / "control.json"
    assert main(["--requests", "5", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["rows"]) == GRPC_WAYS
    assert "ucx tag: skipped: ucxx does not import" in capsys.readouterr().out


def test_a_request_count_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--requests", "0"])
    assert exc.value.code == 2 and "--requests must be >= 1, got 0" in capsys.readouterr().err
