"""Process bodies and helpers for the Handshake hardening tests: a prefill node in its own process
that logs to a file and reports which decode engines it knows; a decode node that handshakes, then
waits for the test's go before it pulls; junk worker addresses an attacker would send."""

from __future__ import annotations

import asyncio
import logging
import os
import random

import grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, Transport, open_channel
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.wire import PROTOCOL_VERSION, layout_message
from kpool_pd.kvcache import BlockLayout, NodeCache
from kpool_pd.runtime.launch import child_context, start_child
from tests.support.pulls import pull_into
from tests.support import connector_procs as procs
from tests.support.deadlines import patient
from tests.support.serving import serve_prefill, stop_prefill

CTX = child_context()
PULL_LENGTHS = (1, 5, 64, 65, 300, 1000)


def prefill_logged_main(conn, *, log_path: str, lease_s: float, model_identity: str = "") -> None:
    """A prefill node (``procs.CONFIG``, UCX and the gRPC stream) logging to ``log_path``; answers
    ("counts",) with (free blocks, free rings, grants held), ("peers",) with (the engines it knows,
    the engines it holds a UCX address of), ("stop",) by stopping."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")

    async def main():
        layout = BlockLayout(procs.CONFIG)
        cache = NodeCache(layout, num_blocks=96, num_rings=8)
        config = ConnectorConfig(lease_s=lease_s, peer_token=procs.TOKEN, transfer_timeout_s=max(lease_s * 2, 3.0))
        node = PrefillConnector(cache.pool, procs.SeededFillEngine(cache), engine_id="prefill-0", config=config,
                                registry=CollectorRegistry(), model_identity=model_identity)
        server = await serve_prefill(node)
        conn.send(("port", server.port, cache.free_blocks, cache.free_rings))
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "counts":
                conn.send((cache.free_blocks, cache.free_rings, len(node.leases)))
            elif cmd[0] == "peers":
                conn.send((sorted(node.engines.ids()), sorted(e for e in node.engines.ids() if node.engines.get(e).link)))
            elif cmd[0] == "address":  # the UCX worker address its record of engine cmd[1] sends to
                record = node.engines.get(cmd[1])
                conn.send(None if record is None else record.ucx_address)
            elif cmd[0] == "stop":
                await stop_prefill(server, node)
                conn.send(("stopped",))
                return
    asyncio.run(main())
    os._exit(0)  # skip interpreter teardown of the UCX worker


class LoggedPrefill:
    """``prefill_logged_main`` in a child process (``kpool_pd.runtime.launch``); ``ask(cmd)`` sends a command and returns the answer."""

    def __init__(self, log_path, **kwargs) -> None:
        self.log_path = log_path
        self.conn, child = CTX.Pipe()
        self.proc = start_child(prefill_logged_main, child, threads=1, log_path=str(log_path), **kwargs)
        assert self.conn.poll(60), f"prefill process did not start (exit {self.proc.exitcode})"
        _, self.port, self.free_blocks, self.free_rings = self.conn.recv()
        self.address = f"127.0.0.1:{self.port}"

    def ask(self, *cmd):
        assert self.proc.is_alive(), f"prefill process died with {self.proc.exitcode}"
        self.conn.send(cmd)
        assert self.conn.poll(20), f"no answer to {cmd}"
        return self.conn.recv()

    def log(self) -> str:
        return open(self.log_path, errors="replace").read()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def decode_wait_main(conn, *, address: str, lease_s: float, engine_id: str = "decode-real") -> None:
    """A decode node (UCX only): handshake, send ("ready", engine id, UCX worker address), wait for
    ("go",), then prefill and pull ``PULL_LENGTHS`` over UCX and compare every block and the ring's
    live slots byte for byte; send {"ok": [...], "errors": [...], "differences": [...]}."""
    async def main():
        layout = BlockLayout(procs.CONFIG)
        cache = NodeCache(layout, num_blocks=64, num_rings=4)
        pool = cache.pool
        config = ConnectorConfig(lease_s=lease_s, peer_token=procs.TOKEN, transfer_timeout_s=patient(5),
                                 rpc_timeout_s=patient(5))
        node = await DecodeConnector(pool, engine_id=engine_id, config=config,
                                     registry=CollectorRegistry(), transports=(Transport.UCX,)).start()
        peer = await node.connect(address)
        conn.send(("ready", engine_id, node.ucx.address))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)
        out = {"ok": [], "errors": [], "differences": []}
        for n in PULL_LENGTHS:
            rid = f"after-{n}"
            try:
                grant = await peer.prefill(rid, [(7 * i) % 50000 for i in range(n)])
                with await pull_into(cache, peer, grant, transport=Transport.UCX, integrity=True) as landed:
                    out["differences"] += procs.landed_differences(pool, landed, rid, n)[0]
                out["ok"].append(n)
            except StatusError as exc:
                out["errors"].append(f"{n}: {exc.code.name}: {exc.message}")
        await node.close()
        conn.send(out)
    asyncio.run(main())
    os._exit(0)


class WaitingDecode:
    """``decode_wait_main`` in a child process (``kpool_pd.runtime.launch``): ``engine_id`` and ``ucx_address`` once it
    handshook; ``go()`` lets it pull and returns its result dict."""

    def __init__(self, address: str, lease_s: float, **kwargs) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = start_child(decode_wait_main, child, threads=1, address=address, lease_s=lease_s, **kwargs)
        assert self.conn.poll(60), f"decode process did not handshake (exit {self.proc.exitcode})"
        _, self.engine_id, self.ucx_address = self.conn.recv()

    def go(self, timeout_s: float = 60) -> dict:
        self.conn.send(("go",))
        assert self.conn.poll(timeout_s), "decode process did not report"
        out = self.conn.recv()
        self.proc.join(10)
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def junk_addresses(real: bytes, count: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """``count`` addresses an attacker might send, labelled: random 1 KiB, truncated real ones,
    and real ones with a few bytes changed (some of these still reach the real worker)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = ("random", "truncated", "mutated")[i % 3]
        if kind == "random":
            address = bytes(rng.randrange(256) for _ in range(1024))
        elif kind == "truncated":
            address = real[:rng.randrange(1, len(real))]
        else:
            data = bytearray(real)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            address = bytes(data)
        out.append((kind, address))
    return out


