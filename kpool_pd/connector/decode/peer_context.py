"""What a decode node's ``PrefillPeer`` needs of its node: the pool it lands into, its engine id, its
connector settings, metrics and UCX worker. The ``DecodeConnector`` makes one for its peers; a peer never
reaches back into the connector."""

from __future__ import annotations

from dataclasses import dataclass, field

from kpool_pd.connector.decode.engine_secrets import EngineSecrets
from kpool_pd.connector.decode.releases import BackgroundReleases
from kpool_pd.connector.shared.config import ConnectorConfig
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.ucx import UcxNode
from kpool_pd.kvcache import CachePool


@dataclass(frozen=True, kw_only=True)
class PeerContext:
    """The decode node as its peers see it: ``pool`` (the cache the pulls land into: allocations of it are
    the caller's), ``engine_id`` (the name every call to a prefill node carries), ``config``, ``metrics``
    ``ucx`` (the node's UCX worker, None without UCX), ``secrets`` (the engine's secret on each prefill node,
    which every call presents; the keep-alive's Handshakes renew them) and ``releases`` (the node's background
    Releases, which outlive the peer that queued them)."""

    pool: CachePool
    engine_id: str
    config: ConnectorConfig
    metrics: ConnectorMetrics
    releases: BackgroundReleases
    ucx: UcxNode | None = None
    secrets: EngineSecrets = field(default_factory=EngineSecrets)
