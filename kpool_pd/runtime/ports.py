"""Ports a daemon binds: each one its own, never shared with another process.

gRPC sets SO_REUSEPORT on its listening sockets by default, which on Linux lets a second process
bind a port that a first one serves, and the kernel then splits new connections between them.
``GrpcServer`` turns that off; ``ensure_bindable`` lets a daemon fail at start-up, before its
warm-up, when one of its ports is taken.
"""

from __future__ import annotations

import errno
import socket


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
