"""The test side of the connector tests: a prefill node in its own process (``kpool_pd.runtime.launch``:
forked with torch imported, one torch thread), driven through a pipe; a child process run to completion, every wait under a deadline; and a prefill
and a decode node in the test's own event loop."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import MAX_PEER_SESSIONS, ConnectorConfig, DecodeConnector, PrefillConnector, Transport
from kpool_pd.kvcache import CacheConfig, NodeCache
from kpool_pd.runtime.launch import child_context, start_child
from tests.support import connector_procs as procs
from tests.support.deadlines import patient
from tests.support.serving import serve_prefill, stop_prefill

CTX = child_context()
CHILD_THREADS = 1  # two workers of the suite on two cores: a child on one torch thread


class Prefill:
    def __init__(self, **kwargs) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = start_child(procs.prefill_main, child, threads=CHILD_THREADS, **kwargs)
        allowed_s = patient(60)
        deadline = time.monotonic() + allowed_s
        while not self.conn.poll(0.1):
            assert self.proc.is_alive(), f"prefill process exited with {self.proc.exitcode} before serving"
            assert time.monotonic() < deadline, f"prefill process did not start within {allowed_s:.0f} s"
        _, self.port, self.free_blocks, self.free_rings = self.conn.recv()
        self.address = f"127.0.0.1:{self.port}"

    def counts(self):
        self.conn.send(("counts",))
        assert self.conn.poll(patient(10))
        return self.conn.recv()

    def chunks(self) -> tuple[int, int]:
        """A chunked engine's (chunks computed, computations stopped before their last chunk)."""
        self.conn.send(("chunks",))
        assert self.conn.poll(patient(10))
        return self.conn.recv()

    def stop(self):
        if self.proc.is_alive():
            self.conn.send(("stop",))
            assert self.conn.poll(patient(10))
            msg = self.conn.recv()
            self.proc.join(patient(10))
            return msg
        return None

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(patient(10))


def run_child(target, timeout: float = 60, **kwargs):
    """Run ``target`` in a child process until its last message (one not marked ``dying``); (messages, exit code).
    ``timeout``: what it takes on an idle machine (stretched, ``tests.support.deadlines``)."""
    conn, child = CTX.Pipe()
    proc = start_child(target, child, threads=CHILD_THREADS, **kwargs)
    messages = []
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            messages.append(conn.recv())
            if not (isinstance(messages[-1], dict) and messages[-1].get("dying")):
                break
        elif not proc.is_alive():
            break
    proc.join(patient(10))
    return messages, proc.exitcode


@pytest.fixture(name="prefill")
def prefill_nodes():
    """``prefill(**kwargs)`` starts a prefill node process; every one is killed at teardown."""
    nodes = []

    def make(**kwargs):
        node = Prefill(**kwargs)
        nodes.append(node)
        return node
    yield make
    for node in nodes:
        node.kill()


class InProcessPair:
    """A prefill node and a decode node in the test's own event loop, each with its own node cache
    (``p_cache``, ``d_cache``, both on ``device``) and registry (``async with``; the prefill node stops without
    grace).
    The prefill engine allocates from ``p_cache`` (a test engine without a cache is given it); its server
    keeps at most ``max_peer_sessions`` peer sessions."""

    def __init__(self, *, prefill_config: CacheConfig = procs.CONFIG, decode_config: CacheConfig | None = None,
                 config: ConnectorConfig | None = None, engine=None, transports=(Transport.GRPC_STREAM,),
                 num_blocks: int = 32, num_rings: int = 4, device: str = "cpu",
                 max_peer_sessions: int = MAX_PEER_SESSIONS) -> None:
        config = config or ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(10),
                                           transfer_timeout_s=patient(10))
        self.registry, self.decode_registry = CollectorRegistry(), CollectorRegistry()
        self.p_cache = NodeCache(prefill_config, num_blocks=num_blocks, num_rings=num_rings, device=device)
        self.d_cache = NodeCache(decode_config or prefill_config, num_blocks=num_blocks, num_rings=num_rings,
                                 device=device)
        self.engine = engine or procs.SeededFillEngine()
        if getattr(self.engine, "cache", False) is None:
            self.engine.cache = self.p_cache
        self.prefill = PrefillConnector(self.p_cache.pool, self.engine, engine_id="prefill-t", config=config,
                                        registry=self.registry, transports=transports)
        self.decode = DecodeConnector(self.d_cache.pool, engine_id="decode-t", config=config,
                                      registry=self.decode_registry, transports=transports)
        self.address = ""
        self.max_peer_sessions = max_peer_sessions

    async def __aenter__(self) -> "InProcessPair":
        self.server = await serve_prefill(self.prefill, max_peer_sessions=self.max_peer_sessions)
        self.address = f"127.0.0.1:{self.server.port}"
        await self.decode.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.decode.close()
        await stop_prefill(self.server, self.prefill)

    def free(self) -> tuple[int, int, int, int]:
        """Free blocks and rings: prefill side, then decode side."""
        return self.p_cache.free_blocks, self.p_cache.free_rings, self.d_cache.free_blocks, self.d_cache.free_rings

    def prefill_sample(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(f"kpoolpd_prefill_{name}", labels) or 0.0

    def decode_sample(self, name: str, **labels) -> float:
        return self.decode_registry.get_sample_value(f"kpoolpd_decode_{name}", labels) or 0.0
