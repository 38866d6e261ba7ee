"""The gRPC server of a daemon: the two credentials' checks, TLS, grpc.health.v1, reflection, and an
optional plaintext health port.

Servicers are registered with ``add`` before ``start``; each is an object with a
``service_name`` (the full protobuf name), the ``credential`` its RPCs require (the client token
or the peer token, ``connector.Credential``) and ``add_to_server(server)``. The server requires
that credential on each of the service's RPCs when it was given its token (UNAUTHENTICATED
otherwise, a credential of the other kind included): the client token as a bearer token, the peer
token as a session proved through ``kpoolpd.v1.PeerAuth``, which the server then serves itself
(``connector.CredentialInterceptor``, ``connector.PeerSessions``); reflection takes any credential the
server requires, health and PeerAuth none. A request whose bytes do not parse is answered INVALID_ARGUMENT
(``kpool_pd.runtime.malformed``). Ports are never shared: SO_REUSEPORT is off, so binding a port that
another process serves fails with ``BindError`` naming it. Health is reported for
every added service and for the server as a whole (service ``""``). Whether the daemon serves is
one state, its ``HealthGate`` (``health``: the ``gate`` it is given, the daemon's ``NodeContext.health``): the server keeps no
flag of its own; ``start`` reports what the gate says (NOT_SERVING until the daemon opens it once
warmed up) and the gate reports each change through ``set_serving``; ``stop`` leaves it NOT_SERVING.
``LIVENESS_SERVICE`` is the exception, for liveness and startup probes: SERVING from ``start`` until ``stop``, whatever ``set_serving`` says, so that a node which cannot serve for a while
(a decode node without a usable prefill node, a drain) leaves the rotation without being restarted.
The health port serves the same health servicer alone, in plaintext, for probes that cannot speak
TLS (the kubelet's gRPC probes). ``refuse_new_calls`` starts a drain on the main port: gRPC sends
each client connection a GOAWAY and takes no new call there, while the calls in flight go on and
the health port keeps answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kpool_pd.connector import (MAX_PEER_SESSIONS, Credential, CredentialInterceptor, PeerAuthServicer, PeerSessions, TlsConfig,
                       dial_host)
from kpool_pd.runtime.health_gate import HealthGate
from kpool_pd.runtime.load_report import LoadReportingHealth, NodeLoad
from kpool_pd.runtime.malformed import MalformedRequestInterceptor
from kpool_pd.runtime.ports import bind_error, ensure_bindable

LISTENER_CLOSE_WAIT_S = 2.0  # refuse_new_calls: how long the main port may keep accepting after its shutdown

logger = logging.getLogger(__name__)

LIVENESS_SERVICE = "kpoolpd.liveness"  # the health name that says only: the process serves
NO_SHARED_PORT = (("grpc.so_reuseport", 0),)  # a second process binding our port fails instead of sharing it
# Calls that reached the server and wait for the application to take them (a burst arrives faster than the
# event loop takes calls). gRPC's core cancels some of them with a bare CANCELLED, which the application never
# sees, once more than its soft limit (1,000) wait, and all of them past its hard limit (3,000): a 2,000-call
# burst of Generate ended 8-12% CANCELLED instead of RESOURCE_EXHAUSTED. With both limits at this bound every
# call of a burst of up to this many reaches the service, which answers a full queue RESOURCE_EXHAUSTED.
MAX_PENDING_CALLS = 16384
PENDING_CALLS = (("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                 ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS))


class Servicer(Protocol):
    """A gRPC service implementation as the server registers it."""

    service_name: str  # the full protobuf name, e.g. "kpoolpd.v1.PrefillService"
    credential: Credential  # the token its RPCs require: CLIENT (a public API) or PEER (an internal one)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service's handlers on ``server``."""


