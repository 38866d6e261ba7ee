"""Prefix affinity: what a request's prompt weighs, the hashes of its block-aligned prefixes, and a bounded
table of the instance each prefix was last routed to.

The router does not tokenize. A prompt given as token ids is cut into blocks of ``block_tokens`` ids; a
prompt given as text (a completions string, or a chat request's messages as canonical JSON) into blocks of
``CHARS_PER_TOKEN * block_tokens`` UTF-8 bytes, and its token count is estimated at ``CHARS_PER_TOKEN``
bytes a token. Block ``i``'s hash covers blocks ``0..i`` (each chains the previous one's, as vLLM's prefix
cache keys do), so a hash names a whole prefix and two prompts share a hash only when they share everything
up to it; only complete blocks are hashed.

``PrefixTable`` keeps at most ``capacity`` hashes, each with the instance its prefix went to last; the least
recently used go first. ``match`` finds the longest prefix of a prompt in the table.
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # the estimate of a text prompt's bytes per token
_DIGEST_BYTES = 8


@dataclass(frozen=True)
class PromptShape:
    """What routing needs of a request: its prompt's tokens (counted or estimated), the tokens its answer may
    add (``max_tokens``, 0 when not given), and the hashes of its complete block-aligned prefixes, shortest
    first."""

    prompt_tokens: int
    output_tokens: int = 0
    prefix_hashes: tuple[bytes, ...] = ()

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def _chained(pieces: list[bytes]) -> tuple[bytes, ...]:
    hashes, previous = [], b""
    for piece in pieces:
        previous = hashlib.blake2b(previous + piece, digest_size=_DIGEST_BYTES).digest()
        hashes.append(previous)
    return tuple(hashes)


def _prompt_units(body: dict) -> tuple[list[int] | None, bytes]:
    """The prompt as token ids (or None) and as bytes (empty for ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), b""
    if isinstance(prompt, str):
        return None, prompt.encode()
    messages = body.get("messages")
    if messages is not None:
        return None, json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return None, b""


def _output_tokens(body: dict) -> int:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def prompt_shape(body: dict, block_tokens: int) -> PromptShape:
    """The shape of a completions or chat completions ``body`` (as ``bodies.parse_request`` left it)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    ids, text = _prompt_units(body)
    if ids is not None:
        whole = len(ids) // block_tokens
        pieces = [b",".join(str(t).encode() for t in ids[i * block_tokens:(i + 1) * block_tokens])
                  for i in range(whole)]
        return PromptShape(len(ids), _output_tokens(body), _chained(pieces))
    step = CHARS_PER_TOKEN * block_tokens
    pieces = [text[i:i + step] for i in range(0, len(text) - step + 1, step)]
    return PromptShape(-(-len(text) // CHARS_PER_TOKEN), _output_tokens(body), _chained(pieces))


class PrefixTable:
    """Prefix hash -> the instance (URL) its prefix was routed to last; at most ``capacity`` hashes, the
    least recently used dropped first. One event loop."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"prefix table capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._owner: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, hashes: tuple[bytes, ...]) -> tuple[str | None, int]:
        """The instance that served the longest prefix of ``hashes`` in the table and that prefix's length in
        blocks; (None, 0) when none is known."""
        for depth in range(len(hashes), 0, -1):
            url = self._owner.get(hashes[depth - 1])
            if url is not None:
                return url, depth
        return None, 0

    def record(self, hashes: tuple[bytes, ...], url: str) -> None:
        """``url`` now serves every prefix of ``hashes`` (each becomes the most recently used)."""
        for digest in hashes:
            self._owner[digest] = url
            self._owner.move_to_end(digest)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
