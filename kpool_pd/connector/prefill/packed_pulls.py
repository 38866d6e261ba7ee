"""PackedPull on the prefill node: the pulls a decode node starts together (one engine step's requests) served
as one batch, their bytes in one UCX message.

Every pull is checked as a Pull of its own (``PullDesk.checked``: the engine and its secret, the grant, the
transport, the plan against the grant) in one pass; a refused pull gets its own failure, with the status its
Pull would have ended with, and the others go on. The regions of the pulls served are copied to the offsets the
decode node's receives expect (every pull's regions back to back, in request order, each pull's in its plan's
order: a refused pull's span is zeros), into a buffer that holds only the pieces with a served byte
(``kpool_pd.connector.prefill.packed_message``: a refused pull's claimed bytes cost the node nothing), and go
out in the pieces the request names (each under UCX's eager limit: a message of several MiB goes by the rendezvous, several times
slower over TCP; in host memory each posted as soon as its bytes are copied) on an endpoint lent to the batch alone; the answer follows once they were sent, with a
PullDone for each pull served. The buffer is one the node kept from an earlier batch
(``kpool_pd.connector.shared.packed_staging``). Each grant served is read by the batch until it ends (``Grant.pulls_in_flight``); a batch that ends
before its send completed (its call cancelled, the deadline) stops the send and fails its pulls, and their
grants stay held for the decode node's Release or the lease, as a failed Pull's do. A batch that sent all is a
pull done for each of its grants (``PullDesk.on_pull_done``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.prefill.pulls import PullDesk
from kpool_pd.connector.prefill.served_plan import ServedPlan, served_plan
from kpool_pd.connector.prefill.ucx_link import UcxLink
from kpool_pd.connector.shared import hops, regions
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.prefill.packed_message import PackedMessage, pack_in_pieces
from kpool_pd.connector.shared.packed_staging import StagingBuffers
from kpool_pd.connector.shared.ucx import MAX_REGIONS, UcxSendError, region_tag
from kpool_pd.connector.shared.wire import Transport

logger = logging.getLogger(__name__)

MAX_PACKED_PULLS = 4096  # pulls in one batch (a step of a vLLM engine holds far fewer)
MAX_PACKED_BYTES = 1 << 31  # the one message's bytes (the decode node splits a larger step)
MAX_PIECE_BYTES = 1 << 24  # a piece's bytes (the decode node sends PIECE_BYTES, 1 MiB): bounds the zeroed piece


@dataclass(frozen=True)
class PackedPullServed:
    """One pull of a batch that sent all (what ``PullDesk.on_pull_done`` hears): its grant and plan."""

    grant: Grant
    plan: ServedPlan


@dataclass(frozen=True)
class _Accepted:
    index: int  # in the request
    grant: Grant
    plan: ServedPlan
    offset: int  # of its first region in the message
    integrity: bool


def _failure(grant_id: str, code: grpc.StatusCode, message: str) -> pb.PullSessionResponse:
    return pb.PullSessionResponse(grant_id=grant_id, failure=pb.PullFailure(code=code.value[0], message=message))


def _span(pull: pb.PullRequest) -> int:
    """The bytes a pull's regions take in the message (as the decode node laid its receive out)."""
    return sum(region.nbytes for region in pull.regions)


