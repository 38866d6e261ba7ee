"""The connector between real processes on loopback: a prefill node and a decode node, both
transports, random non-contiguous blocks and random bytes compared byte for byte, leases,
refusals, and either side killed in the middle of a transfer."""

from __future__ import annotations


import pytest

from tests.support import connector_procs as procs
from tests.support.connector_harness import prefill_nodes, run_child  # noqa: F401 (the prefill fixture)
from tests.support.polling import wait_for

TRANSPORTS = ["ucx", "grpc"]
LEASE_S = 1.5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_roundtrip_bytes_leases_and_release(prefill, transport):
    node = prefill(lease_s=LEASE_S)
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport, scenario="roundtrip", lease_s=LEASE_S)
    assert code == 0
    assert out["checked_bytes"] > 0
    assert max(out["regions"]) > 2  # fragmented pools: several runs per request
    assert out["released_twice"] is False
    assert out["late"] == "NOT_FOUND"
    assert out["end_free"] == out["start_free"]
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 3 * LEASE_S), node.counts()
    assert node.stop() == ("stopped", 96, 8)


@pytest.mark.parametrize("what,code,needle", [
    ("mismatch", "FAILED_PRECONDITION", "kpool"),
    ("no_token", "UNAUTHENTICATED", "missing peer credential"),
])
def test_handshake_refusals(prefill, what, code, needle):
    node = prefill(lease_s=LEASE_S)
    ((status, message),), _ = run_child(procs.refusal_main, address=node.address, what=what)
    assert status == code and needle in message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_killed_mid_transfer_frees_at_lease_expiry(prefill, transport):
    node = prefill(lease_s=LEASE_S)
    messages, code = run_child(procs.decode_main, address=node.address, transport=transport, scenario="decode_dies", lease_s=LEASE_S)
    assert messages == [{"dying": True}] and code == 17
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 4 * LEASE_S), node.counts()
    assert node.proc.is_alive()
    # the prefill node still serves a new decode node over the same transport, byte for byte
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport, scenario="roundtrip", lease_s=LEASE_S)
    assert code == 0 and out["checked_bytes"] > 0 and out["end_free"] == out["start_free"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_killed_mid_transfer_fails_cleanly(prefill, transport):
    node = prefill(lease_s=LEASE_S, die=transport)
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport, scenario="prefill_dies", lease_s=LEASE_S)
    assert code == 0
    assert out["error"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"), out
    assert out["seconds"] < out["transfer_timeout_s"] + 1.0  # within the decode side's transfer deadline
    assert out["end_free"] == out["start_free"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pulls_from_a_live_node_after_failed_pulls(prefill, transport):
    """A pull that fails on the decode side once its receives are posted (UCX) or mid-stream
    (gRPC), or a disconnect and a new handshake, must not break the next pulls from the same
    prefill node."""
    node = prefill(lease_s=LEASE_S)
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport,
                             scenario="failed_pulls_then_more", lease_s=LEASE_S)
    assert code == 0
    assert set(out["failed"]) <= {"UNAVAILABLE", "INTERNAL"} and len(out["failed"]) == 3, out["failed"]
    assert out["differences"] == []
    assert out["end_free"] == out["start_free"]


CHUNK_TOKENS = 100  # the prefill node's chunks (a block is 64 tokens): pieces of one block, 1.5 blocks a chunk


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_killed_between_chunks_frees_everything_on_the_prefill_node(prefill, transport):
    node = prefill(lease_s=LEASE_S, chunk_tokens=CHUNK_TOKENS)
    messages, code = run_child(procs.decode_main, address=node.address, transport=transport,
                               scenario="pipelined_decode_dies", lease_s=LEASE_S)
    assert messages == [{"dying": True}] and code == 17
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 4 * LEASE_S), node.counts()
    assert node.proc.is_alive()
    # the node still serves pipelined pulls, byte for byte, each with its first token and its times
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport, scenario="pipelined",
                             lease_s=LEASE_S)
    assert code == 0 and out["error"] is None and out["differences"] == [], out
    assert out["pipelined"] == [True, True, True] and out["end_free"] == out["start_free"]
    assert out["first_tokens"] == out["expected_first_tokens"]
    for times in out["times"]:
        assert times.prefill_ms > 0 and times.transfer_ms > 0 and 0 <= times.exposed_transfer_ms


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_decode_killed_mid_prompt_stops_the_prefill_within_a_chunk(prefill, transport):
    """The decode process dies while its pipelined pull waits on a 20-chunk prompt (0.2 s a chunk): the
    prefill node computes at most one more chunk and frees everything long before the lease (20 s) ends."""
    lease_s, chunks = 20.0, 2000 // CHUNK_TOKENS
    node = prefill(lease_s=lease_s, chunk_tokens=CHUNK_TOKENS, chunk_pause_s=0.2)
    messages, code = run_child(procs.decode_main, address=node.address, transport=transport,
                               scenario="pipelined_decode_dies", lease_s=lease_s)
    assert messages == [{"dying": True}] and code == 17
    computed_at_death, _ = node.chunks()
    assert computed_at_death < chunks - 3, computed_at_death  # the prompt was well under way, far from done
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 10.0), node.counts()
    computed, stopped = node.chunks()
    assert stopped == 1 and computed <= computed_at_death + 1, (computed_at_death, computed, stopped)
    assert node.proc.is_alive()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_killed_between_chunks_fails_the_request_cleanly(prefill, transport):
    node = prefill(lease_s=LEASE_S, die="between_chunks", chunk_tokens=CHUNK_TOKENS)
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport,
                             scenario="pipelined_prefill_dies", lease_s=LEASE_S)
    assert code == 0
    assert out["pipelined"] == [True]
    assert out["error"] in ("UNAVAILABLE", "CANCELLED"), out
    assert out["seconds"] < 3.0, out  # the lost stream ends the pull, long before its deadline (6 s)
    assert out["end_free"] == out["start_free"]
    node.proc.join(10)
    assert node.proc.exitcode == 17
