"""KpoolPdConnector with time stamps, for ``python -m kpool_pd.bench.vllm_profile``: where a consumer's phase
goes in vLLM mode. Loaded by vLLM in an engine's process (``kv_connector_module_path``
``kpool_pd.bench.vllm_trace``, ``kv_connector`` ``KpoolPdConnector``), it wraps, without changing them, the
calls that a decode request passes through, and appends one JSON line per event to the file named by
``$KPOOLPD_TRACE`` (``perf_counter`` seconds: CLOCK_MONOTONIC, the same clock in every process of a host).

The events (``Event``): vLLM's scheduler steps (``schedule``: the tokens it scheduled, the requests waiting
for remote KV), the connector's scheduler-side calls (``queued``, ``matched``, ``allocated``, ``meta``: the
loads a step's metadata hands to the worker), the worker's (``start_load``, ``get_finished``: vLLM's ``get_transfer_results``, with the
requests it reports and how long it took, its idle wait included), the pull on the connector's thread
(``pull`` begin/end, ``peer`` the handshaken peer found, ``land`` the Pull stream or a step's PackedPull,
``release`` the Release call, each begin/end), the gRPC messages read on a pull's stream (``message``), every RPC the consumer
sends (``rpc``), and the pull's hops (``kpool_pd.connector.shared.hops``: ``hop``). A producer's events
are its offers (``offer``), the hops it stamps while it serves a pull, and ``get_finished``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import os
import threading
import time
from enum import Enum

from kpool_pd.connector.decode import inbound, peer
from kpool_pd.connector.decode.pull_session import PullSession
from kpool_pd.connector.shared import hops
from kpool_pd.connector.shared.pull_frames import ChunkFrame
from kpool_pd.transfer_params import grant_key
from kpool_pd.vllm import connector as kpool_connector
from kpool_pd.vllm import consumer_worker, step_pulls
from kpool_pd.vllm import loop as kpool_loop
from kpool_pd.vllm import worker as kpool_worker
from kpool_pd.bench.stall_probe import StallProbe
from kpool_pd.bench.vllm_profile import TRACE_ENV

STALLS_ENV = "KPOOLPD_TRACE_STALLS"  # set (to anything): the stall probes run too
_request = contextvars.ContextVar("kpoolpd_trace_request", default="")  # the vLLM request a pull task serves


class Event(Enum):
    SCHEDULE = "schedule"
    QUEUED = "queued"
    MATCHED = "matched"
    ALLOCATED = "allocated"
    META = "meta"
    START_LOAD = "start_load"
    GET_FINISHED = "get_finished"
    PULL = "pull"
    PEER = "peer"
    LAND = "land"
    RELEASE = "release"
    MESSAGE = "message"
    RPC = "rpc"
    HOP = "hop"
    OFFER = "offer"
    STALL = "stall"


class _Sink:
    """Appends events to the trace file, one JSON object a line, from any thread."""

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (open for the process's life)

    def write(self, event: Event, **fields) -> None:
        if self._file is None:
            return
        record = {"t": time.perf_counter(), "pid": os.getpid(), "event": event.value, **fields}
        line = json.dumps(record)
        with self._lock:
            self._file.write(line + "\n")


SINK = _Sink(None)  # opened by ``install`` (an engine's environment is set after its process imported this)


def _around(owner, name: str, event: Event, fields=lambda args, result: {}) -> None:
    """Wraps ``owner.name`` (sync or async): an event at its end with ``begin`` (its start), ``end`` and
    ``fields(args, result)``; an exception is recorded as ``error`` and raised on."""
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapped(*args, **kwargs):
            begin, result, error = time.perf_counter(), None, ""
            try:
                result = await original(*args, **kwargs)
                return result
            except BaseException as exc:
                error = type(exc).__name__
                raise
            finally:
                SINK.write(event, begin=begin, end=time.perf_counter(), error=error,
                           **({"request": _request.get()} | _safe(fields, args, result)))
    else:
        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            begin, result, error = time.perf_counter(), None, ""
            try:
                result = original(*args, **kwargs)
                return result
            except BaseException as exc:
                error = type(exc).__name__
                raise
            finally:
                SINK.write(event, begin=begin, end=time.perf_counter(), error=error,
                           **({"request": _request.get()} | _safe(fields, args, result)))
    setattr(owner, name, wrapped)


def _safe(fields, args, result) -> dict:
    try:
        return fields(args, result) or {}
    except Exception as exc:  # a trace never breaks the engine
        return {"fields_error": repr(exc)}


def _install_step_pulls() -> None:
    """A step's batch (``pull_step``): a ``pull`` event for each of its loads (the batch's begin and end, the
    grant it pulls), and a ``land`` event for each pull of a PackedPull, by grant."""
    original_step = consumer_worker.pull_step

    @functools.wraps(original_step)
    async def pull_step(worker, loads):
        begin = time.perf_counter()
        try:
            return await original_step(worker, loads)
        finally:
            end = time.perf_counter()
            for load in loads:
                SINK.write(Event.PULL, begin=begin, end=end, request=load.request_id,
                           grants=[grant_key(load.params.grant_id, load.digest)])
    consumer_worker.pull_step = pull_step
    original_packed = step_pulls.pull_packed

    @functools.wraps(original_packed)
    async def pull_packed(peer, targets, **kwargs):
        begin = time.perf_counter()
        outcomes = []
        try:
            outcomes = await original_packed(peer, targets, **kwargs)
            return outcomes
        finally:
            end = time.perf_counter()
            SINK.write(Event.RPC, begin=begin, end=end, rpc="PackedPull call", pulls=len(targets))
            for target, outcome in zip(targets, outcomes):
                SINK.write(Event.LAND, begin=begin, end=end, grant=target.grant.grant_id,
                           regions=getattr(outcome, "regions", None), bytes=getattr(outcome, "nbytes", None))
    step_pulls.pull_packed = pull_packed


def _install_pull_context() -> None:
    """The pull task's vLLM request id, for the events of its coroutines (``ConsumerWorker._pull``)."""
    original = kpool_worker.ConsumerWorker._pull

    @functools.wraps(original)
    async def pull(self, load):
        _request.set(load.request_id)
        begin = time.perf_counter()
        try:
            return await original(self, load)
        finally:
            SINK.write(Event.PULL, begin=begin, end=time.perf_counter(), request=load.request_id)
    kpool_worker.ConsumerWorker._pull = pull


