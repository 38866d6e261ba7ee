"""The address a local client dials for a daemon's bind host (``kpool_pd.connector.shared.hosts``)."""

from __future__ import annotations

import pytest

from kpool_pd.connector.shared.hosts import dial_host, dial_target


@pytest.mark.parametrize(("bind_host", "host", "target"), [
    ("0.0.0.0", "127.0.0.1", "127.0.0.1:7"), ("::", "127.0.0.1", "127.0.0.1:7"), ("", "127.0.0.1", "127.0.0.1:7"),
    (" [::] ", "127.0.0.1", "127.0.0.1:7"), ("10.1.2.3", "10.1.2.3", "10.1.2.3:7"), ("[::1]", "::1", "[::1]:7"),
    ("::1", "::1", "[::1]:7"), ("node-a.svc", "node-a.svc", "node-a.svc:7"),
])
def test_a_local_client_dials_loopback_for_a_wildcard_and_the_host_otherwise(bind_host, host, target):
    assert dial_host(bind_host) == host
    assert dial_target(bind_host, 7) == target
