"""The pull hop stamps (connector.shared.hops) and the bench's table of them (bench.pull_hops)."""

import time

import pytest

from kpool_pd.bench.pull_hops import hop_lines, hop_offsets, thread_work
from kpool_pd.connector.shared import hops


@pytest.fixture
def recorder():
    recorder = hops.HopRecorder().install()
    yield recorder
    recorder.uninstall()


def test_stamps_are_recorded_once_per_hop_in_order(recorder):
    hops.stamp("g1", "pull")
    hops.stamp("g1", "posted")
    hops.stamp("g1", "pull")  # a second pass keeps the first time
    hops.stamp("g2", "read")
    first = recorder.stamps["g1"]
    assert list(first) == ["pull", "posted"]
    assert first["pull"] <= first["posted"]
    assert list(recorder.stamps["g2"]) == ["read"]


def test_nothing_is_recorded_when_off():
    recorder = hops.HopRecorder().install()
    recorder.uninstall()
    hops.stamp("g1", "pull")
    assert recorder.stamps == {}


def test_offsets_merge_both_processes_in_hop_order():
    starts = {"a": 10.0, "b": 20.0}
    decode = {"a": {"pull": 10.001, "landed": 10.005}, "b": {"pull": 20.003, "landed": 20.009}}
    prefill = {"a": {"read": 10.002}, "b": {"read": 20.004}}
    offsets = hop_offsets(starts, decode, prefill)
    assert list(offsets) == ["pull", "read", "landed"]  # HOPS order, across processes
    assert offsets == pytest.approx({"pull": 2.0, "read": 3.0, "landed": 7.0})
    line = hop_lines([{"tokens": 16, "path": "connector ucx", "ms": 8.0, "hops_ms": offsets}])
    assert "read 3.000" in line and "end 8.000" in line


def test_a_stamp_keeps_its_threads_cpu_time_which_tells_work_from_waiting(recorder):
    """Between two stamps of one thread, work adds its CPU time and a sleep adds next to none: ``thread_work``
    reports both (the busy loop runs until its thread has used 50 ms of CPU, however loaded the machine)."""
    hops.stamp("busy", "prepared")
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    hops.stamp("busy", "repacked")
    hops.stamp("idle", "prepared")
    time.sleep(0.05)
    hops.stamp("idle", "repacked")
    busy = thread_work(["busy"], recorder.stamps, recorder.cpu, "prepared", "repacked")
    idle = thread_work(["idle"], recorder.stamps, recorder.cpu, "prepared", "repacked")
    assert busy["cpu_ms"] >= 50 and busy["wall_ms"] >= busy["cpu_ms"] - 1
    assert idle["wall_ms"] >= 50 and idle["cpu_ms"] < 20
    assert thread_work(["busy"], recorder.stamps, recorder.cpu, "prepared", "returned") is None
