"""A prompt's MRoPE positions where they arrive: the check (one (time, height, width) a token, integers in range, only on
a QSA cache that keeps them in its ring), the wire's flat form, the delta a generated token adds, the Generate API's
INVALID_ARGUMENT naming the values, the prefill node's engine refusing before it allocates, and the ring's packed
positions after prefill and decode, checked against the seed's packing computed here (3 little-endian int64 at bf16
offset ceil(D / 4) * 4 of every head's row, DESIGN section 3)."""

from __future__ import annotations

import asyncio
import math
import struct

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import PrefillInput, PrefillProgress, StatusError
from kpool_pd.decode_worker import api
from kpool_pd.decode_worker.service import GenerateService
from kpool_pd.kvcache import CacheFamily, NodeCache
from kpool_pd.model import (DecodeSequence, Engine, ModelConfig, PrefillJob, check_mrope_positions, mrope_delta,
                            mrope_from_flat)
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine
from tests.support.mrope_prompts import image_prompt_positions

QSA = ModelConfig.build(family=CacheFamily.QSA, num_layers=2, compress_ratio=4, num_spec=3, block_size=64,
                        cache_rope_positions=True)
IMAGE = image_prompt_positions(12, 2, 2, 3)  # text, text, a 2 x 3 image at time 2, then text from 5


def test_image_positions_pass_and_text_positions_are_text():
    assert check_mrope_positions(IMAGE, prompt_len=12, cache=QSA.cache) == IMAGE
    assert IMAGE[2:8] == ((2, 2, 2), (2, 2, 3), (2, 2, 4), (2, 3, 2), (2, 3, 3), (2, 3, 4))
    text = tuple((i, i, i) for i in range(5))
    assert check_mrope_positions(text, prompt_len=5, cache=QSA.cache) == ()
    assert check_mrope_positions((), prompt_len=5, cache=QSA.cache) == ()


@pytest.mark.parametrize("positions, message", [
    (((0, 0, 0),), "mrope_positions give 1 positions for a 2-token prompt"),
    (((0, 0, 0), (1, -1, 1)), r"integers in \[0, 2147483647\] each, got token 1: \(1, -1, 1\)"),
    (((0, 0), (1, 1, 1)), r"got token 0: \(0, 0\)"),
    (((0, 0, 2**31), (1, 1, True)), r"got token 0: \(0, 0, 2147483648\), token 1: \(1, 1, True\)"),
    (((0, 0, 0), (1, 1.5, 1)), r"token 1: \(1, 1.5, 1\)"),
], ids=["count", "negative", "two-axes", "too-large-and-bool", "float"])
def test_malformed_positions_are_refused_naming_the_values(positions, message):
    with pytest.raises(ValueError, match=message):
        check_mrope_positions(positions, prompt_len=2, cache=QSA.cache)


@pytest.mark.parametrize("cache, named", [
    (ModelConfig.build(family=CacheFamily.QSA, num_layers=1).cache, "qsa with cache_rope_positions=False"),
    (ModelConfig.build(family=CacheFamily.KPOOL, num_layers=1).cache, "kpool with cache_rope_positions=False"),
], ids=["qsa-without-cached-positions", "kpool"])
def test_positions_other_than_text_need_a_cache_that_keeps_them(cache, named):
    with pytest.raises(ValueError, match=f"need a QSA cache with cache_rope_positions; this model's is {named}"):
        check_mrope_positions(IMAGE, prompt_len=12, cache=cache)


def test_the_wire_form_is_three_values_a_token():
    flat = [v for p in IMAGE for v in p]
    assert mrope_from_flat(flat, prompt_len=12) == IMAGE
    assert mrope_from_flat([], prompt_len=12) == ()
    with pytest.raises(ValueError, match="holds 35 values for a 12-token prompt: must be empty .* or 3 a token"):
        mrope_from_flat(flat[:-1], prompt_len=12)


def test_a_generated_token_continues_after_the_prompts_largest_position():
    assert IMAGE[-1] == (8, 8, 8) and mrope_delta(IMAGE, 12) == 8 + 1 - 12  # the 13th token at (9, 9, 9)
    assert mrope_delta((), 40) == 0


