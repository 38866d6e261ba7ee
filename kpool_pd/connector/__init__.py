"""The connector: gRPC control plane, UCX and gRPC-stream data planes, transfer plans, leases.

Everything outside the connector imports these names from ``connector``; the modules behind them
are the connector's own (``kpool_pd.connector.prefill``, ``kpool_pd.connector.decode``, ``kpool_pd.connector.shared``).

One owner per node: the engine that computes a request owns the node's cache (``kvcache.NodeCache``)
and allocates from it; the connector never allocates, it moves bytes between allocations it is
handed (``kvcache.CacheAllocation``). The entry points, as vLLM's KVConnectorBase_V1 states its own:

Prefill side (``PrefillConnector(pool, engine, ...)``, one per prefill node):

- ``start()`` / ``stop()``: the daemon, on the event loop that serves the RPCs, before its server
  starts and after it stopped; both idempotent. ``stop`` frees every grant and forgets every engine.
- ``PrefillEngine.prefill(request, progress)``: the connector calls it once per Prefill RPC, on its
  loop, never twice for one call. The engine allocates, hands the allocation to
  ``progress.serve_from`` (once: a second call raises RuntimeError) and from then on the grant owns
  it: released when the grant is pulled and released, its lease expires, or the call fails or is
  cancelled (``progress.release()`` is idempotent). Before ``serve_from`` the engine releases what it
  took itself. ``progress.advance(tokens)`` may be called any number of times (it never goes back).
  Failure: the engine raises; ``status_of`` answers the caller (``CacheExhaustedError``
  RESOURCE_EXHAUSTED, ``EngineUnavailable`` UNAVAILABLE, ``ValueError`` INVALID_ARGUMENT, anything
  else INTERNAL). A caller that gives up cancels the awaited ``prefill``.

Decode side (``DecodeConnector(pool, ...)``, one per decode node):

- ``start()``: once, in the loop that runs the pulls (idempotent). ``connect(address)``: a router or
  DCP rank, once per prefill node (each call a new channel and ``PrefillPeer``); StatusError on
  failure, nothing kept. ``disconnect(peer_or_address)`` and ``close()``: idempotent.
- ``PrefillPeer.prefill(request_id, prompt)``: the scheduler, once per request; returns a
  ``PrefillGrant`` (the prefill node holds the blocks under lease). StatusError on failure; cancelling
  it gives any grant back in the background.
- ``PrefillPeer.pull(grant, into=allocation)``: the scheduler (or a DCP rank), once per grant, after it
  allocated ``into`` at admission; the allocation stays the caller's throughout, and when ``pull``
  returns or raises no receive into it is posted any more, so the caller may release it at once.
  Returns a ``LandedRequest`` (a frozen record that owns nothing; its ``PullTimeline`` and
  ``TransferTimes`` say where the time went); StatusError within ``ConnectorConfig.pull_budget_s``,
  the grant then the caller's to release (``release``/``release_soon``, idempotent). ValueError before
  anything is sent for an allocation that is released, ringless, foreign or too small. What a pull lands
  is a ``PullShare`` chosen once by its caller: ``WHOLE_REQUEST`` (the default), or a DCP rank's
  ``RankShare(shard)``.
- ``PrefillPeer.push(request_id, prompt, into=allocation)``: the scheduler, once per request, in place of
  ``prefill`` and ``pull`` where ``peer.pushes`` (the node serves PrefillPush for our layout): the receives
  are posted and the plan sent with the prompt, so the bytes leave as the prompt's chunks write them; the
  allocation is the caller's as for ``pull``, and the returned ``LandedRequest``'s grant is the caller's
  to release. StatusError as ``pull``'s; a failed or cancelled push gives its grant back.
- ``pull_packed(peer, targets)``: a vLLM consumer, once per engine step and prefill node where ``can_pack(peer)``:
  the step's pulls (``PackedTarget``: a grant into the caller's allocation) as one batch in one UCX message
  (in pieces), through a ``StagingBuffers`` of the caller's;
  one outcome a pull (``PackedLanded`` or the exception that failed it alone), ``PackedPullUnsupported`` from
  a node that does not serve it (nothing landed: pull each alone).
- ``prefetch_packed(peer, grants)``: a vLLM consumer, for grants the prefill node announced to it by name
  (``AwaitOffers``; the prefill side posts them on its ``OfferBoard`` as ``Announcement``s): pulled whole into a
  buffer of their own before their requests arrive; ``Prefetched.land(peer, target)`` copies a load's plan from it
  into the load's blocks.
- The peer keeps itself alive (one loop: Heartbeats renewing the grants it is pulling, a new Handshake
  when the prefill node forgot it) until it is closed.

Both: ``ConnectorConfig`` (``UCX_NO_SHARED_MEMORY``, ``UCX_SAME_HOST_ZERO_COPY``; ``UcxProgress``,
``progress_mode_for`` and ``describe_progress_mode``, how ucxx progresses the worker; ``pull_budget_s``) and
``TlsConfig``, ``Transport`` (``ucx_available``, ``ucx_context_info``; ``bind_ucx_options`` keeps UCX on a
daemon's host; ``dial_host`` and ``dial_target``: the address a local client dials for a bound host),
``StatusError`` (a gRPC status and a message) and ``status_of`` (the one mapping from an exception to
it), ``open_channel`` (with a peer token: every call in a session proved through PeerAuth, the token
never sent) and the credential helpers (``Credential``: the client token or the peer token;
``CredentialInterceptor``, ``PeerSessions`` and ``PeerAuthServicer``: a server's check of both, at most
``MAX_PEER_SESSIONS`` peer sessions by default);
a grant's ring is a ``RingRange``. ``prefill_api``: the PrefillService wire format, for tests and tools
that speak it directly. ``MAX_ID_CHARS`` and ``MAX_DCP_RANKS``: the longest engine id and the most
DCP ranks a prefill node accepts (a daemon refuses settings beyond them at start). ``HopRecorder`` and
``HOPS``: a UCX pull's hop stamps on both nodes, for the transfer bench (off unless recorded), and
``StepCountingLoop`` the event loop that also counts its steps between them.
"""

