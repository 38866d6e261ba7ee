"""The public Generate API (kpoolpd.v1.GenerateService) of the decode node: validates each request,
drives it through the scheduler, and streams its events."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

import grpc

from kpool_pd.connector import Credential, StatusError
from kpool_pd.decode_worker import api
from kpool_pd.decode_worker.jobs import Failed, Finished, JobEvent, Tokens
from kpool_pd.decode_worker.scheduler import DecodeScheduler
from kpool_pd.model import check_mrope_positions, check_prompt, mrope_from_flat

logger = logging.getLogger(__name__)

MAX_ID_CHARS = 256


class GenerateService(api.GenerateServiceServicer):
    """Registered on the daemon's gRPC server (``add_to_server``), which requires the client token
    on it; one event loop. ``draining = True`` refuses new requests with UNAVAILABLE; requests in
    flight finish. A request without an id gets a random one (``secrets.token_hex(8)``): nothing
    a client reads names the decode node's engine id, which its grants on prefill nodes are bound to."""

    def __init__(self, scheduler: DecodeScheduler, *, max_prompt_tokens: int, max_new_tokens: int,
                 step_timeout_s: float) -> None:
        self.scheduler = scheduler
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.step_timeout_s = step_timeout_s
        self.draining = False

    service_name = api.SERVICE_NAME
    credential = Credential.CLIENT

    def add_to_server(self, server: grpc.aio.Server) -> None:
        api.add_GenerateServiceServicer_to_server(self, server)

    def _validate(self, request: api.GenerateRequest) -> tuple[str, tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """The request's id, prompt and MRoPE positions (() for text); StatusError INVALID_ARGUMENT naming what is
        wrong."""
        config = self.scheduler.config
        request_id = request.request_id or secrets.token_hex(8)
        if len(request_id) > MAX_ID_CHARS or not request_id.isprintable():
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id must be 1 to {MAX_ID_CHARS} printable characters")
        try:
            prompt = check_prompt(request.prompt_token_ids, vocab_size=config.vocab_size, max_len=self.max_prompt_tokens)
            positions = check_mrope_positions(mrope_from_flat(request.mrope_positions, prompt_len=len(prompt)),
                                              prompt_len=len(prompt), cache=config.cache)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if not 1 <= request.max_tokens <= self.max_new_tokens:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"max_tokens is {request.max_tokens}; must be 1 to {self.max_new_tokens}")
        return request_id, prompt, positions

    async def Generate(self, request: api.GenerateRequest, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode node is draining; try another")
        scheduler = self.scheduler
        job, outcome = None, "cancelled"
        try:
            request_id, prompt, positions = self._validate(request)
            job = scheduler.submit(request_id, prompt, request.max_tokens, mrope_positions=positions)
            await scheduler.wait_admitted(job)
            queue_ms = job.elapsed_ms()
            await scheduler.fetch(job)
            landed = job.landed
            yield api.GenerateResponse(started=api.GenerateStarted(
                request_id=request_id, prefill_address=job.prefill_address, prefill_engine_id=job.prefill_engine_id,
                transport=landed.transport.label, transfer_bytes=job.transfer_bytes, transfer_regions=job.transfer_regions,
                transfer_ms=job.transfer_ms, queue_ms=queue_ms, prefill_ms=landed.times.prefill_ms,
                exposed_transfer_ms=landed.times.exposed_transfer_ms))
            yield api.GenerateResponse(tokens=api.GenerateTokens(token_ids=job.seq.output[:1]))
            scheduler.first_token_sent(job)
            if job.seq.finished:
                await scheduler.finish_unstarted(job)
            else:
                scheduler.start_decoding(job)
            while True:
                try:
                    event: JobEvent = await asyncio.wait_for(job.events.get(), self.step_timeout_s)
                except asyncio.TimeoutError:
                    raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no decode step finished within {self.step_timeout_s} s") from None
                match event:
                    case Tokens(token_ids=token_ids):
                        yield api.GenerateResponse(tokens=api.GenerateTokens(token_ids=token_ids))
                    case Failed(error=error):
                        raise error
                    case Finished():
                        outcome = "ok"
                        yield api.GenerateResponse(finished=_finished_message(event))
                        return
        except StatusError as exc:
            outcome = "rejected" if job is None else "failed"
            if job is None:  # refused before it was queued: counted here, once (a full queue as queue_full)
                full = exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                scheduler.requests.labels("queue_full" if full else "rejected").inc()
            shown = (request.request_id or "(unnamed)")[:64]
            logger.warning("request %s: %s", shown, exc, extra={"request_id": shown, "code": exc.code.name})
            await context.abort(exc.code, exc.message)
        finally:
            if job is not None:
                scheduler.abandon(job, outcome)

    async def ModelInfo(self, request: api.ModelInfoRequest, context) -> api.ModelInfoResponse:
        config = self.scheduler.config
        return api.ModelInfoResponse(
            model_json=json.dumps(config.describe(), sort_keys=True),
            layout_hash=self.scheduler.engine.pool.layout.layout_hash, max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.max_new_tokens, vocab_size=config.vocab_size)


def _finished_message(event: Finished) -> api.GenerateFinished:
    return api.GenerateFinished(
        output_digest=event.output_digest, state_digest=event.state_digest, num_tokens=event.num_tokens,
        steps=event.steps, drafts_proposed=event.drafts_proposed, drafts_accepted=event.drafts_accepted,
        ttft_ms=event.ttft_ms, total_ms=event.total_ms)
