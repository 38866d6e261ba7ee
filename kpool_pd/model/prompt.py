"""The one check of a prompt, wherever one arrives (the Generate API, the prefill engine, the model's engine)."""

from __future__ import annotations

from collections.abc import Sequence

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
