"""The QSA metadata builder (kernels.qsa_metadata.builder) and the uniform-decode split
(kernels.qsa_metadata.split): mixed prefill/decode batches with drafts, forward after forward into
the same buffers, against the reference maps and split counts known from how each batch was made.
The CUDA rows (and a padded bucket replayed from a CUDA graph) run from tests/gpu/test_qsa_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kernels.qsa_metadata import BatchSplit, split_uniform_decodes
from kpool_pd.kernels.qsa_metadata import ref as metadata_ref
from kpool_pd.kernels.qsa_metadata.builder import QsaMetadataBuilder
from tests.support.kernel_backends import ALL_BACKENDS, Backend, make_backend

MAPS = ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping", "compressed_slot_mapping",
        "k_work", "num_work")


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def offsets(query_lens: list[int]) -> torch.Tensor:
    return i32([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()])


def split_of(query_lens: list[int], seq_lens: list[int], threshold: int) -> BatchSplit:
    return split_uniform_decodes(offsets(query_lens), i32(seq_lens), decode_threshold=threshold)


@pytest.mark.parametrize("query_lens, threshold, decodes, decode_tokens, decode_query_len", [
    ([4, 4, 4, 1, 7], 4, 3, 12, 4),  # three decode steps with three drafts, then a 1-token and a 7-token chunk
    ([1, 1, 4], 4, 2, 2, 1),  # steps without drafts first: the 4-token step differs, so it counts as a prefill
    ([5, 4, 4], 4, 0, 0, 0),  # the first request is longer than the threshold: all prefills
    ([1, 1, 1], 1, 3, 3, 1),  # plain decode
    ([2, 2], 1, 0, 0, 0),  # two tokens are a prefill at threshold 1
    ([0, 1, 1], 4, 0, 0, 0),  # an idle first request: no decodes
    ([1, 0, 1], 4, 1, 1, 1),  # an idle request ends the decodes
    ([], 4, 0, 0, 0),
])
def test_split_hand_examples(query_lens, threshold, decodes, decode_tokens, decode_query_len):
    seq_lens = [q + 10 * i for i, q in enumerate(query_lens)]
    split = split_of(query_lens, seq_lens, threshold)
    tokens = sum(query_lens)
    assert split == BatchSplit(num_decodes=decodes, num_decode_tokens=decode_tokens,
                               num_prefills=len(query_lens) - decodes, num_prefill_tokens=tokens - decode_tokens,
                               max_query_len=max(query_lens, default=0), decode_query_len=decode_query_len,
                               max_seq_len=max(seq_lens, default=0), num_actual_tokens=tokens)
    assert split.num_requests == len(query_lens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.integers(1, 8))
def test_split_properties(query_lens, threshold):
    split = split_of(query_lens, [q + 3 for q in query_lens], threshold)
    decodes = query_lens[:split.num_decodes]
    assert split.num_decodes + split.num_prefills == len(query_lens)
    assert split.num_decode_tokens == sum(decodes) == split.num_decodes * split.decode_query_len
    assert split.num_decode_tokens + split.num_prefill_tokens == sum(query_lens) == split.num_actual_tokens
    assert all(q == split.decode_query_len and 1 <= q <= threshold for q in decodes)  # uniform decodes
    following = query_lens[split.num_decodes] if split.num_prefills else None
    assert following is None or following != split.decode_query_len or not decodes  # the run is maximal
    if query_lens and 1 <= query_lens[0] <= threshold:
        assert split.num_decodes >= 1


@pytest.mark.parametrize("args, kwargs, match", [
    ((i32([0, 1]), i32([1])), {"decode_threshold": 0}, "decode_threshold must be an integer >= 1, got 0"),
    ((i32([0, 1]), i32([1])), {"decode_threshold": True}, "decode_threshold"),
    ((i32([0, 1]), i32([1, 2])), {"decode_threshold": 1}, "holds 2 offsets for 2 requests"),
    ((torch.tensor([0.0, 1.0]), i32([1])), {"decode_threshold": 1}, "query_start_loc_cpu must be a 1-D integer CPU"),
    ((i32([0, 1]), i32([[1]])), {"decode_threshold": 1}, "seq_lens_cpu must be a 1-D integer CPU"),
])
def test_split_refuses_what_is_not_a_batch(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_uniform_decodes(*args, **kwargs)


def mixed_batch(seed: int, *, decodes: int, prefills: int, num_spec: int, block_size: int, max_len: int):
    """Decode steps first (the last committed token and ``num_spec`` drafts each), then prefill chunks
    of any other length (1 to 40 tokens), at random positions, tables and rings.

    # -> (query_start_loc [B + 1], seq_lens [B], block_table [B, M], ring_blocks [B]) int32, all CPU
    """
    rng = random.Random(seed)
    step = 1 + num_spec
    query_lens = [step] * decodes + [rng.choice([q for q in range(1, 41) if q != step]) for _ in range(prefills)]
    seq_lens = [rng.randint(q, max_len) for q in query_lens]
    columns = -(-max_len // block_size)
    table = torch.randperm(len(query_lens) * columns, generator=torch.Generator().manual_seed(seed))
    rings = rng.sample(range(2 * len(query_lens)), len(query_lens))
    return offsets(query_lens), i32(seq_lens), table.view(len(query_lens), columns).to(torch.int32), i32(rings)


GEOMETRY = {"compress_ratio": 4, "ring_capacity": 8, "block_size": 64}


def make_builder(backend: Backend, *, num_spec: int = 3, tokens: int = 512, seqs: int = 32) -> QsaMetadataBuilder:
    return QsaMetadataBuilder(**GEOMETRY, num_spec=num_spec, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                              device=backend.device)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("num_spec", [0, 3])
def test_builder_matches_the_reference_forward_after_forward_in_the_same_buffers(backend, num_spec):
    builder = make_builder(backend, num_spec=num_spec)
    addresses = {name: buffer.data_ptr() for name, buffer in builder.buffers.items()}
    shapes = [(7, 5), (2, 0), (0, 4), (12, 3), (1, 1)]  # (decodes, prefills): mixed, decode only, prefill only
    for seed, (decodes, prefills) in enumerate(shapes):
        batch = mixed_batch(seed, decodes=decodes, prefills=prefills, num_spec=num_spec, block_size=64, max_len=600)
        qsl, seq = batch[0], batch[1]
        got = builder.build(*(t.to(backend.device) for t in batch), query_start_loc_cpu=qsl, seq_lens_cpu=seq)
        want = metadata_ref.build_qsa_metadata(*batch, **GEOMETRY)
        for name in MAPS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.device == backend.device and a.dtype == b.dtype and torch.equal(a.cpu(), b), (seed, name)
            assert a.data_ptr() == addresses[name], f"{name} is not in the builder's buffer"
        step = 1 + num_spec
        query_lens = (qsl[1:] - qsl[:-1]).tolist()
        assert got.split == BatchSplit(
            num_decodes=decodes, num_decode_tokens=decodes * step, num_prefills=prefills,
            num_prefill_tokens=sum(query_lens) - decodes * step, max_query_len=max(query_lens),
            decode_query_len=step if decodes else 0, max_seq_len=int(seq.max()), num_actual_tokens=sum(query_lens))
    assert {name: buffer.data_ptr() for name, buffer in builder.buffers.items()} == addresses


@pytest.mark.parametrize("backend", ALL_BACKENDS[:1], indirect=True)
def test_builder_refuses_a_batch_it_cannot_hold(backend):
    builder = make_builder(backend, tokens=64, seqs=4)
    batch = mixed_batch(1, decodes=3, prefills=2, num_spec=3, block_size=64, max_len=300)  # 5 requests
    with pytest.raises(ValueError, match="5 requests exceeds the builder's max_num_batched_tokens 64 or max_num_seqs 4"):
        builder.build(*batch, query_start_loc_cpu=batch[0], seq_lens_cpu=batch[1])
    small = mixed_batch(2, decodes=2, prefills=1, num_spec=3, block_size=64, max_len=300)
    with pytest.raises(ValueError, match=r"num_tokens 3 < the batch's \d+ tokens"):
        builder.build(*small, query_start_loc_cpu=small[0], seq_lens_cpu=small[1], num_tokens=3)
    with pytest.raises(ValueError, match="seq_lens_cpu holds 5 requests"):  # more than the device batch holds
        builder.build(*small, query_start_loc_cpu=batch[0], seq_lens_cpu=batch[1])
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        QsaMetadataBuilder(**GEOMETRY, num_spec=0, max_num_batched_tokens=8, max_num_seqs=0, device="cpu")
    with pytest.raises(ValueError, match="num_spec must be an integer >= 0"):
        QsaMetadataBuilder(**GEOMETRY, num_spec=-1, max_num_batched_tokens=8, max_num_seqs=1, device="cpu")
