"""One parsing of ``--transports`` and ``--transport`` for both daemons: auto with and without
UCX, explicit lists, a pull transport that is added to what a node offers, and bad names."""

from __future__ import annotations

import pytest

from kpool_pd.connector import Transport
from kpool_pd.prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
from kpool_pd.runtime import SettingsError, Transports, load_settings, parse_pull, parse_transports, transports_of

UCX, GRPC = Transport.UCX, Transport.GRPC_STREAM


@pytest.mark.parametrize("text,ucx,want", [
    pytest.param("auto", True, (UCX, GRPC), id="auto-with-ucx"),
    pytest.param("auto", False, (GRPC,), id="auto-without-ucx"),
    pytest.param(" auto ", False, (GRPC,), id="auto-spaced"),
    pytest.param("grpc", False, (GRPC,), id="grpc"),
    pytest.param("grpc_stream", False, (GRPC,), id="grpc-stream-alias"),
    pytest.param("ucx", True, (UCX,), id="ucx"),
    pytest.param("grpc,ucx", True, (GRPC, UCX), id="order-kept"),
    pytest.param(" ucx , grpc ,", True, (UCX, GRPC), id="spaces-and-trailing-comma"),
    pytest.param("grpc,grpc", False, (GRPC,), id="each-once"),
])
def test_transports_parse(text, ucx, want):
    assert parse_transports(text, ucx=ucx) == want


@pytest.mark.parametrize("text,needle", [
    pytest.param("tcp", "'tcp'", id="unknown"),
    pytest.param("grpc,rdma", "'rdma'", id="unknown-in-list"),
    pytest.param("", "''", id="empty"),
    pytest.param(" , ", "' , '", id="only-commas"),
    pytest.param("Auto", "'Auto'", id="case-matters"),
])
def test_a_bad_transport_list_names_what_is_wrong(text, needle):
    with pytest.raises(ValueError) as info:
        parse_transports(text, ucx=True)
    assert needle in str(info.value)


@pytest.mark.parametrize("text", ["ucx", "grpc,ucx"])
def test_ucx_without_ucxx_is_refused(text):
    with pytest.raises(ValueError, match="ucxx cannot be imported here"):
        parse_transports(text, ucx=False)


def test_pull_choice():
    assert parse_pull("auto") is None
    assert parse_pull("ucx") is UCX and parse_pull("grpc") is GRPC
    with pytest.raises(ValueError, match="'tcp'"):
        parse_pull("tcp")


@pytest.mark.parametrize("settings,ucx,want", [
    pytest.param({"transports": "auto"}, True, Transports(offered=(UCX, GRPC)), id="prefill-auto"),
    pytest.param({"transports": "grpc"}, True, Transports(offered=(GRPC,)), id="prefill-grpc"),
    pytest.param({"transports": "auto", "transport": "auto"}, False, Transports(offered=(GRPC,)), id="decode-auto"),
    pytest.param({"transports": "auto", "transport": "grpc"}, True, Transports(offered=(UCX, GRPC), pull=GRPC),
                 id="decode-pulls-grpc"),
    pytest.param({"transports": "grpc", "transport": "ucx"}, True, Transports(offered=(GRPC, UCX), pull=UCX),
                 id="pull-transport-is-added"),
    pytest.param({"transports": "ucx", "transport": "grpc"}, True, Transports(offered=(UCX, GRPC), pull=GRPC),
                 id="grpc-pull-is-added"),
])
def test_a_nodes_transports_from_its_settings(settings, ucx, want):
    assert transports_of(settings, ucx=ucx) == want


@pytest.mark.parametrize("settings,needle", [
    pytest.param({"transports": "ucx"}, "transports ucx: transport ucx asked for", id="offered"),
    pytest.param({"transports": "grpc", "transport": "ucx"}, "transport ucx: transport ucx asked for", id="pulled"),
])
def test_ucx_asked_for_without_ucxx_is_a_settings_error_naming_the_option(settings, needle):
    with pytest.raises(SettingsError) as info:
        transports_of(settings, ucx=False)
    assert needle in str(info.value)


def test_a_node_offers_what_it_pulls():
    with pytest.raises(ValueError, match="pull transport ucx is not among those offered"):
        Transports(offered=(GRPC,), pull=UCX)
    with pytest.raises(ValueError, match="at least one transport"):
        Transports(offered=())


def test_a_bad_transport_name_fails_when_settings_load():
    with pytest.raises(SettingsError, match="transports from KPOOLPD_TRANSPORTS: .*'tcp'"):
        load_settings("prefill", PREFILL_OPTIONS, [], env={"KPOOLPD_TRANSPORTS": "grpc,tcp"})
    assert load_settings("prefill", PREFILL_OPTIONS, ["--transports", " ucx,grpc "], env={})["transports"] == "ucx,grpc"
