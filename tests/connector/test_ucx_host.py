"""UCX on the configured host (connector.shared.ucx_host): which interfaces a daemon's ``--host`` and its
prefill targets give UCX's NET_DEVICES, and when UCX is left every interface."""

from __future__ import annotations

import sys

import pytest

from kpool_pd.connector.shared.ucx_host import (NET_DEVICES, bind_ucx_options, interface_addresses, net_devices_for_host,
                                target_hosts)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getifaddrs layout of Linux")
LOOPBACK = next((name for name, addresses in interface_addresses().items()
                 if any(a.is_loopback for a in addresses)), None) if sys.platform.startswith("linux") else None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]"])
def test_a_loopback_host_gives_the_loopback_interface(host):
    if host in ("::1", "[::1]") and not any(a.version == 6 and a.is_loopback
                                            for a in interface_addresses().get(LOOPBACK, ())):
        pytest.skip("no IPv6 loopback here")
    assert net_devices_for_host(host) == LOOPBACK
    assert bind_ucx_options((("TLS", "tcp"),), host) == (("TLS", "tcp"), (NET_DEVICES, LOOPBACK))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_host_leaves_ucx_every_interface(host):
    assert net_devices_for_host(host) is None
    assert bind_ucx_options((("TLS", "tcp"),), host) == (("TLS", "tcp"),)


def test_options_that_name_devices_are_kept():
    options = ((NET_DEVICES, "mlx5_0:1"),)
    assert bind_ucx_options(options, "127.0.0.1") == options


def test_an_address_no_interface_owns_leaves_ucx_alone():
    assert net_devices_for_host("192.0.2.254") is None or "192.0.2.254" in {
        str(a) for addresses in interface_addresses().values() for a in addresses}


def test_a_decode_node_adds_the_routes_to_its_prefill_nodes():
    assert bind_ucx_options((), "127.0.0.1", "127.0.0.1:50051") == ((NET_DEVICES, LOOPBACK),)
    assert bind_ucx_options((), "127.0.0.1", "dns:///name.invalid:50051") == ()  # route unknown: every interface


def test_target_hosts():
    assert target_hosts("a:1, dns:///b.svc:2,[::1]:3,") == ["a", "b.svc", "::1"]
