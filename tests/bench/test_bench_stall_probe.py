"""The vLLM profile's stall tools: ``StallProbe`` writes a loop kept from its callbacks, with the stack of what
kept it, and ``batch_waits`` counts the PackedPull batches that waited before the producer read them."""

from __future__ import annotations

import asyncio
import threading

from kpool_pd.bench.stall_probe import STALL_S, StallProbe
from kpool_pd.bench.vllm_profile import batch_waits
from tests.support.polling import wait_for


def _hop(hop: str, grant: str, at: float) -> dict:
    return {"event": "hop", "hop": hop, "grant": grant, "at": at}


def test_batch_waits_groups_a_batch_by_its_written_stamps_and_lists_the_long_waits():
    consumer = [_hop("written", "a", 10.0), _hop("written", "b", 10.0002),  # one batch of two pulls
                _hop("written", "c", 11.0),  # a batch of one
                _hop("written", "d", 12.0),  # never read: not counted
                {"event": "stall", "kind": "loop", "begin": 10.05, "end": 10.1}]
    producer = [_hop("read", "a", 10.09), _hop("read", "b", 10.08), _hop("read", "c", 11.002),
                {"event": "stall", "kind": "sampler", "begin": 11.5, "end": 11.6}]
    text = batch_waits(consumer, producer)
    first, *stalls = text.splitlines()
    assert first == ("PackedPull batches, written -> producer read: 2 batches, median 41.0 ms, 1 over 50 ms: "
                     "80 ms")
    assert stalls == ["  wait at 10.000 (80 ms): consumer loop stall +50 .. +100 ms"]
    assert batch_waits([], producer) == "PackedPull batches: none traced"


def test_a_blocked_loop_is_written_with_the_stack_that_blocked_it():
    events, release = [], threading.Event()
    probe = StallProbe(lambda **fields: events.append(fields))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        probe.watch_loop(loop)
        assert wait_for(lambda: probe._loop_thread is not None, 30)

        def blocking_callback():  # holds the loop (not the GIL) until the probe saw it
            release.wait(60)
        loop.call_soon_threadsafe(blocking_callback)
        assert wait_for(lambda: any(e["kind"] == "stacks" for e in events), 30), events
        release.set()
        assert wait_for(lambda: any(e["kind"] == "loop" for e in events), 30), events
        stacks = next(e for e in events if e["kind"] == "stacks")["stacks"]
        assert any("blocking_callback" in frame for frames in stacks.values() for frame in frames), stacks
        loop_stall = next(e for e in events if e["kind"] == "loop")
        assert loop_stall["end"] - loop_stall["begin"] > STALL_S
    finally:
        release.set()
        probe.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
