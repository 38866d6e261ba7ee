"""Running a daemon, the same for both roles: ``run_daemon`` is the process entry (settings,
TLS, device, transports, logging, the event loop), ``serve`` the life of its node:

1. ``spec.build`` makes the node (cache, model, connector side); ``node.warm_up`` runs in a
   worker thread (``warmed up in N ms``).
2. ``node.start``; the gRPC server binds (and the plaintext health port); ``/metrics`` binds;
   grpc.health.v1 turns SERVING (while the node can serve: ``NodeContext.health``); the ready
   file is written; ``<role> node ready`` is logged. Until then health is NOT_SERVING and there
   is no ready file.
   Between ``node.start`` and the server, ``kpool_pd.runtime.fabric_check`` logs the data plane's UCX
   transports and devices, and holds health NOT_SERVING for good when ``--fabric`` needs what
   this process lacks.
3. SIGTERM or SIGINT drains. A node serving a public API (its servicer's credential is CLIENT:
   the decode node's Generate API) first stops taking new calls on its gRPC port, which sends
   every client connection a GOAWAY, so clients send new requests to another pod at once while
   the calls in flight go on; a node serving peers (the prefill node) keeps taking calls, since
   decode nodes still pull and release the grants it gave. Then ``node.drain`` (new work is
   refused), health turns NOT_SERVING (the health port keeps answering), and the runtime waits
   until ``node.idle`` or for ``drain-s`` (then it warns with ``node.leftover``).
4. The server stops (calls in flight get one second), ``node.close`` frees everything, the
   metrics endpoint closes, and ``<role> node stopped; free: ...`` reports the allocators.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import Credential, TlsConfig, Transport
from kpool_pd.runtime.device import resolve_device
from kpool_pd.runtime.fabric_check import FABRIC_OPTIONS, Fabric, fabric_report, log_report
from kpool_pd.runtime.geometry import GeometryError, check_kernel_page_on, check_serving_geometry
from kpool_pd.runtime.grpc_server import GrpcServer
from kpool_pd.runtime.health_gate import HealthGate
from kpool_pd.runtime.logs import configure_logging
from kpool_pd.runtime.metrics import MetricsEndpoint, watch_cache
from kpool_pd.runtime.model_options import MODEL_KEYS, model_config
from kpool_pd.runtime.node import LOOPBACK, DaemonSpec, Node, NodeContext, default_engine_id
from kpool_pd.runtime.options import Option, SettingsError
from kpool_pd.runtime.ports import BindError, bind_error, ensure_bindable
from kpool_pd.runtime.process import arm_parent_death_signal, keep_event_loop_responsive, termination_event, write_ready_file
from kpool_pd.runtime.service_options import check_credentials
from kpool_pd.runtime.preflight import check_ready_file
from kpool_pd.runtime.settings import load_settings, one_line, source_of
from kpool_pd.runtime.tls import tls_config
from kpool_pd.runtime.transports import Transports, transports_of

logger = logging.getLogger(__name__)
STOP_GRACE_S = 1.0  # what RPCs in flight get once the drain is over
DRAIN_POLL_S = 0.05


def daemon_options(spec: DaemonSpec) -> tuple[Option, ...]:
    """The options ``run_daemon`` parses for ``spec``: its table plus the runtime's own start-up
    checks (``--fabric``), unless the table has them already."""
    known = {option.name for option in spec.options}
    return (*spec.options, *(option for option in FABRIC_OPTIONS if option.name not in known))


def serves_clients(node: Node) -> bool:
    """Whether the node's service is a public API (CLIENT credential): its clients need nothing new
    from a draining node, so it stops taking calls (GOAWAY) when the drain starts."""
    return getattr(node.servicer, "credential", None) is Credential.CLIENT


async def drain(node: Node, health: HealthGate, drain_s: float, server: GrpcServer | None = None) -> None:
    """Refuse new work, report NOT_SERVING, then wait until the node is idle or ``drain_s`` is up.
    With ``server``, a node serving a public API first stops taking new calls there (GOAWAY), so
    clients move to another pod; its calls in flight go on."""
    if server is not None and serves_clients(node):
        await server.refuse_new_calls(drain_s + STOP_GRACE_S)
    node.drain()
    await health.drain()
    deadline = time.monotonic() + drain_s
    while not node.idle and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    leftover = node.leftover()
    if leftover:
        logger.warning("drain time is up with %s", leftover)


async def serve(spec: DaemonSpec, settings: Mapping[str, Any], *, device: torch.device, tls: TlsConfig | None,
                transports: Transports) -> str:
    """Run the node of ``spec`` until SIGTERM or SIGINT, then drain and stop (steps 1 to 4 of
    the module's docstring). Returns once everything is closed: the node's ``failure`` (why it stopped
    by itself, empty when it did not); what ``build`` or a start step raises propagates after the cleanup."""
    role = spec.role
    registry = CollectorRegistry()
    context = NodeContext(role=role, settings=settings, device=device, tls=tls, transports=transports,
                          registry=registry, engine_id=settings["engine_id"] or default_engine_id(role))
    node = spec.build(context)
    watch_cache(registry, role.value, node.cache)
    server: GrpcServer | None = None
    metrics = MetricsEndpoint(registry)
    switch_interval = keep_event_loop_responsive()
    try:
        started = time.perf_counter()
        await asyncio.to_thread(node.warm_up)
        logger.info("warmed up in %.0f ms", (time.perf_counter() - started) * 1000)
        stop = termination_event()
        await node.start()
        fabric = fabric_report(settings.get("fabric", Fabric.ANY), ucx=Transport.UCX in transports.offered,
                               device_type=device.type)
        log_report(fabric)
        for problem in fabric.problems:
            context.health.hold(problem)
        # The gRPC server (and its threads) comes after node.start, which may initialise UCX: UCX
        # patches the process's memory functions while it initialises, which is unsafe while
        # other threads may be calling them.
        connector_config = context.connector_config
        local = spec.loopback_only
        server = GrpcServer(client_token=settings["token"] or None, peer_token=connector_config.peer_token,
                            tls=None if local else tls, options=connector_config.grpc_options(), gate=context.health,
                            load=getattr(node, "load", None))
        server.add(node.servicer)
        grpc_port = await server.start(LOOPBACK if local else settings["host"], settings["port"],
                                       health_port=-1 if local else settings["health_port"])
        try:
            metrics_port = metrics.start(settings["metrics_host"], settings["metrics_port"])
        except OSError as exc:
            raise bind_error("metrics-port", settings["metrics_host"], settings["metrics_port"], exc) from None
        await context.health.open(server)  # SERVING, unless the node says it cannot serve yet
        write_ready_file(settings["ready_file"], grpc_port=grpc_port, metrics_port=metrics_port,
                         health_port=server.health_port, engine_id=context.engine_id)
        logger.info("%s node ready", role.value,
                    extra={"grpc_port": grpc_port, "metrics_port": metrics_port, "health_port": server.health_port,
                           "tls": tls is not None, "auth": server.auth, "device": str(device),
                           "serving": context.health.serving, **fabric.log_fields(), **node.describe()})
        await stop.wait()
        await drain(node, context.health, settings["drain_s"], server)
    finally:
        if server is not None:
            await server.stop(STOP_GRACE_S)
        await node.close()
        metrics.close()
        sys.setswitchinterval(switch_interval)
    cache = node.cache
    logger.info("%s node stopped; free: %d of %d blocks, %d of %d rings", role.value, cache.free_blocks,
                cache.num_blocks, cache.free_rings, cache.num_rings)
    return getattr(node, "failure", "")


def _refuse_geometry(settings: Mapping[str, Any], check: Callable[..., None], *args: Any) -> None:
    """``check(*args)`` (``kpool_pd.runtime.geometry``); its ``GeometryError`` as a ``SettingsError`` that names
    the options the rule concerns and where their values came from."""
    try:
        check(*args)
    except GeometryError as exc:
        names = " and ".join(f"{key.replace('_', '-')} from {source_of(settings, key)}" for key in exc.options)
        raise SettingsError(f"{names}: {exc}") from None


def run_daemon(spec: DaemonSpec, argv: Sequence[str] | None = None) -> int:
    """Parse the settings (flags > env > YAML; ``argv`` None: ``sys.argv[1:]``), then serve until
    SIGTERM and drain.

    A bad setting (a value, a model the options do not make, credentials that cannot work, a TLS file, a device or a transport that
    cannot be used here, a port another process holds, a ready file's folder that is missing, a cache larger than the
    memory free; ``kpool_pd.runtime.preflight``) prints one line ``kpool-pd <role>: error: <option>
    ...`` to stderr and returns 2 before anything starts. A port taken between that check and the
    bind stops the daemon after its warm-up, with the same line logged and status 2. After
    serving, the process exits at once (status 0; 1 when the node stopped because it broke: its
    ``failure``), skipping interpreter teardown of the UCX
    worker, whose peers may be gone.
    """
    role = spec.role.value
    try:
        try:  # before anything else: a launcher that dies now still takes this daemon with it
            arm_parent_death_signal()
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        settings = load_settings(spec.role, daemon_options(spec), argv, description=spec.description)
        check_credentials(spec.role, settings)
        cache = None
        if MODEL_KEYS <= settings.keys():
            try:  # a combination the model refuses (kpool and block size, layers, drafts)
                cache = model_config(settings).cache
            except ValueError as exc:
                raise SettingsError(f"model: {exc}") from None
            _refuse_geometry(settings, check_serving_geometry, cache)
        if spec.check is not None:
            try:
                spec.check(settings)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        check_ready_file(settings)
        tls = tls_config(settings)
        device = resolve_device(settings["device"])
        if cache is not None:
            _refuse_geometry(settings, check_kernel_page_on, cache, device)
        transports = transports_of(settings)
        for option, host in (("port", "host"), ("health-port", "host"), ("metrics-port", "metrics_host")):
            ensure_bindable(option, settings[host], settings[option.replace("-", "_")])
    except (SettingsError, BindError) as exc:
        print(f"kpool-pd {role}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    configure_logging(role, level=settings["log_level"], fmt=settings["log_format"])
    torch.set_num_threads(settings["torch_threads"])
    if device.type == "cuda":  # what the event loop's thread launches (a repack, a copy) runs there too
        torch.cuda.set_device(device)
    status = 0
    try:
        failure = asyncio.run(serve(spec, settings, device=device, tls=tls, transports=transports))
    except BindError as exc:
        logger.error("kpool-pd %s: error: %s", role, exc)
        status = 2
    else:
        if failure:
            logger.error("kpool-pd %s: stopped because it broke: %s", role, failure)
            status = 1
    logging.shutdown()
    os._exit(status)
