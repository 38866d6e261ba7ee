"""The one check of a prompt, wherever one arrives (the Generate API, the prefill engine, the model's engine), and of
its MRoPE positions (``check_mrope_positions``)."""

from __future__ import annotations

from collections.abc import Sequence

from kpool_pd.kvcache import CacheConfig, CacheFamily

SHOWN_BAD_IDS = 5  # a message names at most this many bad ids


def check_prompt(prompt: Sequence[int], *, vocab_size: int, max_len: int | None = None) -> tuple[int, ...]:
    """``prompt`` as a tuple of ints: it must have 1 to ``max_len`` tokens (None: no upper limit), each an
    integer id in ``[0, vocab_size)``. ValueError naming the length and the limit, or the first bad ids and the
    vocabulary, otherwise (a caller turns it into its own status: INVALID_ARGUMENT on the wire)."""
    ids = tuple(prompt)
    if not ids or (max_len is not None and len(ids) > max_len):
        limit = f"1 to {max_len}" if max_len is not None else "at least 1"
        raise ValueError(f"prompt has {len(ids)} tokens; must have {limit}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}) (the vocabulary), got {bad[:SHOWN_BAD_IDS]}")
    return ids


MROPE_AXES = 3  # time, height, width
MAX_MROPE_POSITION = 2**31 - 1  # the largest position an axis may take (an int32, as vLLM's position tensors hold)
SHOWN_BAD_POSITIONS = 3  # a message names at most this many bad positions


def mrope_from_flat(values: Sequence[int], *, prompt_len: int) -> tuple[tuple[int, int, int], ...]:
    """The wire's flat MRoPE positions (time, height, width of token 0, then of token 1, ..; empty: text) as one
    triple a token. ValueError naming the count and the prompt's length where it is not 3 a token."""
    flat = tuple(values)
    if flat and len(flat) != MROPE_AXES * prompt_len:
        raise ValueError(f"mrope_positions holds {len(flat)} values for a {prompt_len}-token prompt: must be empty (text) "
                         f"or {MROPE_AXES} a token (time, height, width), {MROPE_AXES * prompt_len}")
    return tuple(tuple(flat[i:i + MROPE_AXES]) for i in range(0, len(flat), MROPE_AXES))


def check_mrope_positions(positions: Sequence[Sequence[int]], *, prompt_len: int,
                          cache: CacheConfig) -> tuple[tuple[int, int, int], ...]:
    """A prompt's MRoPE positions, one (time, height, width) a token, as a tuple of int triples; () where they are
    text (none given, or each token's three axes equal to its index). Each value must be an integer in
    ``[0, MAX_MROPE_POSITION]``; positions that are not text need a QSA cache that keeps them in its ring
    (``cache_rope_positions``: a group that closes later reads its first token's position there). ValueError naming
    the bad values, the count, or the cache, otherwise (INVALID_ARGUMENT on the wire)."""
    triples = tuple(tuple(p) for p in positions)
    if not triples:
        return ()
    if len(triples) != prompt_len:
        raise ValueError(f"mrope_positions give {len(triples)} positions for a {prompt_len}-token prompt (one a token)")
    bad = [(i, p) for i, p in enumerate(triples)
           if len(p) != MROPE_AXES or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_MROPE_POSITION
                                          for v in p)]
    if bad:
        shown = ", ".join(f"token {i}: {p}" for i, p in bad[:SHOWN_BAD_POSITIONS])
        raise ValueError(f"mrope_positions must be (time, height, width) integers in [0, {MAX_MROPE_POSITION}] each, "
                         f"got {shown}")
    if all(p == (i, i, i) for i, p in enumerate(triples)):
        return ()
    if cache.family is not CacheFamily.QSA or not cache.cache_rope_positions:
        raise ValueError(f"mrope_positions other than text need a QSA cache with cache_rope_positions; this model's is "
                         f"{cache.family.value} with cache_rope_positions={cache.cache_rope_positions}")
    return triples


def mrope_delta(positions: Sequence[Sequence[int]], prompt_len: int) -> int:
    """What a generated token adds to its index for its MRoPE position (every axis alike, as text after an image in
    Qwen2-VL's MRoPE): the prompt's largest position + 1 - its length; 0 for a text prompt (``()``)."""
    if not positions:
        return 0
    return max(max(p) for p in positions) + 1 - prompt_len
