"""The QSA metadata builder's Triton kernel against its torch reference, each body once, on every
backend that runs kernels: Triton's CPU interpreter here, compiled on CUDA through
tests/gpu/test_qsa_gpu.py (tests/support/kernel_backends.py). Rule: identical (integer moves only); the
kernel pads the tokens past the last request, and checks the values on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels import build_qsa_metadata
from kpool_pd.kernels.qsa_metadata import ref as metadata_ref
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


METADATA_CASES = {
    # (q_lens, seq_lens, r, C, block_size)
    "prefill-longer-than-ring-and-decode": ([10, 4], [10, 7], 4, 8, 8),
    "single-token": ([1], [1], 4, 8, 8),
    "empty-request-between": ([3, 0, 5], [9, 4, 5], 2, 4, 8),
    "drafts-cross-groups": ([4, 4, 4, 4], [13, 16, 4, 30], 4, 8, 16),
    "r1": ([5, 1], [5, 9], 1, 4, 4),
    "r3-odd": ([7, 2, 1], [20, 6, 3], 3, 6, 12),
}


def _metadata_args(q_lens, seq_lens, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = max(-(-s // block_size) for s in seq_lens)
    table = torch.randperm(len(seq_lens) * blocks + 3, generator=gen)[:len(seq_lens) * blocks]
    starts = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    rings = torch.randperm(len(seq_lens) + 2, generator=gen)[:len(seq_lens)]
    return (starts, torch.tensor(seq_lens, dtype=torch.int32), table.view(len(seq_lens), blocks).to(torch.int32),
            rings.to(torch.int32))


FIELDS = ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping", "compressed_slot_mapping",
          "k_work", "num_work")


def random_metadata_inputs(requests: int, seed: int, *, block_size: int, max_len: int, max_q: int):
    """A random batch: prefill chunks, decode steps (every 5th request) and idle requests (every 11th from 3)."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, max_len, (requests,), generator=gen)
    q_lens = torch.minimum(torch.randint(0, max_q, (requests,), generator=gen), seq)
    q_lens[::5] = 1  # decode steps
    q_lens[3::11] = 0  # idle requests
    cols = -(-max_len // block_size)
    table = torch.randperm(requests * cols, generator=gen).view(requests, cols).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    rings = torch.randperm(requests, generator=gen).to(torch.int32)
    return (starts, seq.to(torch.int32), table, rings), int(q_lens.sum())


RANDOM_METADATA = {"random-r4-C8": (4, 8), "random-r1-C4": (1, 4), "random-r3-C6": (3, 6), "random-r8-C16": (8, 16)}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("case", [*METADATA_CASES, *RANDOM_METADATA])
def test_metadata(backend, case):
    if case in METADATA_CASES:
        q_lens, seq_lens, r, cap, block_size = METADATA_CASES[case]
        args, tokens = _metadata_args(q_lens, seq_lens, block_size, seed=len(case)), sum(q_lens)
    else:
        (r, cap), block_size = RANDOM_METADATA[case], 48 if case == "random-r3-C6" else 64
        args, tokens = random_metadata_inputs(backend.pick(12, 300), r, block_size=block_size,
                                              max_len=backend.pick(256, 4096), max_q=backend.pick(16, 64))
    params = {"compress_ratio": r, "ring_capacity": cap, "block_size": block_size}
    got = build_qsa_metadata(*(t.to(backend.device) for t in args), **params, num_tokens=tokens)
    want = metadata_ref.build_qsa_metadata(*args, **params)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.device == backend.device and a.dtype == b.dtype and torch.equal(a.cpu(), b), name


def test_metadata_pads_tokens_past_the_last_request(force_triton):
    # A caller padding the batch to a captured size (a CUDA graph's bucket): the kernel and the reference pad alike;
    # fewer tokens than the requests bring is refused.
    args = _metadata_args([3, 2], [3, 6], 4, seed=1)
    params = {"compress_ratio": 2, "ring_capacity": 4, "block_size": 4}
    with pytest.raises(ValueError, match="num_tokens 4 < query_start_loc"):
        build_qsa_metadata(*args, **params, num_tokens=4)
    from kpool_pd.kernels.qsa_metadata.triton import build_qsa_metadata_triton

    padded = build_qsa_metadata_triton(*args, **params, num_tokens=8)
    reference = metadata_ref.build_qsa_metadata(*args, **params, num_tokens=8)
    for name in FIELDS:
        assert torch.equal(getattr(padded, name), getattr(reference, name)), name
    exact = metadata_ref.build_qsa_metadata(*args, **params)
    assert padded.token_to_req.tolist() == exact.token_to_req.tolist() + [-1] * 3
    assert padded.logical_positions.tolist() == exact.logical_positions.tolist() + [-1] * 3
    assert padded.ring_slot_mapping.tolist()[5:] == [-1] * 3 and padded.visible_blocks.tolist()[5:] == [0] * 3
    assert padded.k_work.shape[0] == metadata_ref.max_work_items(8, 2, 2)
    assert padded.num_work.tolist() == exact.num_work.tolist() == [2]
    assert padded.k_work.tolist() == exact.k_work.tolist()[:2] + [[-1, -1]] * (padded.k_work.shape[0] - 2)


def test_metadata_checks_values_on_cpu(force_triton):
    args = list(_metadata_args([2, 2], [2, 4], 4, seed=2))
    args[2][1, 0] = -1  # request 1's group 1 would be written to block -1
    with pytest.raises(ValueError, match=r"request 1: block_table column 0 holds block -1"):
        build_qsa_metadata(*args, compress_ratio=2, ring_capacity=4, block_size=4)
