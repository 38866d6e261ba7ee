"""A stray connection cannot bring a DCP decode instance down: a real ``--dcp 2`` decode daemon (rank 0
and one rank process) takes 25,000 connections on every port either process listens on (its
Generate API, metrics and health, the rank's API, and each rank's collective backend: gloo), each
opened, sent 8 bytes (what gloo reads as a connection's sequence number) and closed, at most 4,000
open at a time (this machine's fd limit is 20,000). Both processes keep running, the instance still
serves a request byte for byte, and each process's fd count comes back to what it was.

Before the group sealed its listeners, gloo kept every such connection open and aborted the rank
(SIGABRT) once it ran out of fds.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import time

import pytest

from kpool_pd.decode_worker.client import generate_all
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import make_prompts, run_colocated
from tests.support.dcp_daemons import dcp_instance
from tests.support.polling import process_alive, wait_for
from tests.workers.test_dcp_exposure import _listening
from tests.e2e.test_e2e import SETTLE_S, _assert_match
from tests.e2e.test_e2e_dcp import _children

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONNECTIONS = 25_000
OPEN_AT_ONCE = 4_000
CONNECT_WAIT_S = 3.0  # a batch's connections not up by then, or once none came up for IDLE_S, are closed
IDLE_S = 0.5  # (a sealed listener drops every SYN: its connections never come up)
PAYLOAD = 8  # bytes: gloo's sequence number


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _batch(port: int, first: int, count: int) -> int:
    """Open ``count`` connections to 127.0.0.1:``port`` at once, send each 8 bytes (sequence numbers
    from ``first``) once it is up, close them all; how many came up."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT left here
            sock.connect_ex(("127.0.0.1", port))
            socks.append(sock)
        poller = select.poll()
        pending = {sock.fileno(): sock for sock in socks}
        for fd in pending:
            poller.register(fd, select.POLLOUT)
        connected = 0
        deadline = time.monotonic() + CONNECT_WAIT_S
        while pending and time.monotonic() < deadline:
            ready = poller.poll(max(1, int(min(IDLE_S, deadline - time.monotonic()) * 1000)))
            if not ready:
                break
            for fd, _ in ready:
                sock = pending.pop(fd)
                poller.unregister(fd)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    try:
                        sock.send(struct.pack("<q", first + connected))
                        connected += 1
                    except OSError:  # reset by the server meanwhile
                        pass
        return connected
    finally:
        for sock in socks:
            sock.close()


def _storm(port: int, pids: list[int]) -> int:
    """``CONNECTIONS`` connections to ``port``, ``OPEN_AT_ONCE`` at a time, stopping early if one of
    ``pids`` died; how many came up."""
    connected = 0
    for first in range(0, CONNECTIONS, OPEN_AT_ONCE):
        connected += _batch(port, 1_000 + first, min(OPEN_AT_ONCE, CONNECTIONS - first))
        assert all(process_alive(pid) for pid in pids), f"a DCP process died under connections to port {port}"
    return connected


def test_stray_connections_to_every_port_leave_the_dcp_instance_serving(tmp_path):
    config = ModelConfig.build(num_layers=2, num_spec=0, seed=31)
    with dcp_instance(tmp_path, config, 2, transport="grpc", prefill_transports="grpc") as instance:
        decode = instance.decode
        pids = [decode.proc.pid, *_children(decode.proc.pid)]
        assert len(pids) == 2, f"rank 0 should have started 1 rank process, found {pids[1:]}"
        warm = make_prompts(1, 200, seed=32, vocab_size=config.vocab_size, max_tokens=4, prefix="warm")
        _assert_match(asyncio.run(generate_all(f"127.0.0.1:{decode.port}", warm)), run_colocated(config, warm))
        ports = {pid: sorted({port for _, port in _listening(pid)}) for pid in pids}
        assert all(len(p) >= 2 for p in ports.values()), f"each process listens on its API and gloo: {ports}"
        before = {pid: _fds(pid) for pid in pids}

        came_up = {port: _storm(port, pids) for pid in pids for port in ports[pid]}

        assert all(process_alive(pid) for pid in pids), "a DCP process died"
        assert decode.proc.poll() is None, f"rank 0 exited with status {decode.proc.returncode}"
        assert decode.port in came_up and came_up[decode.port] > 0, f"the Generate API took no connection: {came_up}"
        for pid in pids:
            assert wait_for(lambda pid=pid: _fds(pid) <= before[pid], SETTLE_S), \
                f"process {pid} holds {_fds(pid)} fds, {before[pid]} before {CONNECTIONS} connections to each of " \
                f"its ports (up: {came_up})"
        requests = make_prompts(2, 300, seed=33, vocab_size=config.vocab_size, max_tokens=8, prefix="after")
        _assert_match(asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests)),
                      run_colocated(config, requests))
    assert not list(instance.scratch.iterdir()), f"rendezvous folder left behind: {list(instance.scratch.iterdir())}"
