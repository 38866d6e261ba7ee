"""The options every daemon has: where it listens, auth, logs, threads, drain, readiness file,
connector deadlines, transports and device. A daemon's table is these, the TLS options, the
model options and its own."""

from __future__ import annotations

from runtime.device import device_name
from runtime.logs import LEVELS, LogFormat, log_level
from runtime.options import Option, one_of, parse_port, positive_float, positive_int
from runtime.transports import transport_list


def service_options(*, grpc_port: int, metrics_port: int) -> tuple[Option, ...]:
    """The shared options, with this daemon's default gRPC and metrics ports."""
    return (
        Option("host", str, "0.0.0.0", "address to bind the gRPC server to"),
        Option("port", parse_port, grpc_port, "gRPC port (0: any free port)"),
        Option("metrics-host", str, "0.0.0.0", "address of the Prometheus /metrics endpoint"),
        Option("metrics-port", parse_port, metrics_port, "Prometheus /metrics port (0: any free port, -1: off)"),
        Option("token", str, "", "bearer token required on every RPC (empty: none)"),
        Option("engine-id", str, "", "this node's engine id (empty: <role>-<hostname>-<pid>)"),
        Option("log-level", log_level, "INFO", "log level", choices=LEVELS),
        Option("log-format", one_of(LogFormat), LogFormat.JSON, "json (one object a line) or text",
               choices=tuple(f.value for f in LogFormat)),
        Option("torch-threads", positive_int, 1, "torch intra-op threads"),
        Option("drain-s", positive_float, 30.0, "on SIGTERM, how long in-flight requests may take to finish"),
        Option("ready-file", str, "", "write {grpc_port, metrics_port, health_port, engine_id, pid} here as JSON "
                                      "once ready"),
        Option("lease-s", positive_float, 30.0, "lease of a prefilled request's blocks"),
        Option("rpc-timeout-s", positive_float, 10.0, "deadline of one control-plane RPC"),
        Option("transfer-timeout-s", positive_float, 30.0, "deadline of one transfer"),
        Option("transports", transport_list, "auto", "ucx, grpc, or both comma-separated (auto: ucx when installed, "
                                                     "and grpc)"),
        Option("device", device_name, "cpu", "where the cache pool and the model live: cpu, cuda or cuda:N"),
        Option("health-port", parse_port, -1, "a plaintext port serving only grpc.health.v1, for probes that "
                                        "cannot speak TLS (0: any free port, -1: off)"),
    )
