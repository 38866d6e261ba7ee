"""Ports a daemon binds: each one its own, never shared with another process.

gRPC sets SO_REUSEPORT on its listening sockets by default, which on Linux lets a second process
bind a port that a first one serves, and the kernel then splits new connections between them.
``GrpcServer`` turns that off; ``ensure_bindable`` lets a daemon fail at start-up, before its
warm-up, when one of its ports is taken.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_NAMED_PORT = 10000  # where ports handed out for naming start (above the well-known services)


class BindError(OSError):
    """A port that cannot be bound (in use, or an address that is not this host's); the message
    names the option, the address and the port."""


def ensure_bindable(option: str, host: str, port: int) -> None:
    """Bind and close a listening socket on every address ``host`` names at ``port``; BindError
    naming ``option`` when one fails. Port 0 (any) and below (off) are not checked. Best effort:
    another process may take the port between this check and the real bind (which then fails
    with BindError too)."""
    if port <= 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"{option}: cannot resolve host {host!r} to bind port {port}: {exc}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
                sock.listen(1)
            except OSError as exc:
                raise bind_error(option, host, port, exc) from None


def bind_error(option: str, host: str, port: int, cause: BaseException | str) -> BindError:
    """The BindError of ``option`` at ``host:port``, saying why."""
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    in_use = isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE
    what = "is in use by another process" if in_use else f"cannot be bound ({reason})"
    return BindError(f"{option}: port {port} on {host or '*'} {what}")


def _ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range (32768 where Linux does not say otherwise)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def spare_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``host`` now, for a launcher that must name a daemon's port before the
    daemon binds it. They are drawn at random below the kernel's ephemeral range: a port handed out by a
    ``bind(0)`` and closed again is the very kind that the next ``bind(0)`` or outgoing connection of any
    process takes, while a named port below that range is taken only by another launcher drawing the same
    one (ValueError for ``count`` < 1, BindError when no free port turns up)."""
    if count < 1:
        raise ValueError(f"spare_ports needs a count of at least 1, got {count}")
    floor = _ephemeral_floor()
    draw = random.SystemRandom()
    ports: list[int] = []
    for _ in range(64 * count):
        port = draw.randrange(FIRST_NAMED_PORT, floor)
        if port not in ports and _bindable(host, port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise BindError(f"no {count} free ports between {FIRST_NAMED_PORT} and {floor} on {host}")


def _bindable(host: str, port: int) -> bool:
    """Whether a listening socket binds ``host:port`` now."""
    try:
        ensure_bindable("port", host, port)
    except BindError:
        return False
    return True
