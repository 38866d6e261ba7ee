"""The options every daemon has: where it listens, auth, logs, threads, drain, readiness file,
connector deadlines, transports, device and UCX's progress mode. A daemon's table is these, the TLS options, the
model options and its own.

Auth is two credentials, never one (DESIGN section 5):

- ``token``, the client credential: a decode daemon requires it on its public Generate API. A
  prefill daemon serves no client API, so it has no use for it: given without ``peer-token`` it
  stops the daemon (status 2), since an operator who gives a prefill node only ``token`` expects
  it to guard something; given with ``peer-token`` it is unused (one YAML file's top-level keys
  apply to both roles).
- ``peer-token``, the peer credential: a prefill daemon requires it on every PrefillService RPC
  (health and reflection excepted, as for ``token``); a decode daemon sends it on every call to
  its prefill nodes. With mTLS (``tls-require-client-auth``) a prefill daemon may go without it:
  then every certificate ``tls-ca`` signed is a peer, clients' certificates included.

The two must differ. Empty means none: the service is open to whoever reaches it (and TLS lets in).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kpool_pd.runtime.device import device_name
from kpool_pd.runtime.logs import LEVELS, LogFormat, log_level
from kpool_pd.connector import MAX_ID_CHARS, ConnectorConfig, UcxProgress
from kpool_pd.runtime.options import Option, Role, SettingsError, int_in, one_of, parse_port, seconds, text_value
from kpool_pd.runtime.transports import transport_list

_CONNECTOR = ConnectorConfig()  # the connector's defaults, read from their one owner


def bearer_token(text: Any) -> str:
    """A bearer token: empty (none), or printable ASCII without spaces (what gRPC metadata carries
    and ``Bearer <token>`` can hold). The error never repeats the value: it is a secret."""
    value = str(text)
    if value and not all("!" <= c <= "~" for c in value):
        raise ValueError(f"a token must be printable ASCII without spaces (got {len(value)} characters, "
                         "some of them not); the value is not shown")
    return value


THREADS_PER_CPU = 4  # torch-threads at most this many per CPU of the machine (far more crashes torch)


def thread_count(text: Any) -> int:
    """Parser of ``--torch-threads``: 1 to ``THREADS_PER_CPU`` x the machine's CPUs."""
    return int_in(1, THREADS_PER_CPU * (os.cpu_count() or 1))(text)


def engine_id(text: Any) -> str:
    """Parser of ``--engine-id``: empty (the default id) or at most ``connector.MAX_ID_CHARS``
    printable characters, the longest id a prefill node accepts."""
    value = text_value(text)
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"an engine id is at most {MAX_ID_CHARS} characters (what a prefill node accepts), "
                         f"got {len(value)}")
    if not value.isprintable():
        raise ValueError(f"an engine id is printable characters, got {value!r}")
    return value


def check_credentials(role: Role, settings: Mapping[str, Any]) -> None:
    """SettingsError when the credentials cannot work as the module docstring says: a prefill
    daemon given ``token`` without ``peer-token``, or the two tokens equal."""
    token, peer_token = settings["token"], settings["peer_token"]
    if token and token == peer_token:
        raise SettingsError("peer-token must differ from token: the client token would open the prefill "
                            "nodes' internal service to every client")
    if Role(role) is Role.PREFILL and token and not peer_token:
        raise SettingsError("token is the client credential of a decode daemon's Generate API and guards "
                            "nothing on a prefill daemon: give peer-token (the credential decode daemons "
                            "present), and leave token to the decode daemons")


def service_options(*, grpc_port: int, metrics_port: int) -> tuple[Option, ...]:
    """The shared options, with this daemon's default gRPC and metrics ports."""
    return (
        Option("host", text_value, "0.0.0.0", "address to bind the gRPC server to"),
        Option("port", parse_port, grpc_port, "gRPC port (0: any free port)"),
        Option("metrics-host", text_value, "0.0.0.0", "address of the Prometheus /metrics endpoint"),
        Option("metrics-port", parse_port, metrics_port, "Prometheus /metrics port (0: any free port, -1: off)"),
        Option("token", bearer_token, "", "client credential: bearer token a decode daemon requires on its "
                                          "Generate API (empty: none); a prefill daemon refuses it without "
                                          "peer-token"),
        Option("peer-token", bearer_token, "", "peer credential: bearer token a prefill daemon requires on its "
                                               "internal PrefillService and a decode daemon sends to it (empty: "
                                               "none; with mTLS the client certificate may stand alone)"),
        Option("engine-id", engine_id, "", "this node's engine id (empty: <role>-<hostname>-<pid>)"),
        Option("log-level", log_level, "INFO", "log level", choices=LEVELS),
        Option("log-format", one_of(LogFormat), LogFormat.JSON, "json (one object a line) or text",
               choices=tuple(f.value for f in LogFormat)),
        Option("torch-threads", thread_count, 1, f"torch intra-op threads (at most {THREADS_PER_CPU} a CPU)"),
        Option("drain-s", seconds, 30.0, "on SIGTERM, how long in-flight requests may take to finish"),
        Option("ready-file", text_value, "", "write {grpc_port, metrics_port, health_port, engine_id, pid} here as JSON "
                                      "once ready"),
        Option("lease-s", seconds, _CONNECTOR.lease_s, "lease of a prefilled request's blocks"),
        Option("rpc-timeout-s", seconds, _CONNECTOR.rpc_timeout_s, "deadline of one control-plane RPC"),
        Option("transfer-timeout-s", seconds, _CONNECTOR.transfer_timeout_s, "deadline of one transfer"),
        Option("pull-session-idle-s", seconds, _CONNECTOR.pull_session_idle_s, "a PullSession with no pull for this "
               "long is ended (the prefill daemon's limit; a decode node renews its own at half)"),
        Option("transports", transport_list, "auto", "ucx, grpc, or both comma-separated (auto: ucx when installed, "
                                                     "and grpc)"),
        Option("device", device_name, "cpu", "where the cache pool and the model live: cpu, cuda or cuda:N"),
        Option("ucx-progress", one_of(UcxProgress), _CONNECTOR.ucx_progress, "how UCX's worker is progressed: "
               "thread (sleeps between events), thread-polling (spins: one core kept busy, lower latency), "
               "auto (thread-polling for a GPU pool on 8 or more cores, else thread); UCXPY_PROGRESS_MODE "
               "wins", choices=tuple(p.value for p in UcxProgress)),
        Option("health-port", parse_port, -1, "a plaintext port serving only grpc.health.v1, for probes that "
                                        "cannot speak TLS (0: any free port, -1: off)"),
    )