class _HopHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        grant_id, hop, when, *_ = record.args  # then the loop's steps, where the loop counts them
        SINK.write(Event.HOP, hop=hop, at=when, grant=grant_id, request=_request.get())


def _install_hops() -> None:
    hops.logger.setLevel(logging.DEBUG)
    hops.logger.propagate = False
    hops.logger.addHandler(_HopHandler(logging.DEBUG))


def _install_schedule() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def fields(args, output):
        scheduler = args[0]
        waiting = sum(1 for r in scheduler.waiting if r.status.name == "WAITING_FOR_REMOTE_KVS")
        return {"tokens": output.total_num_scheduled_tokens, "waiting_remote": waiting,
                "running": len(scheduler.running), "scheduled": sorted(output.num_scheduled_tokens)}
    _around(Scheduler, "schedule", Event.SCHEDULE, fields)


def install() -> None:
    """Wraps the calls, once per process, when ``$KPOOLPD_TRACE`` names a file (else nothing)."""
    global SINK
    if os.environ.get(TRACE_ENV) is None or getattr(install, "done", False):
        return
    install.done = True
    SINK = _Sink(os.environ[TRACE_ENV])
    C = kpool_connector.KpoolPdConnector
    _around(C, "on_new_request", Event.QUEUED, lambda a, r: {"request": a[1].request_id})
    _around(C, "get_num_new_matched_tokens", Event.MATCHED,
            lambda a, r: {"request": a[1].request_id, "tokens": r[0] if r else None})
    _around(C, "update_state_after_alloc", Event.ALLOCATED, lambda a, r: {"request": a[1].request_id,
                                                                           "external": a[3]})
    _around(C, "build_connector_meta", Event.META,
            lambda a, r: {"loads": [x.request_id for x in getattr(r, "loads", ())],
                          "offers": len(getattr(r, "offers", ())), "idle": getattr(r, "idle", None)})
    _around(C, "start_load_kv", Event.START_LOAD)
    _around(C, "get_transfer_results", Event.GET_FINISHED,
            lambda a, r: {"sending": sorted(r.finished_sending), "recving": sorted(r.finished_recving)} if r else {})
    _install_pull_context()
    _install_step_pulls()
    _around(kpool_worker.ConsumerWorker, "peer", Event.PEER)
    _around(peer.PrefillPeer, "_land", Event.LAND, lambda a, r: {"regions": len(r.plan) if r and r.plan else None,
                                                                "bytes": r.plan.total_bytes if r and r.plan else None})
    _around(peer.PrefillPeer, "release_within", Event.RELEASE)
    for name in ("release", "heartbeat"):
        _around(peer.PrefillPeer, name, Event.RPC, lambda a, r, name=name: {"rpc": name})
    _around(inbound.InboundPull, "_read", Event.MESSAGE,
            lambda a, r: {"kind": "eof" if r is None else "chunk" if isinstance(r, ChunkFrame) else
                          r.WhichOneof("message")})
    _around(PullSession, "open", Event.RPC, lambda a, r: {"rpc": "PullSession message"})
    _around(kpool_worker.ProducerWorker, "offer", Event.OFFER,
            lambda a, r: {"offers": len(a[1].offers)})
    _install_hops()
    _install_schedule()
    if os.environ.get(STALLS_ENV):
        _install_stall_probe()


def _install_stall_probe() -> None:
    """The process's stall probes (``kpool_pd.bench.stall_probe``), the loop's on each connector loop made."""
    probe = StallProbe(lambda **fields: SINK.write(Event.STALL, **fields))
    original = kpool_loop.ConnectorLoop.__init__

    @functools.wraps(original)
    def init(self, name):
        original(self, name)
        probe.watch_loop(self.loop)
    kpool_loop.ConnectorLoop.__init__ = init


class KpoolPdConnector(kpool_connector.KpoolPdConnector):
    """KpoolPdConnector, its calls wrapped (``install``) before the first instance is made."""

    def __init__(self, *args, **kwargs) -> None:
        install()
        super().__init__(*args, **kwargs)
