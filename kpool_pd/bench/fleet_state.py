"""Per-node state at scale: what one node holds for each peer, at 1, 16, 64 and 256 peers.

    python -m kpool_pd.bench.fleet_state [--peers 1,16,64,256] [--transport grpc|ucx] [--window-s 10]
                                         [--out bench/results]

Two subjects, each a process of its own (Linux: read from /proc and ``ss``):

- a decode node: its connector and prefill router (what ``kpool-pd decode`` runs per prefill node: a
  health channel, a peer channel with its keep-alive loop, UCX endpoints with ``--transport ucx``) over N
  simulated prefill nodes (real prefill connectors with tiny caches, all in one other process);
- a prefill node: its connector and gRPC server over N simulated decode engines (each a decode connector
  and router of its own, all in one other process, each dialing a loopback address of its own so that each
  has its own connections, as decode nodes in processes of their own do), which handshake and then check
  and heartbeat it.

After the peers are connected and ``--window-s`` of idle time, the subject's resident memory, open file
descriptors and threads, and the TCP bytes its sockets sent and received over the window (``ss``: every
byte on the wire, framing included) and the keep-alive calls it made or took (health checks, Heartbeats)
are recorded, beside the same figures with no peer. Targets: growth linear or better, a node's memory for
256 peers under 256 MiB (the growth over no peer: the process itself, torch included, is counted apart), idle
keep-alive traffic bounded (per peer, constant). Writes fleet-state-<date>-<machine>.json under --out.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from kpool_pd.bench.arguments import bench_parser, counts
from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, Transport
from kpool_pd.decode_worker.router import PrefillRouter
from kpool_pd.kvcache import CacheConfig, NodeCache
from kpool_pd.runtime import GrpcServer
from kpool_pd.runtime.launch import start_child

logger = logging.getLogger(__name__)

TOKEN = "fleet-state-peer-token"
CACHE = CacheConfig(layer_names=("l0",), block_size=64, kpool=4, num_spec=0, mla_entry_bytes=64)
HEALTH_INTERVAL_S = 2.0  # the decode daemon's default
CONNECT_S = 600.0
MEMORY_TARGET_MIB = 256


def _config() -> ConnectorConfig:
    return ConnectorConfig(peer_token=TOKEN, rpc_timeout_s=30.0, transfer_timeout_s=30.0)


def process_state(pid: int | None = None) -> dict[str, float]:
    """Resident memory (MiB), open file descriptors and threads of ``pid`` (this process by default)."""
    pid = pid or os.getpid()
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    return {"rss_mib": round(rss_kib / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def tcp_bytes(pid: int | None = None) -> int:
    """Bytes sent plus received by every TCP socket of ``pid`` now (``ss -tinp``)."""
    pid = pid or os.getpid()
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=60).stdout
    total, mine = 0, False
    for line in text.splitlines():
        if not line.startswith(("\t", " ")):
            mine = f"pid={pid}," in line
        elif mine:
            total += sum(int(v) for v in re.findall(r"bytes_(?:acked|received):(\d+)", line))
    return total


# the peers -------------------------------------------------------------------------------------------
def _transports(transport: str) -> tuple[Transport, ...]:
    return (Transport.UCX, Transport.GRPC_STREAM) if transport == "ucx" else (Transport.GRPC_STREAM,)


async def _prefill_peers(count: int, transport: str, conn) -> None:
    nodes = []
    for i in range(count):
        cache = NodeCache(CACHE, num_blocks=2, num_rings=1, device="cpu")
        node = PrefillConnector(cache.pool, None, engine_id=f"prefill-sim-{i}", config=_config(),
                                registry=CollectorRegistry(), transports=_transports(transport))
        await node.start()
        server = GrpcServer(peer_token=TOKEN, options=_config().grpc_options())
        server.add(node)
        await server.start("127.0.0.1", 0)
        await server.health.open(server)
        nodes.append((node, server, f"127.0.0.1:{server.port}"))
    conn.send([address for *_, address in nodes])
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    for node, server, _ in nodes:
        await server.stop(0)
        await node.stop()


def prefill_peers(count: int, transport: str, conn) -> None:
    asyncio.run(_prefill_peers(count, transport, conn))


def loopback(index: int, port: int) -> str:
    """A loopback address of its own for engine ``index`` (127.0.0.1, 127.0.0.2, ...): gRPC shares one connection
    among a process's channels to one address, where each decode node, a process of its own, has its own."""
    return f"127.0.{index // 250}.{index % 250 + 1}:{port}"


