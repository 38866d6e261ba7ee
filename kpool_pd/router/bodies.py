"""OpenAI request bodies as the two halves of a PD request: the prefill instance's (one token, no
stream, ``do_remote_decode``) and the decode instance's (the client's request with the prefill's
``kv_transfer_params``); and the errors the router answers with, in OpenAI's error shape."""

from __future__ import annotations

import json
from http import HTTPStatus

from aiohttp import web

# Fields a one-token prefill must not carry: it does not stream, and it stops after one token.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens")


class RouterError(Exception):
    """A request the router answers itself: ``status`` and a message for the client."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> web.Response:
        return error_response(self.status, self.message)


class InstanceRefused(Exception):
    """An instance answered 4xx: the request itself is wrong there; the client gets that answer as it is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type=self.content_type)


def error_response(status: HTTPStatus, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": int(status)}}, status=status)


def parse_request(raw: bytes) -> dict:
    """The client's JSON body, checked for what the router relies on; RouterError (400) otherwise."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RouterError(HTTPStatus.BAD_REQUEST, f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise RouterError(HTTPStatus.BAD_REQUEST, f"the request body must be a JSON object, not {type(body).__name__}")
    if not isinstance(body.get("stream", False), bool):
        raise RouterError(HTTPStatus.BAD_REQUEST, f"'stream' must be true or false, got {body['stream']!r}")
    if body.get("n", 1) not in (1, None):
        raise RouterError(HTTPStatus.BAD_REQUEST,
                          f"'n' must be 1 through the PD router (one prefill feeds one decode), got {body['n']!r}")
    return body


def streams(body: dict) -> bool:
    return bool(body.get("stream", False))


def prefill_body(body: dict) -> dict:
    """The prefill instance's request: the client's, one token, no stream, its KV kept for a decode."""
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    prefill |= {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The decode instance's request: the client's, with the prefill's ``kv_transfer_params``."""
    return body | {"kv_transfer_params": kv_transfer_params}


def kv_transfer_params_of(answer: bytes) -> dict:
    """The ``kv_transfer_params`` of a prefill instance's answer; ValueError saying what is wrong."""
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"its answer is not a JSON object ({error})") from None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise ValueError(f"its answer carries no kv_transfer_params for a decode (got {params!r}): is it a "
                         "kv_producer?")
    return params
