"""UCX on the configured host only: the network interfaces that own a daemon's ``--host`` address
become UCX's ``NET_DEVICES``, so that UCX's tcp transport listens there and nowhere else.

UCX's tcp transport opens a listening socket on every interface it may use (``UCX_NET_DEVICES``,
default all), whatever address the gRPC server binds. A daemon given a specific host (127.0.0.1, a
pod IP) therefore restricts UCX to the interface that owns it, plus, on a decode node (whose host is
its Generate API's, while prefill nodes must reach its UCX worker), the interfaces its routes to its
prefill nodes leave by. A wildcard host (0.0.0.0, ::) leaves UCX alone, and so does a prefill target
that does not resolve yet (the route is not known). ``NET_DEVICES`` also names RDMA devices: where
UCX must use an HCA, or a data network other than the host's, the operator sets ``UCX_NET_DEVICES``
(``mlx5_0:1,eth1``), which wins over this option.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence

from kpool_pd.connector.shared.hosts import WILDCARD_HOSTS

logger = logging.getLogger(__name__)

NET_DEVICES = "NET_DEVICES"


class _SockAddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)), ("ifa_name", ctypes.c_char_p), ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_SockAddr)), ("ifa_netmask", ctypes.POINTER(_SockAddr)),
    ("ifa_ifu", ctypes.POINTER(_SockAddr)), ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Every local network interface and the IPv4 and IPv6 addresses it owns (``getifaddrs``,
    Linux layout). OSError when the C library cannot list them."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs failed: {os.strerror(errno)}")
    found: dict[str, set] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = entry.ifa_name.decode(errors="replace")
            found.setdefault(name, set())
            if entry.ifa_addr:
                family = entry.ifa_addr.contents.sa_family
                raw = ctypes.string_at(entry.ifa_addr, 28 if family == socket.AF_INET6 else 16)
                if family == socket.AF_INET:
                    found[name].add(ipaddress.IPv4Address(raw[4:8]))
                elif family == socket.AF_INET6:
                    found[name].add(ipaddress.IPv6Address(raw[8:24]))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def host_addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses ``host`` stands for (itself when it is one, else what it resolves to)."""
    host = host.strip().strip("[]")
    try:
        return {ipaddress.ip_address(host.split("%")[0])}
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


def source_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The local address the kernel would send from to reach ``host`` (its route; no packet is
    sent). OSError when ``host`` does not resolve or no route leads there."""
    target = next(iter(sorted(host_addresses(host), key=lambda a: a.version)))
    family = socket.AF_INET if target.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((str(target), 9))
        return ipaddress.ip_address(probe.getsockname()[0].split("%")[0])


def target_hosts(targets: str) -> list[str]:
    """The hosts of comma-separated ``host:port`` / ``dns:///name:port`` targets (``--prefill``)."""
    hosts = []
    for target in (t.strip() for t in targets.split(",")):
        host = target.removeprefix("dns:///").rpartition(":")[0].strip("[]")
        if host:
            hosts.append(host)
    return hosts


def net_devices_for_host(host: str, reach: Sequence[str] = ()) -> str | None:
    """The comma-separated names of the interfaces that own ``host``'s addresses, and of those that
    the routes to the hosts in ``reach`` leave by, for UCX's ``NET_DEVICES``. None for a wildcard
    host, or (with a warning) when a host does not resolve, has no route, or no local interface owns
    the address."""
    if host.strip() in WILDCARD_HOSTS:
        return None
    try:
        wanted = host_addresses(host) | {source_address(peer) for peer in reach}
        owners = sorted(name for name, addresses in interface_addresses().items() if addresses & wanted)
    except OSError as exc:
        logger.warning("cannot tell which interfaces host %s%s needs (%s); UCX may use every interface", host,
                       f" and its peers {list(reach)}" if reach else "", exc)
        return None
    if not owners:
        logger.warning("no local interface owns host %s (%s); UCX may use every interface", host,
                       ", ".join(sorted(map(str, wanted))))
        return None
    return ",".join(owners)


def bind_ucx_options(options: Sequence[tuple[str, str]], host: str, reach: str = "") -> tuple[tuple[str, str], ...]:
    """``options`` plus ``NET_DEVICES`` for the interfaces of ``host`` and of the routes to the
    targets in ``reach`` (comma-separated ``host:port`` or ``dns:///name:port``: a decode node's
    prefill nodes), see ``net_devices_for_host``; unchanged when the options already set it, the
    host is a wildcard or an interface cannot be told. An operator's ``UCX_NET_DEVICES`` still wins
    when UCX starts (environment variables take precedence over the options)."""
    options = tuple(options)
    if any(key == NET_DEVICES for key, _ in options):
        return options
    devices = net_devices_for_host(host, target_hosts(reach))
    return options if devices is None else (*options, (NET_DEVICES, devices))
