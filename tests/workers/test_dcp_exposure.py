"""A DCP decode instance exposes nothing off its host, and its ranks' API takes only the instance's
secret: a real ``--dcp 2`` decode daemon (rank 0 and one rank process) with ``--host 127.0.0.1``,
started with ``GLOO_SOCKET_IFNAME`` naming a non-loopback interface (what a hostname resolving to
the pod IP did), listens on loopback only (every listening socket of both processes, read from
``/proc``); a Drop sent to the rank with the fleet's peer token is refused and the instance still
serves a request byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import grpc
import pytest

from kpool_pd.decode_worker import dcp_api as api
from kpool_pd.decode_worker.client import generate_all
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import make_prompts, run_colocated
from tests.support.dcp_daemons import dcp_instance
from tests.e2e.test_e2e import _assert_match
from tests.e2e.test_e2e_dcp import _children

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PEER_TOKEN = "exposure-test-peer-token"
# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp{,6} write them
LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
LISTEN = "0A"


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address in /proc hex, port) of every TCP socket of process ``pid`` in the LISTEN state."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            address, port = fields[1].split(":")
            if fields[3] == LISTEN and fields[9] in inodes:
                found.append((address, int(port, 16)))
    return found


def _other_interface() -> str:
    """A non-loopback interface of this host (gloo would listen on its address if it were used)."""
    names = [name for _, name in socket.if_nameindex() if not name.startswith("lo")]
    assert names, "this test needs a host with a non-loopback interface"
    return "eth0" if "eth0" in names else names[0]


def test_dcp_ranks_listen_on_loopback_only_and_refuse_the_peer_token(tmp_path):
    config = ModelConfig.build(num_layers=2, num_spec=0, seed=21)
    with dcp_instance(tmp_path, config, 2, transport="grpc", prefill_transports="grpc",
                      prefill_extra=["--peer-token", PEER_TOKEN], decode_extra=["--peer-token", PEER_TOKEN],
                      env={"GLOO_SOCKET_IFNAME": _other_interface()}) as instance:
        decode, scratch = instance.decode, instance.scratch
        ranks = _children(decode.proc.pid)
        assert len(ranks) == 1, f"rank 0 should have started 1 rank process, found {ranks}"
        for pid in (decode.proc.pid, *ranks):
            listening = _listening(pid)
            assert listening, f"process {pid} listens nowhere?"
            beyond = [(a, p) for a, p in listening if a not in LOOPBACK]
            # rank 0's own Generate API and metrics listen on --host (127.0.0.1 here) too
            assert not beyond, f"process {pid} listens beyond loopback: {beyond}"

        # the rank's API refuses the fleet's peer token (and no token at all)
        ready = next(scratch.glob("kpoolpd-dcp-*/rank-1.ready.json"))
        port = json.loads(ready.read_text())["grpc_port"]

        async def drop(token: str | None) -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                md = (("authorization", f"Bearer {token}"),) if token else ()
                try:
                    await api.DcpRankServiceStub(channel).Drop(api.DropRequest(request_id=""), timeout=10,
                                                                 metadata=md)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
        assert asyncio.run(drop(PEER_TOKEN)) is grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(drop(None)) is grpc.StatusCode.UNAUTHENTICATED

        requests = make_prompts(2, 300, seed=22, vocab_size=config.vocab_size, max_tokens=8, prefix="after")
        results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests))
        _assert_match(results, run_colocated(config, requests))
    assert not list(instance.scratch.iterdir()), f"rendezvous folder left behind: {list(instance.scratch.iterdir())}"
