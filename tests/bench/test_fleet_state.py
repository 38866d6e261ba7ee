"""The per-node state bench's measures and verdicts (``kpool_pd.bench.fleet_state``): a process's memory, file
descriptors and threads read from /proc, its TCP bytes from ``ss``, and what counts as linear growth."""

from __future__ import annotations

import shutil
import socket
import threading

import pytest

from kpool_pd.bench.fleet_state import judged, process_state, tcp_bytes


def _row(peers: int, rss: float, fds: int, threads: int, traffic: float = 0.0) -> dict:
    return {"peers": peers, "rss_mib": rss, "fds": fds, "threads": threads, "tcp_bytes_per_s": traffic}


def test_process_state_sees_new_threads_and_file_descriptors():
    """16 threads and 16 sockets more are seen, with room for up to 8 of each that earlier tests' background
    threads or sockets closed meanwhile (one thread and one socket were hidden by such a close once)."""
    before = process_state()
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait) for _ in range(16)]
    for worker in workers:
        worker.start()
    held = [socket.socket() for _ in range(16)]
    try:
        after = process_state()
        assert after["threads"] >= before["threads"] + 8 and after["fds"] >= before["fds"] + 8, (before, after)
        assert after["rss_mib"] > 0
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        for sock in held:
            sock.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_tcp_bytes_counts_what_this_process_sends_and_receives():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        before = tcp_bytes()
        client.sendall(b"x" * 100_000)
        received = 0
        while received < 100_000:
            received += len(peer.recv(65536))
        assert tcp_bytes() - before >= 2 * 100_000  # sent by one socket, received by the other, both ours
    finally:
        for s in (client, peer, server):
            s.close()


def test_growth_is_judged_per_peer_against_the_smallest_count():
    linear = [_row(0, 100, 20, 8), _row(1, 101, 23, 9, 130), _row(16, 116, 68, 9, 2000), _row(256, 356, 788, 9, 33000)]
    verdict = judged(linear)
    assert verdict["linear_or_better"] and verdict["growth_at_largest"] == {"rss_mib": 256.0, "fds": 768, "threads": 1}
    assert not verdict["memory_target_met"]  # 256 MiB is not under 256 MiB
    assert verdict["tcp_bytes_per_s_per_peer"] == [130.0, 125.0, 128.9]
    worse = [_row(0, 100, 20, 8), _row(1, 101, 23, 9), _row(256, 100 + 256 * 3, 788, 9)]
    assert not judged(worse)["linear_or_better"]  # 3 MiB a peer at 256 where 1 peer cost 1 MiB