class _Scheduler:
    """What GenerateService._validate reads of its scheduler."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config


@pytest.mark.parametrize("flat, message", [
    ([0, 0, 0, 1, 1], "holds 5 values for a 2-token prompt"),
    ([0, 0, 0, 1, -4, 1], r"got token 1: \(1, -4, 1\)"),
], ids=["count", "negative"])
def test_the_generate_api_answers_invalid_argument_naming_the_values(flat, message):
    service = GenerateService(_Scheduler(QSA), max_prompt_tokens=64, max_new_tokens=8, step_timeout_s=1.0)
    request = api.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=4, mrope_positions=flat)
    with pytest.raises(StatusError, match=message) as raised:
        service._validate(request)
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
    good = api.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=4, mrope_positions=[0, 0, 0, 1, 1, 2])
    assert service._validate(good) == ("r", (1, 2), ((0, 0, 0), (1, 1, 2)))


def test_the_prefill_engine_refuses_bad_positions_before_it_allocates():
    cache = NodeCache(QSA.cache, num_blocks=4, num_rings=2)
    batcher = BatchingPrefillEngine(Engine(QSA, cache.pool), cache, max_batch_tokens=64, max_queue=4,
                                    registry=CollectorRegistry())
    request = PrefillInput(request_id="r", prompt_token_ids=(1, 2), mrope_positions=(0, 0, 0, 1, 1, 99999999999))
    with pytest.raises(ValueError, match=r"token 1: \(1, 1, 99999999999\)"):
        asyncio.run(batcher.prefill(request, PrefillProgress("r")))
    assert cache.free_blocks == 4


def seed_packing(position: tuple[int, int, int]) -> bytes:
    """The seed's packed position: 3 int64, little end first (what its ring row holds at bf16 offset ceil(D/4)*4)."""
    return struct.pack("<3q", *position)


def test_the_ring_holds_each_tokens_position_packed_as_the_seed_packs_it():
    """Image prompts prefilled in chunks (a chunk boundary inside a group and inside the image), then decoded with
    drafts: every ring row of a recent committed position holds that token's MRoPE position, packed as the seed packs
    it, in every head of every layer (a generated token's: its index plus the prompt's delta on every axis)."""
    cache = NodeCache(QSA.cache, num_blocks=12, num_rings=3)
    engine = Engine(QSA, cache.pool)
    prompts = [(37, image_prompt_positions(37, 3, 4, 5)), (23, image_prompt_positions(23, 0, 4, 4)), (9, ())]
    seqs, allocations = [], []
    for i, (length, positions) in enumerate(prompts):
        allocation = cache.allocate(f"r{i}", QSA.cache.blocks_for_request(length, 12))
        allocations.append(allocation)
        prompt = [(13 * i + 5 * j) % QSA.vocab_size for j in range(length)]
        cut = length // 2 + 1  # two chunks
        engine.prefill([PrefillJob(prompt=prompt, block_ids=allocation.block_ids, ring_id=allocation.ring_id,
                                   end=cut, mrope_positions=positions)])
        first = engine.prefill([PrefillJob(prompt=prompt, block_ids=allocation.block_ids, ring_id=allocation.ring_id,
                                           start=cut, mrope_positions=positions)])[0]
        seqs.append(DecodeSequence(request_id=f"r{i}", prompt_len=length, max_tokens=12, allocation=allocation,
                                   output=[first], mrope_delta=mrope_delta(positions, length)))
    try:
        check_ring_positions(engine, seqs, prompts)  # after prefill
        for _ in range(3):
            engine.decode_step(seqs)
            check_ring_positions(engine, seqs, prompts)
    finally:
        for allocation in allocations:
            allocation.release()


def check_ring_positions(engine: Engine, seqs: list[DecodeSequence], prompts, *, pulled: bool = False) -> None:
    """Every ring row of a recent committed position holds that token's position, packed as the seed packs it.
    ``pulled``: the ring came by transfer, which moves only the prompt's open group (the rows before it are not
    the decode node's)."""
    head_size, capacity, ratio = 128, QSA.cache.ring_slots, QSA.cache.compress_ratio  # D, C, r of the model
    offset_bytes = 2 * math.ceil(head_size / 4) * 4
    for seq, (length, positions) in zip(seqs, prompts):
        delta = mrope_delta(positions, length)
        # a step's rejected drafts, past the committed length, rewrite the rows of positions C back: the last C -
        # num_spec committed positions (the open group among them) hold their own
        first = max(0, seq.cached - capacity + QSA.cache.num_spec, length // ratio * ratio if pulled else 0)
        for pos in range(first, seq.cached):
            want = positions[pos] if pos < len(positions) else (pos if pos < length else pos + delta,) * 3
            for layer in range(QSA.num_layers):
                row = engine.pool.qsa_ring(layer)[seq.ring_id, pos % capacity]  # [H, W] bf16
                raw = row.contiguous().view(torch.uint8).numpy()
                for head in range(row.shape[0]):
                    got = raw[head, offset_bytes:offset_bytes + 24].tobytes()
                    assert got == seed_packing(want), f"{seq.request_id} position {pos} layer {layer} head {head}"
