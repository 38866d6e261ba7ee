"""Sealing a process's TCP listeners: no new connection reaches them, and whoever holds them keeps
its sockets (and every connection it accepted) as they are.

gloo opens a listener for the ranks of a group to connect to each other, and keeps every accepted
connection that sends it 8 bytes (a sequence number it has no use for) until the process runs out
of fds, when it aborts. Once the group has joined, its listener has nothing left to accept, yet gloo
offers no way to close it. A socket filter that keeps no byte of any packet, attached to the
listening socket, drops every later SYN before TCP sees it: a stray connection never opens, the
peer's connect times out, and the listener, untouched, is closed as usual when the group is torn
down. Connections accepted before are not affected (a child socket takes its listener's filter
when it is created, not later). Linux only (``SO_ATTACH_FILTER``, ``/proc/self``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux's value; Python names it from 3.12 on some builds
# one classic BPF instruction, BPF_RET | BPF_K with k = 0: keep 0 bytes of the packet, i.e. drop it
DROP_EVERY_PACKET = struct.pack("HBBI", 0x06, 0, 0, 0)
TCP_LISTEN = "0A"  # the LISTEN state as /proc/net/tcp writes it
SOCKET_LINK = "socket:["


def listening_sockets() -> dict[str, int]:
    """Every TCP socket of this process in the LISTEN state: its inode -> one fd that holds it."""
    held = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith(SOCKET_LINK):
            held[link[len(SOCKET_LINK):-1]] = int(name)
    found = {}
    for table in ("tcp", "tcp6"):
        path = Path("/proc/self/net") / table
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == TCP_LISTEN and fields[9] in held:
                found[fields[9]] = held[fields[9]]
    return found


def seal(fd: int) -> None:
    """Drop every packet that reaches the listening socket ``fd`` from now on (OSError if it cannot)."""
    program = ctypes.create_string_buffer(DROP_EVERY_PACKET, len(DROP_EVERY_PACKET))
    fprog = struct.pack("@HP", 1, ctypes.addressof(program))  # struct sock_fprog {len; filter*}
    with socket.socket(fileno=os.dup(fd)) as sock:  # the same socket: closing the copy leaves it open
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def seal_new_listeners(before: dict[str, int]) -> int:
    """Seal every listener this process holds that is not in ``before`` (``listening_sockets()`` taken
    earlier); how many were sealed."""
    new = {inode: fd for inode, fd in listening_sockets().items() if inode not in before}
    for fd in new.values():
        seal(fd)
    return len(new)
