"""What both daemons share: option tables and settings (flags > env > YAML), TLS, logs, the
device, transports, the gRPC server with auth, health, reflection and the health port,
``/metrics``, signals, readiness and drain.

A daemon is a ``DaemonSpec`` (its role, its option table, how to build its ``Node``) handed to
``run_daemon``; the runtime serves it (``kpool_pd.runtime.daemon`` says in which order).
"""

from kpool_pd.runtime.daemon import run_daemon, serve
from kpool_pd.runtime.device import device_name, resolve_device
from kpool_pd.runtime.grpc_server import LIVENESS_SERVICE, GrpcServer, Servicer
from kpool_pd.runtime.logs import JsonFormatter, LogFormat, configure_logging
from kpool_pd.runtime.metrics import MetricsEndpoint
from kpool_pd.runtime.model_options import (MODEL_OPTIONS, add_model_arguments, cuda_graphs_serve, model_config, model_flags,
                                   model_settings)
from kpool_pd.runtime.node import DaemonSpec, Node, NodeContext, default_engine_id
from kpool_pd.runtime.options import (ENV_PREFIX, Option, Role, SettingsError, int_in, integer, memory_fraction,
                             nonnegative_int, number, parse_bool, parse_port, positive_float, positive_int, seconds,
                             seconds_or_off, text_value)
from kpool_pd.runtime.process import termination_event, write_ready_file
from kpool_pd.runtime.service_options import service_options
from kpool_pd.runtime.settings import load_settings
from kpool_pd.runtime.tls import TLS_CLIENT_OPTIONS, TLS_OPTIONS, client_tls, read_pem, tls_config
from kpool_pd.runtime.transports import Transports, parse_pull, parse_transports, pull_choice, transport_list, transports_of

__all__ = [
    "ENV_PREFIX", "LIVENESS_SERVICE", "MODEL_OPTIONS", "TLS_CLIENT_OPTIONS", "TLS_OPTIONS", "DaemonSpec", "GrpcServer", "JsonFormatter",
    "LogFormat", "MetricsEndpoint", "Node", "NodeContext", "Option", "Role", "Servicer", "SettingsError", "Transports",
    "add_model_arguments", "cuda_graphs_serve", "int_in", "integer", "number", "seconds", "seconds_or_off", "text_value", "client_tls", "configure_logging", "default_engine_id", "device_name", "load_settings",
    "model_config", "model_flags", "model_settings", "nonnegative_int", "parse_bool", "parse_port", "parse_pull", "parse_transports",
    "memory_fraction", "positive_float", "positive_int", "pull_choice", "read_pem", "resolve_device", "run_daemon", "serve",
    "service_options", "termination_event", "tls_config", "transport_list", "transports_of", "write_ready_file",
]
