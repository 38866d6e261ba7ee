"""The connector: gRPC control plane, UCX and gRPC-stream data planes, transfer plans, leases.

Everything outside the connector imports these names from ``connector``; the modules behind them
are the connector's own.

One owner per node: the engine that computes a request owns the node's cache (``kvcache.NodeCache``)
and allocates from it; the connector never allocates, it moves bytes between allocations it is
handed (``kvcache.CacheAllocation``).

- Prefill side: ``PrefillConnector`` serves a prefill node's cache to decode nodes; the model side
  plugs in as a ``PrefillEngine``: for each Prefill call it allocates, hands the allocation to the
  call's ``PrefillProgress`` (``serve_from``; the grant's lease then holds that handle and releases
  it), says how far the prompt is written (``advance``) and returns a ``PrefillOutput``, or raises
  ``CacheExhaustedError`` (RESOURCE_EXHAUSTED) or ``EngineUnavailable`` (UNAVAILABLE).
- Decode side: ``DecodeConnector`` handshakes with prefill nodes (``PrefillPeer``) and pulls a
  ``PrefillGrant`` into an allocation the caller made (``PrefillPeer.pull(grant, into=...)``), and
  says how it went (``LandedRequest``; its ``PullTimeline`` says where the pull's time went); a grant's
  ring is a ``RingRange``. A rank of a decode-context-parallel instance pulls its own share of a grant
  (``PrefillPeer.pull(dcp=...)``).
- Both: ``ConnectorConfig`` (``UCX_NO_SHARED_MEMORY``, ``UCX_SAME_HOST_ZERO_COPY``) and
  ``TlsConfig``, ``Transport`` (``ucx_available``, ``ucx_context_info``; ``bind_ucx_options`` keeps UCX on a daemon's
  host; ``dial_host`` and ``dial_target``: the address a local client dials for a bound host), ``StatusError`` (a gRPC status and a message),
  ``open_channel`` and the bearer-token helpers (``Credential``: the client token or the peer token).
- ``MAX_ID_CHARS`` and ``MAX_DCP_RANKS``: the longest engine id and the most DCP ranks a prefill node accepts
  (a daemon refuses settings beyond them at start).
- ``prefill_api``: the PrefillService wire format, for tests and tools that speak it directly.
"""

from connector import prefill_api
from connector.shared.auth import BearerTokenInterceptor, Credential, auth_metadata
from connector.shared.channels import open_channel
from connector.shared.config import UCX_NO_SHARED_MEMORY, UCX_SAME_HOST_ZERO_COPY, ConnectorConfig, TlsConfig
from connector.shared.dcp_plan import dcp_transfer_bytes
from connector.decode.connector import DecodeConnector
from connector.prefill.engine import PrefillEngine, PrefillInput, PrefillOutput, PrefillProgress
from connector.shared.errors import CacheExhaustedError, EngineUnavailable, StatusError
from connector.shared.hosts import dial_host, dial_target
from connector.decode.landed import LandedRequest, PrefillGrant, TransferTimes
from connector.decode.peer import PrefillPeer
from connector.shared.plan import RingRange
from connector.prefill.connector import MAX_DCP_RANKS, MAX_ID_CHARS, PrefillConnector
from connector.decode.inbound import PullTimeline
from connector.shared.ucx import ucx_available, ucx_context_info
from connector.shared.ucx_host import bind_ucx_options
from connector.shared.wire import Transport

__all__ = [
    "MAX_DCP_RANKS", "MAX_ID_CHARS", "BearerTokenInterceptor", "CacheExhaustedError", "ConnectorConfig", "Credential", "DecodeConnector", "EngineUnavailable",
    "LandedRequest", "PrefillConnector", "PrefillEngine", "PrefillGrant", "PrefillInput",
    "PrefillOutput", "PrefillPeer", "PrefillProgress", "PullTimeline", "RingRange", "StatusError", "TlsConfig", "TransferTimes", "Transport",
    "UCX_NO_SHARED_MEMORY", "UCX_SAME_HOST_ZERO_COPY", "auth_metadata", "bind_ucx_options", "dcp_transfer_bytes",
    "dial_host", "dial_target", "open_channel", "prefill_api", "ucx_available", "ucx_context_info",
]
