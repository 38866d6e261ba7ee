"""The control-latency bench (bench/control_latency.py) measures both ways and answers every request."""

from __future__ import annotations

import pytest

from bench.control_latency import main, measure


def test_both_ways_are_timed_and_each_answer_comes_after_its_request_reached_the_handler():
    rows = measure(requests=20)
    assert set(rows) == {"new call", "open stream"}
    for way, row in rows.items():
        assert 0 < row["to_handler_ms"] < row["round_trip_ms"] < 10_000, (way, row)


def test_a_request_count_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--requests", "0"])
    assert exc.value.code == 2 and "--requests must be >= 1, got 0" in capsys.readouterr().err