from kpool_pd.connector import prefill_api
from kpool_pd.connector.shared.auth import Credential, CredentialInterceptor, auth_metadata
from kpool_pd.connector.shared.channels import open_channel
from kpool_pd.connector.shared.config import UCX_NO_SHARED_MEMORY, UCX_SAME_HOST_ZERO_COPY, ConnectorConfig, TlsConfig
from kpool_pd.connector.shared.dcp_plan import dcp_transfer_bytes
from kpool_pd.connector.decode.connector import DecodeConnector
from kpool_pd.connector.prefill.engine import PrefillEngine, PrefillInput, PrefillOutput, PrefillProgress
from kpool_pd.connector.shared.errors import CacheExhaustedError, EngineUnavailable, StatusError, status_of
from kpool_pd.connector.shared.hops import HOPS, HopRecorder, StepCountingLoop
from kpool_pd.connector.shared.hosts import dial_host, dial_target
from kpool_pd.connector.decode.grant import PrefillGrant, PullTimeline, TransferTimes
from kpool_pd.connector.decode.landed import LandedRequest
from kpool_pd.connector.decode.staging import BlocksReady
from kpool_pd.connector.decode.peer import PrefillPeer
from kpool_pd.connector.decode.packed_pull import (PackedLanded, PackedPullUnsupported, PackedTarget, can_pack,
                                                pull_packed)
from kpool_pd.connector.decode.prefetch import Prefetched, prefetch_packed, whole_plan
from kpool_pd.connector.prefill.offer_board import Announcement, OfferBoard
from kpool_pd.connector.shared.packed_staging import StagingBuffers
from kpool_pd.connector.decode.share import WHOLE_REQUEST, PullShare, RankShare
from kpool_pd.connector.shared.peer_auth import MAX_PEER_SESSIONS, PeerAuthServicer, PeerSessions
from kpool_pd.connector.shared.plan import RingRange
from kpool_pd.connector.prefill.connector import PrefillConnector
from kpool_pd.connector.prefill.handshake import MAX_ID_CHARS
from kpool_pd.connector.prefill.prefills import MAX_DCP_RANKS
from kpool_pd.connector.shared.ucx import UcxNode, ucx_available, ucx_context_info
from kpool_pd.connector.shared.ucx_host import bind_ucx_options
from kpool_pd.connector.shared.ucx_progress import UcxProgress, describe_progress_mode, progress_mode_for
from kpool_pd.connector.shared.wire import Transport

__all__ = [
    "Announcement", "OfferBoard", "Prefetched", "prefetch_packed", "whole_plan",
    "HOPS", "StepCountingLoop", "MAX_DCP_RANKS", "MAX_ID_CHARS", "MAX_PEER_SESSIONS", "HopRecorder", "CacheExhaustedError", "ConnectorConfig", "Credential",
    "CredentialInterceptor", "DecodeConnector", "EngineUnavailable",
    "BlocksReady", "LandedRequest", "PackedLanded", "PackedPullUnsupported", "PackedTarget", "PeerAuthServicer", "PeerSessions", "PrefillConnector", "PrefillEngine", "PrefillGrant",
    "PrefillInput", "PrefillOutput", "PrefillPeer", "PrefillProgress", "PullShare", "PullTimeline", "RankShare",
    "RingRange", "StagingBuffers", "StatusError", "WHOLE_REQUEST",
    "TlsConfig", "TransferTimes", "Transport", "UcxNode", "UcxProgress",
    "UCX_NO_SHARED_MEMORY", "UCX_SAME_HOST_ZERO_COPY", "auth_metadata", "bind_ucx_options", "dcp_transfer_bytes",
    "can_pack", "describe_progress_mode", "dial_host", "dial_target", "open_channel", "progress_mode_for", "pull_packed", "prefill_api", "status_of", "ucx_available", "ucx_context_info",
]