def handshake_as(address: str, engine_id: str, ucx_worker_address: bytes, *, layout=None, model_identity: str = "",
                 transports=(pb.TRANSPORT_UCX,), engine_secret: bytes = b"", timeout_s: float = 15.0,
                 protocol_version: int = PROTOCOL_VERSION) -> tuple[str, str]:
    """One Handshake sent as an attacker would, with a raw stub (the peer token, any bytes); returns
    (status code name, details)."""
    request = pb.HandshakeRequest(engine_id=engine_id, layout=layout or layout_message(BlockLayout(procs.CONFIG)),
                                  transports=list(transports), ucx_worker_address=ucx_worker_address,
                                  model_identity=model_identity, engine_secret=engine_secret,
                                  protocol_version=protocol_version)
    return call_as(address, "Handshake", request, timeout_s=timeout_s)


def call_as(address: str, method: str, request, *, timeout_s: float = 15.0) -> tuple[str, str]:
    """One call of ``method`` (Handshake, Prefill, Release, Heartbeat; Pull: read to its end) sent as an
    attacker holding the peer token would (a session proved through PeerAuth), with a raw stub; returns
    (status code name, details)."""
    async def go():
        async with open_channel(address, None, peer_token=procs.TOKEN, challenge_timeout_s=timeout_s) as channel:
            call = getattr(pb.PrefillServiceStub(channel), method)(request, timeout=timeout_s)
            try:
                if method == "Pull":
                    async for _ in call:
                        pass
                else:
                    await call
                return "OK", ""
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, exc.details()
    return asyncio.run(go())
