"""End to end with MRoPE positions that differ by axis: prompts holding an image (time fixed while height and width
vary, then text continuing after the image's largest position) go through a prefill daemon and the decode daemons
(one per transport) with their positions on the Generate API, and every request equals its colocated run byte for
byte (tokens, output digest, state digest: the compressed rows, rotated at each group's first MRoPE position, and the
open group's ring rows with their packed positions).

The prefill daemon computes prompts in steps of 48 tokens, so chunk boundaries fall inside images and inside groups
(a straddling group's first position is read back from the ring's packed positions). The same prompts as text give
other state digests, so a daemon that dropped the positions would not match. The packing itself is checked against
the seed's in tests/model/test_mrope_positions.py (an engine's ring) and tests/workers/test_mrope_pull.py (the decode node's ring
after a pull). Malformed positions are refused by the decode daemon with INVALID_ARGUMENT naming the values.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.kvcache import CacheFamily
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, run_colocated
from tests.support.mrope_prompts import image_requests
from tests.e2e.test_e2e import TRANSPORTS, _flags, match_and_free, pd_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = ModelConfig.build(family=CacheFamily.QSA, num_layers=2, compress_ratio=4, num_spec=3, block_size=128,
                           cache_rope_positions=True, seed=5)
# (prompt length, image (at, rows, cols) or None for text, max tokens)
SHAPES = [(37, (3, 4, 5), 12), (130, (10, 8, 10), 20), (9, None, 6), (23, (0, 4, 4), 9), (300, (40, 12, 16), 7),
          (64, (1, 3, 3), 1), (6, (1, 1, 5), 10), (256, (129, 9, 11), 15)]


def test_mrope_prompts_through_the_daemons_equal_colocated(tmp_path):
    with pd_pair(tmp_path, _flags(CONFIG), prefill_extra=["--max-batch-tokens", "48"]) as (prefill, decodes):
        batches = {t: image_requests(SHAPES, vocab_size=CONFIG.vocab_size, seed=3 + i, prefix=f"{t}-")
                   for i, t in enumerate(TRANSPORTS)}
        references = {t: run_colocated(CONFIG, batches[t]) for t in TRANSPORTS}
        for t in TRANSPORTS:  # the positions change the bytes: as text, every image request's state differs
            as_text = run_colocated(CONFIG, [dataclasses.replace(r, mrope_positions=()) for r in batches[t]])
            for request, mrope, text in zip(batches[t], references[t], as_text):
                assert (mrope.state_digest == text.state_digest) is (not request.mrope_positions), request.request_id
        match_and_free(prefill, decodes, batches, references)

        bad = [GenerateRequest(request_id="count", prompt=(1, 2), max_tokens=2, mrope_positions=((0, 0, 0),)),
               GenerateRequest(request_id="negative", prompt=(1, 2), max_tokens=2,
                               mrope_positions=((0, 0, 0), (1, -5, 1)))]
        refused = asyncio.run(generate_all(f"127.0.0.1:{decodes[0].port}", bad))
        assert all(isinstance(r, RequestFailed) and r.code is grpc.StatusCode.INVALID_ARGUMENT for r in refused), refused
        assert "holds 3 values for a 2-token prompt" in refused[0].message
        assert "token 1: (1, -5, 1)" in refused[1].message
