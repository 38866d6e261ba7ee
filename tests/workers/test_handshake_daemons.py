"""The Handshake between the two real daemons: a prefill and a decode daemon whose models differ
only in ``--seed`` never exchange a cache (the handshake is refused naming the seed, and a request
fails with that reason); and a daemon given ``--host 127.0.0.1`` listens on loopback only, UCX's
tcp listeners (its own and its probe child's) included."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest

from kpool_pd.connector.shared.ucx import ucx_available
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.model.colocated import make_prompts
from kpool_pd.runtime import model_flags
from tests.support.polling import wait_for

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
TOKEN = "handshake-client-token"
PEER_TOKEN = "handshake-peer-token"
MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=1)
COMMON = ["--peer-token", PEER_TOKEN, "--log-format", "text", "--health-interval-s", "0.5"]


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(IP, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            ip_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(ip_hex)
            if family == socket.AF_INET:
                ip = socket.inet_ntop(family, struct.pack("<I", int(ip_hex, 16)))
            else:
                ip = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append((ip, int(port_hex, 16)))
    return found


def _loopback(text: str) -> bool:
    ip = ipaddress.ip_address(text)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        text = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        out += [int(child) for child in text]
    return out


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("handshake-daemons")
    prefill = start_prefill(workdir, model_flags(MODEL), transports="ucx", extra=[*COMMON[:4]])
    started = [prefill]
    try:
        prefill.wait_ready(120)
        decode = start_decode(workdir, model_flags({**MODEL, "seed": 2}), [f"127.0.0.1:{prefill.port}"], transport="ucx",
                              extra=[*COMMON, "--token", TOKEN])
        started.append(decode)
        decode.wait_ready(120)
        yield prefill, decode
    finally:
        for daemon in reversed(started):
            daemon.stop()


def test_daemons_with_different_seeds_refuse_each_other(daemons):
    prefill, decode = daemons
    assert wait_for(lambda: "seed 1 vs 2" in prefill.log_tail(200), 30), prefill.log_tail()
    assert "model differs" in prefill.log_tail(200)
    # the decode node has read the refusal too (the prefill node logs it first): a request before that finds
    # the node "not handshaken yet"
    decode_refused = lambda: "seed 2 vs 1" in decode.log_tail(400) or "seed 1 vs 2" in decode.log_tail(400)  # noqa: E731
    assert wait_for(decode_refused, 30), decode.log_tail()
    requests = make_prompts(1, 40, seed=0, vocab_size=1024, max_tokens=4)
    (result,) = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests, token=TOKEN, timeout_s=30))
    assert isinstance(result, RequestFailed), "a decode node of another seed produced tokens"
    assert "seed 1 vs 2" in result.message or "seed 2 vs 1" in result.message, result.message
    print(f"request refused: {result.code.name}: {result.message}")
    assert decode_refused(), decode.log_tail()


def test_host_127_0_0_1_keeps_ucx_on_loopback(daemons):
    for daemon in daemons:
        pids = [daemon.proc.pid, *children(daemon.proc.pid)]
        sockets = [s for pid in pids for s in listening_sockets(pid)]
        others = [s for s in sockets if s[1] not in (daemon.port, daemon.metrics_port)]
        assert others, f"{daemon.name}: no UCX listener found among {sockets}"
        assert all(_loopback(ip) for ip, _ in sockets), f"{daemon.name} listens on {sockets}"
        fabric = [line for line in daemon.log_tail(400).splitlines() if "data plane: UCX" in line]
        assert fabric and "tcp/lo" in fabric[0] and "tcp/" not in fabric[0].replace("tcp/lo", ""), daemon.log_tail()
