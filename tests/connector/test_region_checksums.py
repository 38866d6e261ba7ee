"""The crc32s of regions laid back to back in one span (``regions.back_to_back_crc32s``): what a PackedPull's
prefill node states for each served region and a decode node's prefetch checks, each against zlib over the
region's own bytes."""

from __future__ import annotations

import zlib

import torch

from kpool_pd.connector.shared import regions


def test_each_region_of_a_span_gets_its_own_crc32():
    span = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    sizes = [1, 0, 255, 600]
    raw, at, want = span.numpy().tobytes(), 0, []
    for nbytes in sizes:
        want.append(zlib.crc32(raw[at:at + nbytes]) & 0xFFFFFFFF)
        at += nbytes
    assert regions.back_to_back_crc32s(span, sizes) == want
    assert regions.back_to_back_crc32s(span, []) == []
