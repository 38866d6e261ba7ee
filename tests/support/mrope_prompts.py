"""Prompts whose MRoPE positions differ by axis: text, an image (time fixed while height and width vary), then text
that continues after the image's largest position, as Qwen2-VL lays out a multimodal prompt."""

from __future__ import annotations

import torch

from kpool_pd.model.colocated import GenerateRequest


def image_prompt_positions(prompt_len: int, image_at: int, rows: int, cols: int) -> tuple[tuple[int, int, int], ...]:
    """Text up to ``image_at``, an image of ``rows`` x ``cols`` tokens at time ``image_at`` (height ``image_at + r``,
    width ``image_at + c``), then text from the image's largest position + 1, ``prompt_len`` tokens in all."""
    if image_at + rows * cols > prompt_len:
        raise ValueError(f"an image of {rows} x {cols} tokens at {image_at} does not fit {prompt_len} tokens")
    positions = [(i, i, i) for i in range(image_at)]
    positions += [(image_at, image_at + r, image_at + c) for r in range(rows) for c in range(cols)]
    after = max((max(p) for p in positions), default=-1) + 1
    positions += [(after + i,) * 3 for i in range(prompt_len - len(positions))]
    return tuple(positions)


def image_requests(shapes, *, vocab_size: int, seed: int = 11, prefix: str = "img") -> list[GenerateRequest]:
    """One request per ``(prompt_len, image, max_tokens)`` of ``shapes``; ``image``: (at, rows, cols) or None (text)."""
    gen = torch.Generator().manual_seed(seed)
    return [GenerateRequest(request_id=f"{prefix}{i}", max_tokens=max_tokens,
                            prompt=tuple(torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist()),
                            mrope_positions=image_prompt_positions(prompt_len, *image) if image else ())
            for i, (prompt_len, image, max_tokens) in enumerate(shapes)]