async def _decode_engine(port: int, transport: str, count: int, index: int) -> tuple[DecodeConnector, PrefillRouter]:
    address = loopback(index, port)
    cache = NodeCache(CACHE, num_blocks=2, num_rings=1, device="cpu")
    connector = DecodeConnector(cache.pool, engine_id=f"decode-sim-{count}-{index}", config=_config(),
                                registry=CollectorRegistry(), transports=_transports(transport))
    await connector.start()
    router = PrefillRouter(connector, (address,), health_interval_s=HEALTH_INTERVAL_S, rpc_timeout_s=30.0)
    await router.start()
    return connector, router


async def _decode_peers(count: int, port: int, transport: str, window_s: float, conn) -> None:
    engines = [await _decode_engine(port, transport, count, i) for i in range(count)]
    usable = sum(router.usable for _, router in engines)
    conn.send(usable)
    beats = sum(p.keep_alive.beats for c, _ in engines for p in c.peers)
    checks = sum(r.checks for _, r in engines)
    await asyncio.sleep(window_s + 1.0)  # the subject measures over its window meanwhile
    conn.send({"heartbeats_per_s": (sum(p.keep_alive.beats for c, _ in engines for p in c.peers) - beats) / (window_s + 1),
               "health_checks_per_s": (sum(r.checks for _, r in engines) - checks) / (window_s + 1)})
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    for connector, router in engines:
        await router.close()
        await connector.close()


def decode_peers(count: int, port: int, transport: str, window_s: float, conn) -> None:
    asyncio.run(_decode_peers(count, port, transport, window_s, conn))


# the subjects ------------------------------------------------------------------------------------------
async def _decode_subject(counts_: list[int], transport: str, window_s: float, conn) -> None:
    """For each count: N prefill peers in a child, this node's router over them, the figures."""
    from kpool_pd.runtime.launch import child_context

    rows = []
    cache = NodeCache(CACHE, num_blocks=2, num_rings=1, device="cpu")
    connector = DecodeConnector(cache.pool, engine_id="decode-subject", config=_config(),
                                registry=CollectorRegistry(), transports=_transports(transport))
    await connector.start()
    await asyncio.sleep(1.0)
    rows.append({"peers": 0, **process_state()})
    for count in counts_:
        here, there = child_context().Pipe()
        child = start_child(prefill_peers, count, transport, there, threads=1)
        addresses = await asyncio.get_running_loop().run_in_executor(None, here.recv)
        router = PrefillRouter(connector, tuple(addresses), health_interval_s=HEALTH_INTERVAL_S, rpc_timeout_s=30.0)
        started = time.monotonic()
        await router.start()
        while len(router.healthy()) < count and time.monotonic() - started < CONNECT_S:
            await asyncio.sleep(0.5)
        connected = len(router.healthy())
        await asyncio.sleep(2 * HEALTH_INTERVAL_S)  # settle
        beats = sum(p.keep_alive.beats for p in connector.peers)
        checks, sent, at = router.checks, tcp_bytes(), time.monotonic()
        await asyncio.sleep(window_s)
        seconds = time.monotonic() - at
        rows.append({"peers": count, "connected": connected, **process_state(),
                     "tcp_bytes_per_s": round((tcp_bytes() - sent) / seconds, 1),
                     "heartbeats_per_s": round((sum(p.keep_alive.beats for p in connector.peers) - beats) / seconds, 2),
                     "health_checks_per_s": round((router.checks - checks) / seconds, 2)})
        logger.info("decode subject: %s", rows[-1])
        await router.close()
        for peer in connector.peers:
            await connector.disconnect(peer)
        here.send("stop")
        child.join(60)
    await connector.close()
    conn.send(rows)


def decode_subject(counts_: list[int], transport: str, window_s: float, conn) -> None:
    asyncio.run(_decode_subject(counts_, transport, window_s, conn))


async def _prefill_subject(counts_: list[int], transport: str, window_s: float, conn) -> None:
    from kpool_pd.runtime.launch import child_context

    rows = []
    cache = NodeCache(CACHE, num_blocks=2, num_rings=1, device="cpu")
    node = PrefillConnector(cache.pool, None, engine_id="prefill-subject", config=_config(),
                            registry=CollectorRegistry(), transports=_transports(transport))
    await node.start()
    server = GrpcServer(peer_token=TOKEN, options=_config().grpc_options(), max_peer_sessions=4096)
    server.add(node)
    await server.start("0.0.0.0", 0)  # every loopback address: each simulated decode engine dials one of its own
    await server.health.open(server)
    await asyncio.sleep(1.0)
    rows.append({"peers": 0, **process_state()})
    loop = asyncio.get_running_loop()
    for count in counts_:
        here, there = child_context().Pipe()
        child = start_child(decode_peers, count, server.port, transport, window_s, there, threads=1)
        connected = await loop.run_in_executor(None, here.recv)
        await asyncio.sleep(1.0)
        sent, at = tcp_bytes(), time.monotonic()
        await asyncio.sleep(window_s)
        seconds = time.monotonic() - at
        calls = await loop.run_in_executor(None, here.recv)
        rows.append({"peers": count, "connected": connected, **process_state(),
                     "tcp_bytes_per_s": round((tcp_bytes() - sent) / seconds, 1),
                     **{k: round(v, 2) for k, v in calls.items()}})
        logger.info("prefill subject: %s", rows[-1])
        here.send("stop")
        child.join(120)
    await server.stop(0)
    await node.stop()
    conn.send(rows)


