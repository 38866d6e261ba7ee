"""A sealed listener (``kpool_pd.model.sealed_listeners``) takes no new connection while the connections it
accepted before keep working, and ``seal_new_listeners`` seals only the listeners opened since its
snapshot."""

from __future__ import annotations

import socket

from kpool_pd.model.sealed_listeners import listening_sockets, seal_new_listeners

CONNECT_S = 1.0


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=CONNECT_S).close()
    except OSError:  # a dropped SYN: the connect times out
        return False
    return True


def test_a_sealed_listener_takes_no_new_connection_and_keeps_the_ones_it_had():
    with _listener() as old:
        before = listening_sockets()
        assert old.fileno() in before.values()
        with _listener() as new:
            held = socket.create_connection(new.getsockname(), timeout=CONNECT_S)
            accepted, _ = new.accept()
            assert seal_new_listeners(before) == 1
            assert not _connects(new.getsockname()[1]), "the sealed listener took a new connection"
            assert _connects(old.getsockname()[1]), "a listener open before the snapshot was sealed too"
            held.sendall(b"12345678")  # the connection accepted before the seal still carries bytes both ways
            assert accepted.recv(8) == b"12345678"
            accepted.sendall(b"ok")
            assert held.recv(2) == b"ok"
            held.close()
            accepted.close()
