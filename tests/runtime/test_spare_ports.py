"""``spare_ports``: the ports a launcher names before its daemons bind them (the vLLM bench's engines, a
fleet's prefill daemons) come from below the kernel's ephemeral range, free, and distinct."""

from __future__ import annotations

import socket

import pytest

from kpool_pd.runtime import ports


def test_spare_ports_are_distinct_free_and_below_the_ephemeral_range():
    drawn = ports.spare_ports(6)
    assert len(set(drawn)) == 6
    floor = ports._ephemeral_floor()
    assert all(ports.FIRST_NAMED_PORT <= port < floor for port in drawn), (drawn, floor)
    for port in drawn:
        with socket.socket() as sock:
            sock.bind((ports.LOOPBACK, port))  # raises when another process holds it


@pytest.fixture
def taken():
    """A port that a listening socket holds while the test runs."""
    with socket.socket() as held:
        held.bind((ports.LOOPBACK, 0))
        held.listen(1)
        yield held.getsockname()[1]


def test_a_held_port_is_never_drawn(monkeypatch, taken):
    checked = []
    real_bindable = ports._bindable

    def bindable(host: str, port: int) -> bool:  # the held port checked for real; its neighbour taken as free,
        checked.append(port)                      # since any process's connection may hold it for a moment
        return real_bindable(host, port) if port == taken else True
    monkeypatch.setattr(ports, "_bindable", bindable)
    monkeypatch.setattr(ports, "_ephemeral_floor", lambda: taken + 1)
    monkeypatch.setattr(ports, "FIRST_NAMED_PORT", taken - 1)
    for _ in range(20):  # two candidates, one of them held
        assert ports.spare_ports(1) == [taken - 1]
    assert taken in checked, checked


def test_no_free_port_is_a_bind_error_naming_the_range(monkeypatch, taken):
    monkeypatch.setattr(ports, "_ephemeral_floor", lambda: taken + 1)
    monkeypatch.setattr(ports, "FIRST_NAMED_PORT", taken)  # the one candidate is held
    with pytest.raises(ports.BindError, match=f"no 1 free ports between {taken} and {taken + 1}"):
        ports.spare_ports(1)


def test_a_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        ports.spare_ports(0)