def prefill_subject(counts_: list[int], transport: str, window_s: float, conn) -> None:
    asyncio.run(_prefill_subject(counts_, transport, window_s, conn))


# the report --------------------------------------------------------------------------------------------
def judged(rows: list[dict]) -> dict:
    """Growth over no peer at the largest count, per peer, and whether it is linear or better: the growth per
    peer at the largest count is at most that of the smallest count (within 1 MiB, 2 fds, 1 thread of noise)."""
    base, small, large = rows[0], rows[1], rows[-1]
    growth = {k: round(large[k] - base[k], 1) for k in ("rss_mib", "fds", "threads")}
    linear = all((large[k] - base[k]) / large["peers"] <= (small[k] - base[k] + slack) / small["peers"] + 1e-9
                 for k, slack in (("rss_mib", 1.0), ("fds", 2), ("threads", 1)))
    per_peer_traffic = [r["tcp_bytes_per_s"] / r["peers"] for r in rows[1:]]
    return {"growth_at_largest": growth, "linear_or_better": linear,
            "memory_target_met": growth["rss_mib"] < MEMORY_TARGET_MIB,
            "tcp_bytes_per_s_per_peer": [round(v, 1) for v in per_peer_traffic]}


def table(name: str, rows: list[dict]) -> str:
    lines = [f"{name}: {'peers':>5} {'RSS MiB':>8} {'fds':>5} {'threads':>7} {'TCP B/s':>9} {'HB/s':>6} {'checks/s':>8}"]
    for r in rows:
        lines.append(f"{'':<{len(name) + 1}} {r['peers']:>5} {r['rss_mib']:>8.1f} {r['fds']:>5} {r['threads']:>7} "
                     f"{r.get('tcp_bytes_per_s', 0):>9.0f} {r.get('heartbeats_per_s', 0):>6.1f} "
                     f"{r.get('health_checks_per_s', 0):>8.1f}")
    verdict = judged(rows)
    lines.append(f"{'':<{len(name) + 1}} growth at {rows[-1]['peers']} peers: {verdict['growth_at_largest']}; "
                 f"linear or better: {verdict['linear_or_better']}; memory under {MEMORY_TARGET_MIB} MiB: "
                 f"{verdict['memory_target_met']}; TCP bytes/s per peer: {verdict['tcp_bytes_per_s_per_peer']}")
    return "\n".join(lines)


def _run_subject(target, peer_counts: list[int], transport: str, window_s: float) -> list[dict]:
    from kpool_pd.runtime.launch import child_context

    here, there = child_context().Pipe()
    child = start_child(target, peer_counts, transport, window_s, there, threads=1, daemon=False)  # it has children
    rows = here.recv()
    child.join(60)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m kpool_pd.bench.fleet_state", __doc__)
    parser.add_argument("--peers", type=counts, default=[1, 16, 64, 256], help="peer counts (default 1,16,64,256)")
    parser.add_argument("--transport", choices=["grpc", "ucx"], default="grpc",
                        help="data plane offered (ucx: UCX endpoints per peer too; default grpc)")
    parser.add_argument("--window-s", type=float, default=10.0, help="idle time the traffic is measured over")
    parser.add_argument("--machine", default=platform.node() or "machine", help="name in the result file name")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the JSON result")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = {}
    for name, target in (("decode node", decode_subject), ("prefill node", prefill_subject)):
        results[name] = _run_subject(target, args.peers, args.transport, args.window_s)
        sys.stdout.write(table(name, results[name]) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fleet-state-{dt.date.today().isoformat()}-{args.machine}-{args.transport}.json"
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": args.machine,
            "transport": args.transport, "window_s": args.window_s, "health_interval_s": HEALTH_INTERVAL_S,
            "heartbeat_s": _config().heartbeat_interval_s,
            "command": "python -m kpool_pd.bench.fleet_state " + " ".join(argv if argv is not None else sys.argv[1:])}
    verdicts = {name: judged(rows) for name, rows in results.items()}
    path.write_text(json.dumps({"meta": meta, "results": results, "verdicts": verdicts}, indent=1) + "\n")
    sys.stdout.write(f"wrote {path}\n")
    met = all(v["linear_or_better"] and v["memory_target_met"] for v in verdicts.values())
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
