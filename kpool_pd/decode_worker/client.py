"""A client of the Generate API: runs requests against a decode node and collects their results."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import grpc

from kpool_pd.connector import StatusError, TlsConfig, auth_metadata, open_channel
from kpool_pd.decode_worker import api
from kpool_pd.model.colocated import GenerateRequest, RequestResult


DEFAULT_REQUEST_TIMEOUT_S = 300.0  # one request's deadline, queueing on the decode node included


class RequestFailed(StatusError):
    """A request that ended with an error status; ``request_id`` names it."""

    def __init__(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.request_id}: {super().__str__()}"


async def model_info(address: str, *, token: str | None = None, tls: TlsConfig | None = None,
                     timeout_s: float = 10.0) -> dict:
    """The decode node's ModelInfo as a dict (grpc.aio.AioRpcError when the call fails)."""
    async with open_channel(address, tls) as channel:
        info = await api.GenerateServiceStub(channel).ModelInfo(api.ModelInfoRequest(), timeout=timeout_s,
                                                                 metadata=auth_metadata(token))
    return {"model": json.loads(info.model_json), "layout_hash": info.layout_hash,
            "max_prompt_tokens": info.max_prompt_tokens, "max_new_tokens": info.max_new_tokens,
            "vocab_size": info.vocab_size}


async def generate_one(stub: api.GenerateServiceStub, request: GenerateRequest, *, token: str | None,
                       timeout_s: float) -> RequestResult:
    """One request to completion (RequestFailed on an error status). ttft_ms is the client's
    own: sending to the first token received."""
    sent = time.perf_counter()
    tokens: list[int] = []
    started = finished = None
    ttft_ms = 0.0
    call = stub.Generate(api.GenerateRequest(request_id=request.request_id, prompt_token_ids=list(request.prompt),
                                             max_tokens=request.max_tokens,
                                             mrope_positions=[v for p in request.mrope_positions for v in p]),
                         timeout=timeout_s, metadata=auth_metadata(token))
    try:
        async for response in call:
            kind = response.WhichOneof("event")
            if kind == "started":
                started = response.started
            elif kind == "tokens":
                if not tokens:
                    ttft_ms = (time.perf_counter() - sent) * 1000
                tokens.extend(response.tokens.token_ids)
            elif kind == "finished":
                finished = response.finished
    except grpc.aio.AioRpcError as exc:
        raise RequestFailed(request.request_id, exc.code(), exc.details() or "") from None
    if started is None or finished is None:
        raise RequestFailed(request.request_id, grpc.StatusCode.INTERNAL, "stream ended without started/finished")
    return RequestResult(
        request_id=request.request_id, prompt_len=len(request.prompt), tokens=tuple(tokens),
        output_digest=finished.output_digest, state_digest=finished.state_digest,
        transfer_bytes=started.transfer_bytes, transfer_ms=started.transfer_ms, ttft_ms=ttft_ms,
        prefill_ms=started.prefill_ms, exposed_transfer_ms=started.exposed_transfer_ms,
        total_ms=(time.perf_counter() - sent) * 1000, steps=finished.steps,
        drafts_proposed=finished.drafts_proposed, drafts_accepted=finished.drafts_accepted,
        transport=started.transport, prefill_worker=started.prefill_address,
    )


async def generate_all(address: str, requests: Sequence[GenerateRequest], *, token: str | None = None,
                       tls: TlsConfig | None = None, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                       on_done: Callable[[RequestResult | RequestFailed], None] | None = None,
                       ) -> list[RequestResult | RequestFailed]:
    """Send every request at once, over TLS with ``tls``, each with a deadline of ``timeout_s`` seconds
    from its sending (one past it fails DEADLINE_EXCEEDED); results (or the failure) in request order."""
    async with open_channel(address, tls) as channel:
        stub = api.GenerateServiceStub(channel)

        async def one(request: GenerateRequest):
            try:
                result = await generate_one(stub, request, token=token, timeout_s=timeout_s)
            except RequestFailed as exc:
                result = exc
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(one(r) for r in requests)))
