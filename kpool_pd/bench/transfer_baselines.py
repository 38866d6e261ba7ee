"""The transfer benchmark's baselines, each measured between two processes (``kpool_pd.runtime.launch``)
or within one: a raw loopback TCP stream, memcpy or torch's peer copy, and NIXL READ of the same
bytes where the nixl package imports (``kpool_pd.bench.transfer`` prints them beside the connector's rows;
``kpool_pd.bench.grpc_baseline`` is the raw gRPC stream)."""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch

from kpool_pd.runtime.launch import child_context, start_child


def _socket_sender(port: int, nbytes: int, reps: int) -> None:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (-(-nbytes >> 20)))[:nbytes]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for _ in range(reps):
            s.recv(1)  # the receiver's clock has started
            s.sendall(buf)


def socket_stream_gbps(nbytes: int, reps: int) -> float:
    """Raw loopback TCP, one stream, between two processes: receive ``nbytes`` into a buffer."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(60)
    proc = start_child(_socket_sender, srv.getsockname()[1], nbytes, reps)
    conn, _ = srv.accept()
    conn.settimeout(60)
    dst = memoryview(bytearray(nbytes))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < nbytes:
            got += conn.recv_into(dst[got:], nbytes - got)
        times.append(time.perf_counter() - t0)
    conn.close()
    srv.close()
    proc.join(10)
    return nbytes / statistics.median(times) / 1e9


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, reps: int) -> float:
    """memcpy (same device) or torch peer copy (cuda:0 -> cuda:1) of ``src.numel()`` bytes."""
    times = []
    for _ in range(reps + 1):
        for t in (src, dst):
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        for t in (src, dst):  # a peer copy runs on the source device's stream
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
        times.append(time.perf_counter() - t0)
    return src.numel() / statistics.median(times[1:]) / 1e9


# NIXL READ -----------------------------------------------------------------------------------
def import_nixl():
    """The nixl module (``nixl``, or the CUDA-specific ``nixl_cu12``/``nixl_cu13`` it wraps), or
    None with the reason."""
    errors = []
    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            module = __import__(name)
        except (ImportError, OSError) as exc:  # not installed, or a missing shared library
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            return module, ""
        errors.append(f"{name}: no nixl_agent")
    return None, "; ".join(errors)


def _nixl_target(conn, nbytes: int, device: str) -> None:
    nixl, _ = import_nixl()
    agent = nixl.nixl_agent("bench-target", nixl.nixl_agent_config(backends=["UCX"]))
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    if src.is_cuda:
        torch.cuda.synchronize(src.device)
    agent.register_memory(src)
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(src))))
    conn.recv()  # stop
    os._exit(0)


def nixl_read_gbps(nbytes: int, reps: int, src_device: str, dst_device: str) -> float:
    """NIXL (UCX backend) READ of one ``nbytes`` region from another process's ``src_device``
    memory into ``dst_device`` memory here; median of ``reps`` after one warm-up."""
    nixl, _ = import_nixl()
    conn, child = child_context().Pipe()
    proc = start_child(_nixl_target, child, nbytes, src_device)
    if not conn.poll(120):
        raise RuntimeError("NIXL target process did not start")
    metadata, remote = conn.recv()
    agent = nixl.nixl_agent("bench-initiator", nixl.nixl_agent_config(backends=["UCX"]))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    agent.register_memory(dst)
    peer = agent.add_remote_agent(metadata)
    local, remote = agent.get_xfer_descs(dst), agent.deserialize_descs(remote)
    times = []
    for _ in range(reps + 1):
        handle = agent.initialize_xfer("READ", local, remote, peer)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        deadline = t0 + 120
        while state == "PROC" and time.perf_counter() < deadline:
            time.sleep(20e-6)  # leave the CPU to NIXL's progress thread (2-core machines)
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - t0)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL READ of {nbytes} B ended in state {state}")
    conn.send("stop")
    proc.join(30)
    return nbytes / statistics.median(times[1:]) / 1e9