class PackedPullDesk:
    """Serves PackedPull calls with ``pulls``' checks, pool and metrics."""

    def __init__(self, pulls: PullDesk) -> None:
        self.pulls = pulls
        self.staging = StagingBuffers(pulls.pool.device)

    def _accept(self, request: pb.PackedPullRequest, results: list) -> tuple[list[_Accepted], UcxLink | None]:
        """The pulls that may go on (each with its offset) and the one link they share; the others' failures are
        put in ``results`` at their index."""
        desk, accepted, link, engine_id, offset, seen = self.pulls, [], None, "", 0, set()
        for index, pull in enumerate(request.pulls):
            here, offset = offset, offset + _span(pull)
            hops.stamp(pull.grant_id, "read")
            try:
                if pull.transport != Transport.UCX.value:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a packed pull is a UCX pull")
                if pull.ucx_tag_base != request.ucx_tag:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a packed pull's ucx_tag_base is its batch's "
                                      f"ucx_tag ({request.ucx_tag}), got {pull.ucx_tag_base}")
                if pull.grant_id in seen:
                    raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"grant {pull.grant_id!r} is pulled twice in "
                                      "one batch")
                seen.add(pull.grant_id)
                grant, _, pull_link = desk.checked(pull)
                if engine_id and pull.engine_id != engine_id:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"a batch is one engine's: {engine_id!r} "
                                      f"pulls first, this pull names {pull.engine_id!r}")
                if grant.computing:
                    raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"grant {pull.grant_id!r}'s prompt is "
                                      "still being computed: pull it with Pull or PullSession")
                plan = served_plan(desk.layout, grant, pull.regions)
            except StatusError as exc:
                results[index] = _failure(pull.grant_id, exc.code, exc.message)
                continue
            hops.stamp(grant.grant_id, "checked")
            engine_id, link = pull.engine_id, pull_link
            accepted.append(_Accepted(index, grant, plan, here, pull.integrity))
        return accepted, link

    def _spans(self, accepted: list[_Accepted]) -> list[tuple[int, torch.Tensor]]:
        """(offset in the message, view of the pool) of every accepted pull's regions, in the message's order."""
        pool, spans = self.pulls.pool, []
        for pull in accepted:
            at = pull.offset
            for region in pull.plan.regions:
                spans.append((at, regions.region_view(pool, region)))
                at += region.nbytes
        return spans

    async def answer(self, request: pb.PackedPullRequest) -> pb.PackedPullResponse:
        """The batch's outcome, one result a pull, once its message was sent; StatusError for a batch refused as a
        whole (too many pulls or bytes, no tag)."""
        count, total = len(request.pulls), sum(_span(pull) for pull in request.pulls)
        if count > MAX_PACKED_PULLS or total > MAX_PACKED_BYTES:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"a packed pull of {count} pulls and {total} bytes: "
                              f"at most {MAX_PACKED_PULLS} pulls and {MAX_PACKED_BYTES} bytes")
        if request.ucx_tag == 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "ucx_tag must be a random nonzero 64-bit value")
        if request.piece_bytes == 0 or -(-total // request.piece_bytes) > MAX_REGIONS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"piece_bytes {request.piece_bytes} cuts "
                              f"{total} bytes into more than {MAX_REGIONS} pieces (or none)")
        if request.piece_bytes > MAX_PIECE_BYTES:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"piece_bytes {request.piece_bytes}: at most "
                              f"{MAX_PIECE_BYTES}")
        results: list = [None] * count
        accepted, link = self._accept(request, results)
        if accepted:
            await self._send(request, accepted, link, total, results)
        return pb.PackedPullResponse(results=results)

    async def _send(self, request: pb.PackedPullRequest, accepted: list[_Accepted], link: UcxLink, total: int,
                    results: list) -> None:
        """Send the accepted pulls' message and put each one's PullDone (or, the send failing, its failure) in
        ``results``; the grants are read until this returns."""
        desk, config = self.pulls, self.pulls.config
        for pull in accepted:
            pull.grant.pulls_in_flight += 1
        started, endpoint, sent, finished = time.perf_counter(), None, [], False
        spans = self._spans(accepted)
        message = PackedMessage([(at, view.numel()) for at, view in spans], total, request.piece_bytes)
        buffer = self.staging.take(message.nbytes)
        try:
            try:
                endpoint = await link.lend()
                for pull in accepted:
                    hops.stamp(pull.grant.grant_id, "send")
                for index, (_, _, piece) in enumerate(pack_in_pieces(spans, message, buffer)):
                    sent.append(endpoint.post(piece, region_tag(request.ucx_tag, index)))
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*sent)), config.pull_budget_s(computing=False))
            except (UcxSendError, asyncio.TimeoutError) as exc:
                why = (f"UCX send did not complete before the pull's deadline" if isinstance(exc, asyncio.TimeoutError)
                       else str(exc))
                code = (grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, asyncio.TimeoutError)
                        else grpc.StatusCode.UNAVAILABLE)
                logger.warning("packed pull of %d grants by %s: %s", len(accepted), link.engine_id, why)
                for pull in accepted:
                    desk.metrics.failures.labels("pull_aborted").inc()
                    results[pull.index] = _failure(pull.grant.grant_id, code, why)
                return
            finished = True
            seconds = time.perf_counter() - started
            for pull in accepted:
                hops.stamp(pull.grant.grant_id, "sent")
                desk.metrics.transferred(Transport.UCX.label, pull.plan.total_bytes, len(pull.plan), seconds)
                checksums = (regions.back_to_back_crc32s(_served_span(message, buffer, pull),
                                                         [region.nbytes for region in pull.plan.regions])
                             if pull.integrity else [])
                results[pull.index] = pb.PullSessionResponse(grant_id=pull.grant.grant_id, response=pb.PullResponse(
                    done=pb.PullDone(bytes=pull.plan.total_bytes, regions=len(pull.plan), crc32=checksums,
                                     send_ms=seconds * 1000)))
        finally:
            if endpoint is not None:
                if not all(piece.done() for piece in sent):
                    endpoint.abort(reason="its packed pull ended before its sends completed")
                endpoint.give_back()  # after an abort: nothing to give back
            for piece in sent:
                piece.cancel()
                if piece.done() and not piece.cancelled():
                    piece.exception()  # retrieved: its outcome was read above, or the batch ended
            self.staging.give(buffer)  # no send reads it any more (an abort stopped those running)
            for pull in accepted:
                pull.grant.pulls_in_flight -= 1
                if finished and desk.on_pull_done is not None:
                    desk.on_pull_done(PackedPullServed(pull.grant, pull.plan))
            desk.grants.reap()


def _served_span(message: PackedMessage, buffer: torch.Tensor, pull: _Accepted) -> torch.Tensor:
    """``pull``'s bytes as sent (uint8 [its plan's bytes]): its pieces lie back to back in ``buffer``."""
    at = message.at(pull.offset) if pull.plan.total_bytes else 0
    return buffer[at:at + pull.plan.total_bytes]
