"""The connector: gRPC control plane, UCX and gRPC-stream data planes, transfer plans, leases.

The public names are below; the modules behind them are the connector's own.

- Prefill side: ``PrefillConnector`` serves a prefill node's cache to decode nodes; the model side
  plugs in as a ``PrefillEngine`` (``PrefillInput`` -> ``PrefillOutput`` through a ``PrefillCache``).
- Decode side: ``DecodeConnector`` handshakes with prefill nodes (``PrefillPeer``), pulls a
  ``PrefillGrant`` into a ``LandedRequest`` that owns the landed blocks until released.
- Both: ``ConnectorConfig`` and ``TlsConfig``, ``Transport``, ``StatusError`` (a gRPC status and
  a message), channels and auth helpers.
"""

from connector.auth import BearerTokenInterceptor, auth_metadata
from connector.channels import open_channel
from connector.config import UCX_NO_SHARED_MEMORY, UCX_SAME_HOST_ZERO_COPY, ConnectorConfig, TlsConfig
from connector.decode import DecodeConnector, LandedRequest, PrefillGrant, PrefillPeer
from connector.engine import PrefillCache, PrefillEngine, PrefillInput, PrefillOutput
from connector.errors import CacheExhaustedError, EngineUnavailable, StatusError
from connector.prefill import PrefillConnector
from connector.ucx import ucx_available
from connector.wire import Transport

__all__ = [
    "BearerTokenInterceptor", "CacheExhaustedError", "ConnectorConfig", "DecodeConnector", "EngineUnavailable",
    "LandedRequest", "PrefillCache", "PrefillConnector", "PrefillEngine", "PrefillGrant", "PrefillInput",
    "PrefillOutput", "PrefillPeer", "StatusError", "TlsConfig", "Transport", "UCX_NO_SHARED_MEMORY",
    "UCX_SAME_HOST_ZERO_COPY", "auth_metadata", "open_channel", "ucx_available",
]
