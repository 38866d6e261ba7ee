"""Connector settings: leases, limits, deadlines, the peer credential and TLS. Frozen; change with ``dataclasses.replace``."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kpool_pd.connector.shared.ucx_progress import UcxProgress

MiB = 1 << 20

# UCX options (see ConnectorConfig.ucx_options for the trade-off)
UCX_NO_SHARED_MEMORY: tuple[tuple[str, str], ...] = (("TLS", "^posix,sysv,cma,xpmem,knem"),)
UCX_SAME_HOST_ZERO_COPY: tuple[tuple[str, str], ...] = ()
# A pool in host memory: messages up to 4 MiB go eagerly, sent from the buffer itself from 16 KiB on. Over tcp,
# UCX's rendezvous (its default from 8 KiB) waits for the receiving worker to answer before any byte moves,
# and a host busy with a forward delays that answer: `kpool-pd up` on a 2-core machine, 0.34 MiB a request,
# moved a request in a mean of 3.5-66 ms with the rendezvous and 1.4-5.0 ms eagerly (six runs each).
UCX_HOST_MEMORY: tuple[tuple[str, str], ...] = (("RNDV_THRESH", "4M"), ("ZCOPY_THRESH", "16K"))


def ucx_options_for(options: tuple[tuple[str, str], ...], device_type: str) -> tuple[tuple[str, str], ...]:
    """``options`` for a node whose pool lives on ``device_type`` ("cpu", "cuda"): on the CPU,
    ``UCX_HOST_MEMORY``'s options are added where ``options`` do not set the key (GPU memory keeps
    UCX's rendezvous, which its zero-copy paths need)."""
    if device_type != "cpu":
        return tuple(options)
    keys = {key for key, _ in options}
    return (*options, *((key, value) for key, value in UCX_HOST_MEMORY if key not in keys))


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """PEM bytes. On a server, ``cert_chain``/``private_key`` are its identity and ``root_certs``
    (with ``require_client_auth``) checks clients (mTLS); on a client, ``root_certs`` checks the
    server and ``cert_chain``/``private_key`` (optional) are the client's identity."""

    cert_chain: bytes | None = None
    private_key: bytes | None = None
    root_certs: bytes | None = None
    require_client_auth: bool = False
    server_name_override: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.cert_chain or not self.private_key:
            raise ValueError("a TLS server needs cert_chain and private_key")
        if self.require_client_auth and not self.root_certs:
            raise ValueError("require_client_auth needs root_certs to check client certificates against")
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.root_certs,
            require_client_auth=self.require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certs, private_key=self.private_key, certificate_chain=self.cert_chain,
        )


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """Shared by both roles; each side reads what concerns it.

    ``ucx_options`` go to ``ucxx.init`` (UCX_<KEY>=value); they choose between two same-host
    behaviours for host memory (GPU memory goes by cuda_ipc either way; other hosts by tcp/RDMA):

    - ``UCX_NO_SHARED_MEMORY`` (default): UCX's host shared-memory transports (posix, sysv, cma,
      xpmem, knem) are left out, so host memory between processes of one host goes over tcp
      loopback. A peer that dies mid-transfer fails only its own pulls.
    - ``UCX_SAME_HOST_ZERO_COPY``: every transport UCX finds. Same-host host memory goes through
      UCX's shared-memory FIFO and cma (``process_vm_readv``), several times faster, but one
      sender's death can take the receiver down with it: the FIFO is shared by every sender to a
      worker, and a sender killed while writing a FIFO element leaves it unfinished, so the
      receiver's transfers from every other node stall (until their deadlines, and again for
      every later pull) until the receiving process restarts; and UCX treats a failed cma read as
      fatal when endpoint error handling is off. Use it only where a node's processes fail
      together.

    A node whose pool is in host memory adds ``UCX_HOST_MEMORY`` (``ucx_options_for``) for the keys
    these options leave unset: regions up to 4 MiB are sent eagerly rather than by the rendezvous.

    ``peer_token`` is the peer credential (DESIGN section 5): a prefill node's PrefillService
    requires it on every call (the daemon's server checks it), and a decode node proves it on each
    channel to a prefill node and has the node prove it back, never sending it (``open_channel``,
    ``kpool_pd.connector.shared.peer_auth``). It is never the client token of a decode node's Generate API, which is
    the daemon's business, not the connector's. None: no token (plaintext loopback, or mTLS
    client certificates as the peer identity).

    Environment variables win over these options: an operator's ``UCX_TLS`` (or any
    ``UCX_<KEY>`` for a key set here) replaces the connector's value, and the variables UCX reads
    that are not set here (``UCX_NET_DEVICES``, ``UCX_IB_GID_INDEX``, ...) apply as usual, so a
    manifest can restrict transports and devices without code (``UCX_TLS=tcp,self``;
    ``UCX_NET_DEVICES=mlx5_0:1``). ``UcxNode.active_transports()`` reports what UCX chose. The
    options apply once per process (UCX keeps the first initialisation).

    ``ucx_progress`` is how ucxx progresses the worker (``kpool_pd.connector.shared.ucx_progress``): ``AUTO``
    spins a progress thread (one core busy) for a GPU pool where the process may keep 8 cores or more busy: a GPU
    transfer's completion reaches ucxx's sleeping thread late (measured there; why is not isolated); an operator's
    ``UCXPY_PROGRESS_MODE`` wins. Like the options, it applies once per process.
    """

    lease_s: float = 30.0
    peer_token: str | None = None
    tls: TlsConfig | None = None
    max_prompt_tokens: int = 131072
    max_grants: int = 4096
    max_message_bytes: int = 16 * MiB
    chunk_bytes: int = 4 * MiB
    piece_tokens: int = 2048  # a pipelined transfer moves blocks in pieces of this many prompt tokens (at least a block)
    rpc_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    heartbeat_s: float | None = None  # default: lease_s / 3
    # A PullSession with no pull running that sends nothing for this long is ended (DEADLINE_EXCEEDED) and its
    # state freed; a decode node reopens its session at its next pull (it closes its own idle one sooner).
    pull_session_idle_s: float = 120.0
    ucx_options: tuple[tuple[str, str], ...] = UCX_NO_SHARED_MEMORY
    ucx_progress: UcxProgress = UcxProgress.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.ucx_progress, UcxProgress):
            raise ValueError(f"ucx_progress must be one of {[p.name for p in UcxProgress]} (a UcxProgress), "
                             f"got {self.ucx_progress!r}")
        for name in ("lease_s", "rpc_timeout_s", "transfer_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not 0 < self.pull_session_idle_s < float("inf"):
            raise ValueError(f"pull_session_idle_s must be a finite number of seconds > 0, got {self.pull_session_idle_s!r}")
        for name in ("max_prompt_tokens", "max_grants", "chunk_bytes", "max_message_bytes", "piece_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.chunk_bytes + 64 * 1024 > self.max_message_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must leave 64 KiB of room under max_message_bytes {self.max_message_bytes}")
        if self.peer_token is not None and (not isinstance(self.peer_token, str) or not self.peer_token.strip()
                                            or self.peer_token != self.peer_token.strip()):
            raise ValueError("peer_token must be None (no token) or a non-empty string without surrounding spaces")
        if self.heartbeat_s is not None and not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError(f"heartbeat_s {self.heartbeat_s} must be in (0, lease_s={self.lease_s})")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 3

    def pull_budget_s(self, *, computing: bool) -> float:
        """How long one pull may take, from its Pull call to its last byte: ``transfer_timeout_s``, plus
        ``rpc_timeout_s`` (the compute's own deadline) while its prompt is still being computed (a
        pipelined grant). Both nodes bound a pull by it: the prefill node its sends, the decode node its wait."""
        return self.transfer_timeout_s + (self.rpc_timeout_s if computing else 0.0)

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
