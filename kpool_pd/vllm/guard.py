"""``KvTransferParamsGuard``: an ASGI middleware for a consumer's ``vllm serve`` that answers HTTP 400, naming
the field, for a request whose ``kv_transfer_params`` ask for a remote prefill and fail their checks
(``kpool_pd.transfer_params.DecodeParams``), before the request reaches the engine. Load it with vLLM's own flag::

    vllm serve MODEL --middleware kpool_pd.vllm.KvTransferParamsGuard --kv-transfer-config '{...kv_consumer...}'

Without it such a request still cannot harm the engine: the connector computes its prompt itself
(``kpool_pd.vllm.scheduler.ConsumerScheduler``); the guard makes the client's mistake the client's 400.
Only JSON bodies that mention ``kv_transfer_params`` are parsed; anything else passes through untouched,
bodies the guard cannot parse included (vLLM answers those itself). Which producers a consumer may dial is
checked in the engine (the guard does not know the consumer's settings).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kpool_pd.transfer_params import DecodeParams
from kpool_pd.vllm.rank_params import RankParams

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
MARKER = b"kv_transfer_params"


def params_error(body: bytes) -> str | None:
    """Why ``body``'s ``kv_transfer_params`` are refused, or None (no such params, params that ask for no
    remote prefill, good params, or a body that is not a JSON object: vLLM judges those itself)."""
    if MARKER not in body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict) or "kv_transfer_params" not in request:
        return None
    params = request["kv_transfer_params"]
    if params is None or (isinstance(params, dict) and not params.get("do_remote_prefill")):
        return None
    try:
        DecodeParams.parse(params)
        RankParams.parse(params)
    except ValueError as exc:
        return str(exc)
    return None


def _error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "kv_transfer_params",
                                 "code": 400}}).encode()


class KvTransferParamsGuard:
    """The middleware (Starlette builds it with the app it wraps)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        error = params_error(bytes(body))
        if error is not None:
            logger.warning("refused a request to %s: %s", scope.get("path"), error)
            payload = _error_body(error)
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replay = iter(messages)

        async def replayed() -> Message:
            message = next(replay, None)
            return message if message is not None else await receive()
        await self.app(scope, replayed, send)
