"""OpenAI request bodies as the two halves of a PD request: the prefill instance's (one token, no
stream, ``do_remote_decode``) and the decode instance's (the client's request with the prefill's
``kv_transfer_params``); what the router refuses before any instance sees it; and the errors the router
answers with, in OpenAI's error shape."""

from __future__ import annotations

import enum
import json
from http import HTTPStatus

from aiohttp import web

# Fields a one-token prefill must not carry: it does not stream, and it stops after one token.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens")


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"


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


def error_response(status: HTTPStatus, message: str, kind: str | None = None) -> web.Response:
    """OpenAI's error shape; ``kind`` defaults to invalid_request_error (4xx) or upstream_error (5xx)."""
    kind = kind or ("invalid_request_error" if status < 500 else "upstream_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": int(status)}}, status=status)


def _refused(message: str) -> RouterError:
    return RouterError(HTTPStatus.BAD_REQUEST, message)


def _single_prompt(prompt: object) -> object:
    """A completions ``prompt`` as one prompt: a batch of one is unwrapped; a batch of more is refused
    (vLLM returns the first prompt's kv_transfer_params alone, which no other prompt's decode may use)."""
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], (str, list)):
        return prompt  # a string, token ids, or what vLLM itself will refuse
    if len(prompt) > 1:
        raise _refused(f"'prompt' is a batch of {len(prompt)} prompts: the PD router takes one prompt per request "
                       "(send each prompt in a request of its own)")
    return prompt[0]


def parse_request(raw: bytes, endpoint: Endpoint) -> dict:
    """The client's JSON body, checked for what the router relies on, a one-prompt batch unwrapped;
    RouterError (400) saying what is wrong otherwise."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refused(f"the request body is not JSON: {error}") from None
    except RecursionError:
        raise _refused("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise _refused(f"the request body must be a JSON object, not {type(body).__name__}")
    if not isinstance(body.get("stream", False), bool):
        raise _refused(f"'stream' must be true or false, got {body['stream']!r}")
    if body.get("n", 1) not in (1, None):
        raise _refused(f"'n' must be 1 through the PD router (one prefill feeds one decode), got {body['n']!r}")
    if body.get("use_beam_search"):
        raise _refused("'use_beam_search' is not supported through the PD router (one prefill feeds one decode)")
    if body.get("best_of", 1) not in (1, None):
        raise _refused(f"'best_of' must be 1 through the PD router (one prefill feeds one decode), "
                       f"got {body['best_of']!r}")
    if endpoint is Endpoint.COMPLETIONS and "prompt" in body:
        body["prompt"] = _single_prompt(body["prompt"])
    return body


def streams(body: dict) -> bool:
    return bool(body.get("stream", False))


def prefill_body(body: dict, prefetch_by: str | None = None) -> dict:
    """The prefill instance's request: the client's, one token, no stream, its KV kept for a decode (announced to
    the decode instance of vLLM engine_id ``prefetch_by``, when given)."""
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    params = {"do_remote_decode": True} | ({"prefetch_by": prefetch_by} if prefetch_by else {})
    prefill |= {"max_tokens": 1, "stream": False, "kv_transfer_params": params}
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
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError) as error:
        raise ValueError(f"its answer is not a JSON object ({error})") from None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise ValueError(f"its answer carries no kv_transfer_params for a decode (got {params!r}): is it a "
                         "kv_producer?")
    return params