class GrpcServer:
    """One daemon's gRPC server. ``start`` once, ``stop`` is idempotent; one event loop.

    ``client_token`` guards the services whose credential is CLIENT, ``peer_token`` those whose
    credential is PEER; None leaves them open (to whoever TLS lets in). The two must differ. A server
    that guards a service with the peer token serves ``kpoolpd.v1.PeerAuth`` too, from ``start``, its
    sessions in ``peer_sessions`` (at most ``max_peer_sessions``, the least recently used forgotten first).
    ``load``: the node's load, attached to every health Check answer (``runtime.load_report``)."""

    def __init__(self, *, client_token: str | None = None, peer_token: str | None = None,
                 tls: TlsConfig | None = None, options: Sequence[tuple[str, Any]] = (),
                 gate: HealthGate | None = None, max_peer_sessions: int = MAX_PEER_SESSIONS,
                 load: Callable[[], NodeLoad] | None = None) -> None:
        for name, token in (("client_token", client_token), ("peer_token", peer_token)):
            if token is not None and (not isinstance(token, str) or not token.strip()):
                raise ValueError(f"{name} must be None (no auth) or a non-empty string")
        if client_token is not None and client_token == peer_token:
            raise ValueError("client_token and peer_token must differ: two credentials, never one")
        if isinstance(max_peer_sessions, bool) or not isinstance(max_peer_sessions, int) or max_peer_sessions < 1:
            raise ValueError(f"max_peer_sessions must be a positive integer, got {max_peer_sessions!r}")
        self.tls = tls
        self._tokens = {Credential.CLIENT: client_token, Credential.PEER: peer_token}
        self._required: dict[str, Credential] = {}  # service -> the credential it requires (its token is set)
        self.peer_sessions = PeerSessions(peer_token, capacity=max_peer_sessions) if peer_token is not None else None
        interceptors = [CredentialInterceptor(self._required, client_token=client_token,
                                              peer_sessions=self.peer_sessions), MalformedRequestInterceptor()]
        self._server = grpc.aio.server(interceptors=interceptors, options=[*options, *NO_SHARED_PORT, *PENDING_CALLS])
        self._health = LoadReportingHealth(load)  # its Check answers carry load() (kpool_pd.runtime.load_report)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._services: list[str] = []
        self.health = gate if gate is not None else HealthGate()  # the one serving state
        self._started = False
        self._stopped = False
        self._probe_server: grpc.aio.Server | None = None
        self._refusing: asyncio.Future | None = None  # the main server's shutdown, once refuse_new_calls began it
        self.port = -1
        self._host = ""
        self.health_port = -1

    @property
    def services(self) -> tuple[str, ...]:
        return tuple(self._services)

    @property
    def auth(self) -> dict[str, str]:
        """Each added service and the token it requires (``"token"``, ``"peer-token"``, or
        ``"none"``), for the ready log line."""
        return {name: self._required[name].value if name in self._required else "none" for name in self._services}

    def add(self, servicer: Servicer) -> None:
        """Register ``servicer`` (before ``start``)."""
        if self._started:
            raise RuntimeError(f"add {servicer.service_name} before start")
        credential = getattr(servicer, "credential", None)
        if not isinstance(credential, Credential):
            raise TypeError(f"{servicer.service_name}: a servicer says which token its RPCs require "
                            f"(credential = Credential.CLIENT or Credential.PEER), got {credential!r}")
        servicer.add_to_server(self._server)
        self._services.append(servicer.service_name)
        if self._tokens[credential] is not None:
            self._required[servicer.service_name] = credential

    async def start(self, host: str, port: int, *, health_port: int = -1) -> int:
        """Bind ``host:port`` (0: a free port) and, when ``health_port >= 0``, the plaintext health
        port; serve; return the bound gRPC port (``self.health_port`` holds the other, or -1).
        BindError naming the port when one is taken (or not this host's)."""
        if self._started:
            raise RuntimeError("GrpcServer.start may be called once")
        self._started = True
        self._host = host
        extra = ()
        if self.peer_sessions is not None and Credential.PEER in self._required.values():
            peer_auth = PeerAuthServicer(self.peer_sessions)
            peer_auth.add_to_server(self._server)
            extra = (peer_auth.service_name,)
        reflection.enable_server_reflection((*self._services, *extra, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self._server)
        address = f"{host}:{port}"
        try:
            self.port = (self._server.add_secure_port(address, self.tls.server_credentials()) if self.tls
                         else self._server.add_insecure_port(address))
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."; a plain bind says why
            ensure_bindable("port", host, port)
            raise bind_error("port", host, port, exc) from None
        await self._server.start()
        if health_port >= 0:
            self._probe_server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()],
                                                 options=list(NO_SHARED_PORT))
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._probe_server)
            try:
                self.health_port = self._probe_server.add_insecure_port(f"{host}:{health_port}")
            except RuntimeError as exc:
                ensure_bindable("health-port", host, health_port)
                raise bind_error("health-port", host, health_port, exc) from None
            await self._probe_server.start()
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._report_health(self.health.serving)
        return self.port

    @property
    def serving(self) -> bool:
        """What the daemon's health gate says (the server holds no state of its own)."""
        return self.health.serving

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING (True) or NOT_SERVING (False) for every service and the server, as the health
        gate decided (``HealthReporter``); a report before ``start`` or after ``stop`` is not written
        (``start`` reports the gate's state). Changes no RPC's behaviour."""
        if not isinstance(serving, bool):
            raise TypeError(f"serving must be a bool, got {serving!r}")
        if self._started and not self._stopped:
            await self._report_health(serving)

    async def _report_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self._services):
            await self._health.set(name, status)

    @property
    def refusing(self) -> bool:
        """Whether ``refuse_new_calls`` began (or ``stop`` ran)."""
        return self._refusing is not None or self._stopped

    async def refuse_new_calls(self, grace: float) -> None:
        """Take no new call on the main port from now on: its listener closes and every client
        connection gets a GOAWAY, so clients open a connection elsewhere (another address of their
        name) for their next calls, and a call that raced it is refused before any handler ran
        (UNAVAILABLE, which gRPC clients may retry). Calls in flight go on for at most ``grace``
        seconds (``stop`` may cut that short). The health port and health statuses stay as they are.
        Idempotent; nothing before ``start``."""
        if not isinstance(grace, (int, float)) or grace < 0:
            raise ValueError(f"grace must be seconds >= 0, got {grace!r}")
        if not self._started or self.refusing:
            return
        self._refusing = asyncio.ensure_future(self._server.stop(grace))
        await asyncio.sleep(0)  # let the shutdown begin: the GOAWAYs go out now
        await self._until_listener_closed(LISTENER_CLOSE_WAIT_S)
        logger.info("gRPC port %d takes no new calls (GOAWAY sent); calls in flight go on", self.port)

    async def _until_listener_closed(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the main port refuses connections. gRPC closes its
        listener a moment after the shutdown began; a connection accepted meanwhile would have its
        calls cancelled (CANCELLED) instead of refused (UNAVAILABLE, which clients retry elsewhere)."""
        host, loop = dial_host(self._host), asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, self.port), left)
            except (OSError, asyncio.TimeoutError):
                return  # refused (or unreachable): no new connection gets in
            writer.close()
            await asyncio.sleep(0.01)
        logger.warning("gRPC port %d still accepted connections %.1f s after its shutdown began", self.port, timeout_s)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then stop both servers (calls in flight get ``grace`` seconds, also
        after ``refuse_new_calls``)."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._refusing is not None:  # ended by the stop above; its outcome is that stop's
            await asyncio.gather(self._refusing, return_exceptions=True)
        if self._probe_server is not None:
            await self._probe_server.stop(None)
