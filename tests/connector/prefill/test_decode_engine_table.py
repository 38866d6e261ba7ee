"""The prefill node's one record per decode engine (connector.prefill.decode_engines): a Handshake's
record replaces the earlier one whole, forgetting an engine closes its UCX link (its endpoints), and
silence is measured per record."""

from __future__ import annotations

import grpc
import pytest

from kpool_pd.connector.prefill.decode_engines import (FORGET_AFTER_FAILED_SEND_LEASES, FORGET_AFTER_LEASES, DecodeEngine,
                                              DecodeEngineTable, new_secret)
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.prefill.ucx_link import UcxLink
from kpool_pd.connector.shared.wire import Transport

UCX, GRPC = Transport.UCX, Transport.GRPC_STREAM
SECRET = b"s" * 32  # one engine's secret


class Endpoint:
    """Stands in for a ucxx endpoint: records its abort."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self, period: int = 0) -> None:
        self.aborted = True


def link_to(engine_id: str, address: bytes, endpoints: int = 1) -> tuple[UcxLink, list[Endpoint]]:
    link = UcxLink(node=None, engine_id=engine_id, address=address)
    made = [Endpoint() for _ in range(endpoints)]
    link._endpoints, link._idle = list(made), list(made)
    return link, made


def test_a_handshake_replaces_the_record_whole_and_closes_the_old_link():
    table = DecodeEngineTable(lease_s=1.0)
    old, old_eps = link_to("d", b"addr-1", endpoints=2)
    table.admit(DecodeEngine("d", frozenset({UCX, GRPC}), old, SECRET, heard_at=5.0))
    new, new_eps = link_to("d", b"addr-2")
    table.admit(DecodeEngine("d", frozenset({UCX}), new, SECRET, heard_at=7.0))
    record = table.get("d")
    assert record.transports == {UCX} and record.ucx_address == b"addr-2" and record.heard_at == 7.0
    assert old.closed and all(ep.aborted for ep in old_eps) and old.endpoints == ()
    assert not new.closed and not any(ep.aborted for ep in new_eps)
    assert table.ids() == ("d",) and len(table) == 1


def test_a_rehandshake_that_keeps_the_link_keeps_its_endpoints():
    table = DecodeEngineTable(lease_s=1.0)
    link, eps = link_to("d", b"addr")
    table.admit(DecodeEngine("d", frozenset({UCX}), link, SECRET))
    table.admit(DecodeEngine("d", frozenset({UCX, GRPC}), link, SECRET))
    assert table.get("d").transports == {UCX, GRPC} and not link.closed and not eps[0].aborted


def test_forgetting_an_engine_drops_its_record_and_its_endpoints():
    table = DecodeEngineTable(lease_s=1.0)
    link, eps = link_to("d", b"addr", endpoints=3)
    table.admit(DecodeEngine("d", frozenset({UCX}), link, SECRET))
    assert table.forget("d", "test") is True
    assert "d" not in table and table.get("d") is None and link.closed and all(ep.aborted for ep in eps)
    assert table.forget("d", "again") is False  # idempotent
    assert not DecodeEngine("e", frozenset({UCX}), link, SECRET).reaches_over(UCX)  # a closed link reaches nobody


def test_silence_is_measured_per_engine_and_a_failed_send_shortens_it():
    table = DecodeEngineTable(lease_s=2.0)
    quiet, _ = link_to("quiet", b"q")
    failed, _ = link_to("failed", b"f")
    table.admit(DecodeEngine("quiet", frozenset({UCX}), quiet, SECRET, heard_at=0.0))
    table.admit(DecodeEngine("failed", frozenset({UCX}), failed, SECRET, heard_at=0.0))
    table.admit(DecodeEngine("grpc", frozenset({GRPC}), None, SECRET, heard_at=0.0))
    failed.send_failed_at = 0.5
    assert table.forget_silent(now=FORGET_AFTER_FAILED_SEND_LEASES * 2.0 - 0.1) == []
    assert table.forget_silent(now=FORGET_AFTER_FAILED_SEND_LEASES * 2.0) == ["failed"] and failed.closed
    table.heard_from("grpc", now=FORGET_AFTER_LEASES * 2.0 - 1.0)
    assert table.forget_silent(now=FORGET_AFTER_LEASES * 2.0) == ["quiet"] and "grpc" in table


def test_a_ucx_record_needs_its_link():
    with pytest.raises(ValueError, match="offered UCX"):
        DecodeEngine("d", frozenset({UCX}), None, SECRET)


def test_an_engine_id_is_held_by_its_secret():
    table = DecodeEngineTable(lease_s=1.0)
    link, eps = link_to("d", b"addr")
    assert len(table.secret_for("d", b"")) == 32  # an id nobody holds: a fresh secret when none is presented,
    assert table.secret_for("d", SECRET) == SECRET  # the claimant's own when it presents one (a lost reply's retry)
    assert len(table.secret_for("d", b"short")) == 32 and table.secret_for("d", b"short") != b"short"
    table.admit(DecodeEngine("d", frozenset({UCX}), link, SECRET))
    assert table.authenticate("d", SECRET, "Pull") is table.get("d")
    assert table.secret_for("d", SECRET) == SECRET  # a re-handshake keeps it
    for presented in (b"", b"t" * 32, SECRET[:-1]):
        with pytest.raises(StatusError) as err:
            table.authenticate("d", presented, "Pull")
        assert err.value.code is grpc.StatusCode.PERMISSION_DENIED and "engine secret" in err.value.message
        with pytest.raises(StatusError) as err:
            table.secret_for("d", presented)
        assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
    other, other_eps = link_to("d", b"attacker")
    with pytest.raises(StatusError) as err:  # a claim that raced past the first check is refused on admission
        table.admit(DecodeEngine("d", frozenset({UCX}), other, new_secret()))
    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert table.get("d").link is link and not link.closed and not eps[0].aborted
    with pytest.raises(StatusError) as err:
        table.authenticate("never", SECRET, "Prefill")
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    table.forget("d", "test")
    assert table.secret_for("d", SECRET) == SECRET  # a forgotten id is claimable again (its engine's own comes back)
