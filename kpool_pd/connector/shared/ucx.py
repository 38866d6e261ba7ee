"""The UCX data plane on ucxx: this process's worker, endpoints made from peers' worker addresses
(exchanged in the Handshake), and tag-matched sends and receives.

Only the sending side (the prefill node) makes endpoints; the decode node posts its receives on
its worker and holds no endpoint to a prefill node. UCX pairs the endpoints that two workers
make to each other by connection sequence number; when the receiving side drops its half of such
a pair while the sender keeps the other, the sender's later rendezvous messages find no endpoint
to answer them and large transfers fail or hang. With endpoints on one side only, either side
may fail, drop or restart without the other noticing: a sender that drops its endpoint makes a
fresh one (UCX wires it up anew), and the receiver has nothing to drop. A sender may hold several
endpoints to one peer: each pull sends on one lent to it alone (``kpool_pd.connector.prefill.ucx_link``), so
that aborting it, which is how a pull's sends in flight are stopped, stops no other pull's.

Endpoint error handling is off, so that UCX may use shared memory; peer failure is the control
plane's job (deadlines, leases, heartbeats). Messages are tag-matched with ``force_tag``: region
i of a pull travels under ``tag_base + i``, where the decode node draws ``tag_base`` at random for
each pull.

A worker address comes from the wire, and UCX trusts it: a malformed one aborts the process. So a
peer's address reaches ``endpoint_to`` only after the sending role vetted it
(``kpool_pd.connector.prefill.ucx_vetting``: a structural check of its bytes, then a first endpoint made in a
child process, which UCX may take down instead of the daemon).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from kpool_pd.connector.shared.regions import ucx_buffer

logger = logging.getLogger(__name__)

MAX_REGIONS = 1 << 16  # region index fits in the low 16 bits of the tag
TAG_MASK = (1 << 64) - 1
ABANDON_GRACE_S = 1.0  # how long abandoned receives may take to settle before their memory is reused
NOT_ENCRYPTED = ("TLS protects the gRPC connections only: the cache bytes sent over UCX are NOT encrypted (UCX has "
                 "no TLS); offer only the gRPC stream (--transports grpc) where the data plane must be encrypted")


class UcxUnavailableError(RuntimeError):
    """ucxx cannot be imported or initialised; deploy with the gRPC stream transport instead."""


class UcxUnreachableError(RuntimeError):
    """UCX cannot make an endpoint to a (well-formed) worker address, or could not check it in time."""


class UcxSendError(ConnectionError):
    """A send failed in UCX (the peer reset the connection, went away, ...); its endpoint was aborted."""


# The UCX options (keys without UCX_) that ucxx puts in the environment when it is imported, where the
# operator had not set them: its defaults. Left there they would beat the options ucxx.init is given
# (environment first) and pass to every process this one starts as if an operator had set them; they are
# taken out of the environment and given to ucxx.init as options, under the node's own.
_ucxx_defaults: dict[str, str] = {}


def _request_types():
    """ucxx's ``(Array, Tag)``, which posting a request on an endpoint or the worker takes; None for a ucxx
    without them (its sends and receives then go through ``Endpoint.send`` and ``ucxx.recv``). Looked up once a
    node, not at each send and receive."""
    try:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag
    except ImportError:
        return None
    return Array, Tag


def _import_ucxx():
    # ucxx sets UCX_MEMTYPE_CACHE=n when it is imported, after its libraries were loaded: UCX reads
    # that option as they load, so then it is ignored and UCX warns at every start. Set before the
    # import, it applies (an operator's value wins).
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    before = {key for key in os.environ if key.startswith("UCX_")}
    try:
        import ucxx
    except Exception as exc:  # ImportError, or a missing libucx
        raise UcxUnavailableError(
            f"the UCX transport needs the ucxx package (pip install 'kpool-pd[ucx]'): {exc}; "
            "choose the gRPC stream transport on machines without UCX") from exc
    for key in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
        _ucxx_defaults[key.removeprefix("UCX_")] = os.environ.pop(key)
    return ucxx


def ucx_available() -> bool:
    try:
        _import_ucxx()
    except UcxUnavailableError:
        return False
    return True


def ucx_context_info() -> str:
    """UCX's description of this process's context (its transports and devices), as ucxx prints it.
    Call it once the node's ``UcxNode`` exists: ucxx would otherwise make a context with default
    options."""
    return _import_ucxx().get_ucp_context_info()


def region_tag(tag_base: int, index: int) -> int:
    return (tag_base + index) & TAG_MASK


class ReceiveBatch:
    """The receives of one pull, posted on the worker: ``futures[i]`` completes when region i
    (tag ``tags[i]``) landed."""

    __slots__ = ("tags", "futures")

    def __init__(self, tags: list[int], futures: list[asyncio.Future]) -> None:
        self.tags, self.futures = tags, futures

    def pending(self) -> list[int]:
        """Indexes of the receives that have not completed."""
        return [i for i, f in enumerate(self.futures) if not f.done()]

    async def wait(self) -> None:
        """Until every region landed; raises the first receive's error. Cancelling the wait
        leaves the receives posted (``UcxNode.abandon`` retires them)."""
        await asyncio.gather(*(asyncio.shield(f) for f in self.futures))


class UcxNode:
    """The process's ucxx worker (ucxx keeps one per process) and our endpoints to the peers we
    send to. Create it inside the running event loop that will await its transfers.

    Sender side: make endpoints to a peer's vetted worker address (``endpoint_to``; the prefill role vets an
    address from the wire first, ``kpool_pd.connector.prefill.ucx_vetting``) and ``send_on`` them; which endpoints a peer has, and which pull holds each, is its link's
    (``kpool_pd.connector.prefill.ucx_link.UcxLink``).
    Receiver side: ``post_receives`` on the worker, and ``abandon`` the receives of a pull that
    failed, so that nothing lands in its memory once it is reused.
    """

    def __init__(self, options: Sequence[tuple[str, str]] = (), *, progress_mode: str | None = None) -> None:
        self._ucxx = _import_ucxx()
        self._request_types = _request_types()
        self.options: dict[str, str] = dict(options)
        try:  # an operator's UCX_<KEY> in the environment overrides our option <KEY>
            self._ucxx.init(options=_ucxx_defaults | self.options, env_takes_precedence=True,
                            progress_mode=progress_mode)
        except RuntimeError:
            logger.info("ucxx already initialised in this process; keeping its options and progress mode")
        # how ucxx progresses the worker (``kpool_pd.connector.shared.ucx_progress``): "thread", "thread-polling", ...
        context = getattr(getattr(self._ucxx, "core", None), "_ctx", None)
        self.progress_mode: str = str(getattr(context, "progress_mode", None) or progress_mode or "thread")
        self.address: bytes = bytes(self._ucxx.get_worker_address())
        self._lock = asyncio.Lock()
        self._self_endpoint = None
        config = self.ucx_config()
        self.unified_mode = config.get("UNIFIED_MODE", "n").lower() in ("y", "yes", "on", "1")
        logger.info("UCX worker up: transports %s, network devices %s, progress %s",
                     ",".join(sorted(self.active_transports())), config.get("NET_DEVICES", "all"), self.progress_mode)

    def active_transports(self) -> frozenset[str]:
        """The UCX transports this process's context uses (e.g. {"tcp", "self", "sysv"})."""
        return frozenset(self._ucxx.get_active_transports())

    def ucx_config(self) -> dict[str, str]:
        """UCX's context configuration as UCX reports it (keys without the ``UCX_`` prefix)."""
        return dict(self._ucxx.get_config())

    # sender side -------------------------------------------------------------------------
    async def endpoint_to(self, address: bytes):
        """A new ucxx endpoint to a vetted worker ``address`` (endpoint error handling off). Endpoints are
        made one at a time; the caller owns it (``kpool_pd.connector.prefill.ucx_link`` keeps a decode engine's)."""
        async with self._lock:
            return await self._ucxx.create_endpoint_from_worker_address(
                self._ucxx.get_ucx_address_from_buffer(bytes(address)), endpoint_error_handling=False)

    async def send_on(self, ep, views: Sequence[torch.Tensor], tag_base: int, *, peer: str = "") -> None:
        """Send ``views[i]`` on endpoint ``ep`` under ``tag_base + i``, all at once; returns when all completed.
        A failure in UCX is raised as ``UcxSendError`` (naming ``peer``); the caller aborts ``ep`` on any
        failure or cancellation, so that no send keeps reading ``views`` afterwards."""
        if ep is None or ep.closed:
            raise UcxSendError(f"UCX send to {peer}: its endpoint was aborted")
        try:
            await asyncio.gather(*(ep.send(ucx_buffer(v), tag=region_tag(tag_base, i), force_tag=True)
                                   for i, v in enumerate(views)))
        except self._ucxx.exceptions.UCXError as exc:
            raise UcxSendError(f"UCX send to {peer} failed: {type(exc).__name__}: {exc}") from exc

    def post_send(self, ep, view: torch.Tensor, tag: int, *, peer: str = "") -> asyncio.Future:
        """Post the send of ``view`` on ``ep`` under ``tag`` now, within this call (no loop step in between),
        and return the future of its completion. UcxSendError (raised here, or by the future) for a failure in
        UCX or an aborted endpoint; the caller aborts ``ep`` on any failure, so that no send reads ``view``
        afterwards."""
        if ep is None or ep.closed:
            raise UcxSendError(f"UCX send to {peer}: its endpoint was aborted")
        buffer = ucx_buffer(view)
        tag_send = getattr(getattr(ep, "_ep", None), "tag_send", None)
        if tag_send is None or self._request_types is None:  # no request API: posted at the task's first step
            return asyncio.ensure_future(self._completed(ep.send(buffer, tag=tag, force_tag=True), peer))
        # ucxx's Endpoint.send posts its request, then awaits it: posting it here saves the loop step that a
        # task wrapping Endpoint.send takes before UCX sees the message
        Array, Tag = self._request_types
        array = Array(buffer)
        try:
            request = tag_send(array, Tag(tag))
        except self._ucxx.exceptions.UCXError as exc:
            raise UcxSendError(f"UCX send to {peer} failed: {type(exc).__name__}: {exc}") from exc
        return asyncio.ensure_future(self._completed(request.wait(), peer, keep=array))

    async def _completed(self, completion, peer: str, keep=None) -> None:
        """Await a posted send's ``completion`` (``keep``: its buffer, held until then); UcxSendError on failure."""
        try:
            await completion
        except self._ucxx.exceptions.UCXError as exc:
            raise UcxSendError(f"UCX send to {peer} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            del keep

    # receiver side -----------------------------------------------------------------------
    def post_receives(self, views: Sequence[torch.Tensor], tag_base: int) -> ReceiveBatch:
        """Post ``views[i]`` as the receive buffer for ``tag_base + i`` on the worker, every one within this call
        (no loop step in between, and no task a receive before it is posted)."""
        tags = [region_tag(tag_base, i) for i in range(len(views))]
        worker = getattr(getattr(getattr(self._ucxx, "core", None), "_ctx", None), "worker", None)
        if worker is None or not hasattr(worker, "tag_recv") or self._request_types is None:  # no request API
            return ReceiveBatch(tags, [asyncio.ensure_future(self._ucxx.recv(ucx_buffer(v), tag))
                                       for v, tag in zip(views, tags)])
        # ucxx's recv formats a log line, builds its request and awaits it in a task of its own, which posts
        # the receive only at its first step: here each is posted at once, and its completion awaited
        Array, Tag = self._request_types
        futures = []
        for view, tag in zip(views, tags):
            array = Array(ucx_buffer(view))
            try:
                completion = worker.tag_recv(array, Tag(tag)).wait()
            except self._ucxx.exceptions.UCXError as exc:  # raised where the receive is awaited, as ucxx's recv does
                future = asyncio.get_running_loop().create_future()
                future.set_exception(exc)
                futures.append(future)
                continue
            futures.append(asyncio.ensure_future(self._received(completion, array)))
        return ReceiveBatch(tags, futures)

    @staticmethod
    async def _received(completion, keep):
        """Await a posted receive's ``completion``, ``keep`` (its buffer) held until then."""
        try:
            return await completion
        finally:
            del keep

    async def abandon(self, batch: ReceiveBatch, grace_s: float = ABANDON_GRACE_S) -> int:
        """Retire the receives of a failed pull before their memory is reused.

        A receive that no message matched yet is completed by an empty message that this worker
        sends itself under its tag (it writes nothing into the receive's memory) (the sender's message, should it still come, then
        waits unmatched and is never delivered). A receive already matched by the sender's
        message completes or fails when the sender finishes or aborts; this waits ``grace_s``
        for those. Returns how many receives are still pending (a dead sender's, which nothing
        will write any more)."""
        pending = batch.pending()
        if not pending:
            return 0
        ep = await self._loopback()
        empty = np.zeros(0, dtype=np.uint8)
        await asyncio.gather(*(ep.send(empty, tag=batch.tags[i], force_tag=True) for i in pending),
                             return_exceptions=True)
        futures = [batch.futures[i] for i in pending]
        _, still = await asyncio.wait(futures, timeout=grace_s)
        for future in futures:  # retrieve the exceptions of cancelled and failed receives
            if future.done() and not future.cancelled():
                future.exception()
        return len(still)

    async def _loopback(self):
        async with self._lock:
            if self._self_endpoint is None:
                self._self_endpoint = await self._ucxx.create_endpoint_from_worker_address(
                    self._ucxx.get_ucx_address_from_buffer(self.address), endpoint_error_handling=False)
            return self._self_endpoint

    def close(self) -> None:
        """Abort the loopback endpoint (idempotent); the endpoints to peers are their links'
        (``kpool_pd.connector.prefill.ucx_link``), closed with them."""
        if self._self_endpoint is not None:
            self._self_endpoint.abort(period=10**9)
            self._self_endpoint = None

