"""The QSA kernels compiled on a CUDA device.

The kernel-against-reference bodies are tests/kernels/test_qsa_triton.py's, tests/kernels/test_qsa_update_launch.py's and
tests/kernels/test_qsa_update.py's edge histories, run here on the ``cuda`` backend (tests/support/kernel_backends.py; tests/kernels/test_qsa_triton.py states
the comparison rules: on CUDA, compressed rows identical to the reference run on the same CUDA tensors).
Here as well, what only a GPU shows: the metadata builder and the forward update never synchronise with
the host and replay from a CUDA graph with the reference's results; random drafted histories keep the PD
invariant; and every op (the token repack too) runs on its tensors' device (cuda:1 while
cuda:0 is current).
"""

from __future__ import annotations

import math

import pytest
import torch

from kpool_pd.kernels import (build_qsa_metadata, compress_group_keys, qsa_forward_update, qsa_topk, repack_tokens,
                     write_qsa_ring)
from kpool_pd.kernels.qsa_metadata import ref as metadata_ref
from kpool_pd.kernels.qsa_rope import RopeCache
from kpool_pd.kernels.qsa_update import ref as update_ref
from kpool_pd.kernels.qsa_update.launch import UpdateGrid, UpdateLaunch, default_update_launch
from kpool_pd.kernels.qsa_update.triton import qsa_forward_update_triton
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool, qsa_ring_capacity
from tests.support.kernel_backends import Backend, make_backend, poison
from kpool_pd.kernels.qsa_metadata import split_uniform_decodes
from kpool_pd.kernels.qsa_metadata.builder import QsaMetadataBuilder
from tests.kernels.test_qsa_metadata_builder import GEOMETRY, mixed_batch
from tests.kernels.test_qsa_metadata_builder import (  # noqa: F401
    test_builder_matches_the_reference_forward_after_forward_in_the_same_buffers)
from tests.kernels.test_qsa_metadata_kernel import random_metadata_inputs, test_metadata  # noqa: F401
from tests.kernels.test_qsa_score_kernel import test_scores_within_accumulation_error  # noqa: F401
from tests.kernels.test_qsa_score_kernel import test_topk_exact_on_integer_values  # noqa: F401
from tests.kernels.test_qsa_triton import (ROPE, test_compress, test_compress_garbage_keys,  # noqa: F401
                                   test_compress_reads_the_rope_cache, test_compress_rounding_edges,
                                   test_forward_update, test_ring_write)
from tests.kernels.test_qsa_update_launch import test_every_launch_writes_the_reference_bytes  # noqa: F401
from tests.kernels.test_qsa_update import (Storage, make_history, norm_weight, run_both, state_mismatches,  # noqa: F401
                                   test_edge_histories)

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: run tests/gpu/run_all.sh on the H200 through the device tool")
gpu_only = [pytest.mark.gpu, needs_cuda]


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def _metadata_inputs(requests: int, seed: int, *, block_size: int = 64, max_len: int = 4096, max_q: int = 64):
    args, tokens = random_metadata_inputs(requests, seed, block_size=block_size, max_len=max_len, max_q=max_q)
    return [t.cuda() for t in args], tokens


@pytest.mark.gpu
@needs_cuda
def test_metadata_never_syncs_and_replays_from_a_graph():
    args, tokens = _metadata_inputs(256, 7)
    params = {"compress_ratio": 4, "ring_capacity": 8, "block_size": 64}
    build_qsa_metadata(*args, **params, num_tokens=tokens)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_qsa_metadata(*args, **params, num_tokens=tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_qsa_metadata(*args, **params, num_tokens=tokens)
    gen = torch.Generator().manual_seed(8)
    args[1].copy_(torch.clamp(args[1].cpu() + torch.randint(0, 50, (256,), generator=gen), max=4095))  # new lengths
    args[2].copy_(args[2][torch.randperm(256, generator=gen).cuda()])  # new tables
    graph.replay()
    torch.cuda.synchronize()
    want = metadata_ref.build_qsa_metadata(*args, **params)
    for name in ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping",
                 "compressed_slot_mapping"):
        assert torch.equal(getattr(captured, name), getattr(want, name)), name
    assert torch.equal(captured.num_work, want.num_work)
    num_work = int(want.num_work)
    assert torch.equal(captured.k_work[:num_work], want.k_work[:num_work])
    assert bool((captured.k_work[num_work:] == -1).all())



@pytest.mark.gpu
@needs_cuda
def test_builder_replays_a_padded_bucket_from_a_graph():
    """A bucket of 256 tokens and 16 requests captured once; two mixed batches with drafts (10 decode steps
    and 4 chunks, then 6 and 2 in the bucket's tensors, the requests past them idle) replayed: the maps equal
    the reference's of the real requests, the padding tokens get no slot, and the split comes from the host."""
    bucket_tokens, bucket_requests, num_spec = 256, 16, 3
    builder = QsaMetadataBuilder(**GEOMETRY, num_spec=num_spec, max_num_batched_tokens=512, max_num_seqs=32,
                                 device="cuda")

    def padded(batch):  # the real requests, then idle ones (query length 0, sequence length 0)
        qsl, seq, table, rings = batch
        idle = bucket_requests - seq.shape[0]
        return (torch.cat([qsl, qsl[-1:].expand(idle)]), torch.cat([seq, seq.new_zeros(idle)]),
                torch.cat([table, table.new_zeros(idle, table.shape[1])]), torch.cat([rings, rings.new_zeros(idle)]))

    batches = [mixed_batch(seed, decodes=d, prefills=p, num_spec=num_spec, block_size=64, max_len=600)
               for seed, (d, p) in enumerate([(10, 4), (6, 2)])]
    columns = max(b[2].shape[1] for b in batches)
    batches = [(q, s, torch.nn.functional.pad(t, (0, columns - t.shape[1])), r) for q, s, t, r in batches]
    inputs = [t.cuda() for t in padded(batches[0])]  # the bucket's tensors, at fixed addresses
    assert int(batches[0][0][-1]) <= bucket_tokens
    host = dict(query_start_loc_cpu=batches[0][0], seq_lens_cpu=batches[0][1])  # the real requests' host copies
    builder.build(*inputs, **host, num_tokens=bucket_tokens)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = builder.build(*inputs, **host, num_tokens=bucket_tokens)
    assert captured.split.num_decodes == 10 and captured.split.num_prefills == 4
    for batch, (decodes, prefills) in zip(batches, [(10, 4), (6, 2)]):
        for target, source in zip(inputs, padded(batch)):
            target.copy_(source)
        graph.replay()
        split = split_uniform_decodes(batch[0], batch[1], decode_threshold=builder.decode_threshold)  # host work
        assert (split.num_decodes, split.num_prefills, split.decode_query_len) == (decodes, prefills, 1 + num_spec)
        torch.cuda.synchronize()
        want = metadata_ref.build_qsa_metadata(*batch, **GEOMETRY)
        real = int(batch[0][-1])
        for name in ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping",
                     "compressed_slot_mapping"):
            assert torch.equal(getattr(captured, name)[:real].cpu(), getattr(want, name)), name
            assert bool((getattr(captured, name)[real:] <= 0).all()), name  # padding: -1 (or 0 visible rows)
        num_work = int(want.num_work)
        assert int(captured.num_work) == num_work
        assert torch.equal(captured.k_work[:num_work].cpu(), want.k_work[:num_work])
        assert bool((captured.k_work[num_work:] == -1).all())

def _qsa_pool(dtype: CacheDtype, order: BlockOrder, heads: int, r: int, num_spec: int, blocks: int, rings: int,
              seed: int) -> CachePool:
    cap = qsa_ring_capacity(r, num_spec)
    config = CacheConfig(family=CacheFamily.QSA, layer_names=("l0", "l1"), block_size=math.lcm(r, cap, 64),
                         num_spec=num_spec, mla_entry_bytes=16, order=order, compress_ratio=r, qsa_num_heads=heads,
                         qsa_dtype=dtype, cache_rope_positions=True)
    pool = CachePool(BlockLayout(config), num_blocks=blocks, num_rings=rings, device="cuda")
    poison(pool.blocks, seed)
    poison(pool.rings, seed + 1)
    return pool


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("launch", [None, UpdateLaunch(block=1, num_warps=1)],
                         ids=["default-one-launch-per-request", "two-launches-over-work-items"])
@pytest.mark.parametrize("with_table", [False, True], ids=["computed-rope", "rope-table-of-2**19"])
def test_forward_update_never_syncs_and_replays_from_a_graph(with_table, launch):
    """A decode step of 64 requests x 4 tokens (launched with programmatic dependent launch where the GPU has it),
    with positions up to 2**20: computed cos/sin, or a RopeCache holding the positions below 2**19; through the
    public op (its default for a decode step: one launch, a program per request) or the two launches."""
    r, num_spec, requests, heads = 4, 3, 64, 1
    rope_cache = RopeCache.build(2 ** 19, rotary_dim=ROPE["rotary_dim"], theta=ROPE["theta"],
                                 device=torch.device("cuda")) if with_table else None
    pool = _qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, heads, r, num_spec, requests * 4, requests, 1)
    ref_pool = _qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, heads, r, num_spec, requests * 4, requests, 1)
    cap, block_size = pool.config.qsa_ring.capacity, pool.config.block_size
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(requests * 4, generator=gen).view(requests, 4).to(torch.int32).cuda()
    seq = torch.randint(8, 200, (requests,), generator=gen).to(torch.int32).cuda()
    starts = torch.arange(0, 4 * requests + 1, 4, dtype=torch.int32).cuda()
    rings = torch.arange(requests, dtype=torch.int32).cuda()
    weight = torch.randn(128, generator=gen).cuda()
    kwargs = {"compress_ratio": r, "block_size": block_size, "eps": 1e-6, "cache_rope_positions": True,
              "rope_cache": rope_cache, **ROPE}
    # the straddling groups' older keys come from the rings: finite keys, small positions
    pool.rings.view(torch.bfloat16).copy_(torch.randn(requests, pool.rings.shape[1] // 2, generator=gen))
    pool.qsa_ring(0)[..., 128:].view(torch.int64).copy_(torch.randint(0, 2 ** 20, (requests, cap, 1, 3)))
    ref_pool.rings.copy_(pool.rings)
    keys = torch.randn(4 * requests, heads, 128, generator=gen).to(torch.bfloat16).cuda()
    positions = torch.randint(0, 2 ** 20, (4 * requests, 3), generator=gen).cuda()

    def step() -> None:
        meta = build_qsa_metadata(starts, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                  block_size=block_size, num_tokens=4 * requests)
        if launch is None:
            assert default_update_launch(metadata=meta, device=keys.device).grid is UpdateGrid.REQUESTS
            qsa_forward_update(keys, positions, meta, pool.qsa_ring(0), pool.qsa_keys(0), weight, **kwargs)
        else:
            qsa_forward_update_triton(keys, positions, meta, pool.qsa_ring(0), pool.qsa_keys(0), weight,
                                      launch=launch, **{k: v for k, v in kwargs.items()
                                                        if k not in ("compress_ratio", "block_size")})

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    first_keys = keys.clone()
    keys.copy_(torch.randn(4 * requests, heads, 128, generator=gen).to(torch.bfloat16))
    graph.replay()
    meta = metadata_ref.build_qsa_metadata(starts, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                           block_size=block_size)
    for step_keys in (first_keys, first_keys, keys):
        update_ref.qsa_forward_update(step_keys, positions, meta, ref_pool.qsa_ring(0), ref_pool.qsa_keys(0), weight,
                                      **kwargs)
    assert torch.equal(pool.rings, ref_pool.rings)
    assert torch.equal(pool.blocks, ref_pool.blocks)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("r", [1, 2, 4, 8], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("num_spec", [0, 1, 3, 7], ids=lambda n: f"spec{n}")
def test_pd_invariant_random_histories_on_cuda(r, num_spec):
    storage = Storage(r=r, num_spec=num_spec, rope=True, dtype=CacheDtype.FP8_E4M3, order=BlockOrder.BLHNC, heads=2)
    gen = torch.Generator().manual_seed(r * 10 + num_spec)
    histories = []
    for _ in range(4):
        chunks = torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
        steps = []
        for _ in range(12):
            drafts = int(torch.randint(0, num_spec + 1, (1,), generator=gen))
            steps.append((drafts, int(torch.randint(0, drafts + 1, (1,), generator=gen))))
        histories.append(make_history(chunks, steps, storage, gen))
    weight = norm_weight(r)
    whole, stepped = run_both(storage, histories, weight, device="cuda")
    assert state_mismatches(whole, histories, weight) == []
    assert state_mismatches(stepped, histories, weight) == []


# --- every op on its tensors' device ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (runs on the H200 pair)")
def test_every_op_runs_on_its_tensors_device():
    """Every QSA op and the token repack on cuda:1 tensors while cuda:0 is current give the bytes they give on
    cuda:0."""
    gen = torch.Generator().manual_seed(12)
    r, num_spec, requests = 4, 3, 6
    group_keys = torch.randn(9, r, 2, 128, generator=gen).to(torch.bfloat16)
    group_positions = torch.randint(0, 2 ** 20, (9, 3), generator=gen)
    weight = torch.randn(128, generator=gen)
    q_lens = [13, 4, 1, 0, 4, 9]
    tokens = sum(q_lens)
    keys = torch.randn(tokens, 1, 128, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 2 ** 20, (tokens, 3), generator=gen)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq = torch.tensor([13, 20, 7, 5, 40, 9], dtype=torch.int32)
    table = torch.randperm(requests * 2, generator=gen).view(requests, 2).to(torch.int32)
    rings = torch.randperm(requests, generator=gen).to(torch.int32)
    q = torch.randn(5, 4, 128, generator=gen).to(torch.bfloat16)
    results = {}
    torch.cuda.set_device(0)
    for index in (0, 1):
        device = torch.device("cuda", index)
        on = lambda t: t.to(device)  # noqa: E731
        pool = _qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, r, num_spec, requests * 2, requests, 3)
        pool.blocks, pool.rings = on(pool.blocks), on(pool.rings)
        cap, block_size = pool.config.qsa_ring.capacity, pool.config.block_size
        rows = compress_group_keys(on(group_keys), on(group_positions), on(weight), eps=1e-6,
                                   out_dtype=torch.float8_e4m3fn, **ROPE)
        meta = build_qsa_metadata(on(starts), on(seq), on(table), on(rings), compress_ratio=r, ring_capacity=cap,
                                  block_size=block_size, num_tokens=tokens)
        qsa_forward_update(on(keys), on(positions), meta, pool.qsa_ring(0), pool.qsa_keys(0), on(weight),
                           compress_ratio=r, block_size=block_size, eps=1e-6, cache_rope_positions=True, **ROPE)
        write_qsa_ring(pool.qsa_ring(1), on(keys), on(positions), meta.ring_slot_mapping)
        top_rows, top_tokens = qsa_topk(on(q), pool.qsa_keys(0), on(table[:5]), on(seq[:5]), compress_ratio=r,
                                        block_size=block_size, topk=3)
        moved = torch.zeros_like(pool.blocks)
        repack_tokens(pool.blocks, pool.layout, on(torch.arange(requests * 2)), moved, pool.layout,
                      on(torch.arange(requests * 2).flip(0)), requests * 2 * block_size)
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(device)
        results[index] = (rows, meta.ring_slot_mapping, meta.k_work, pool.blocks, pool.rings, top_rows, top_tokens,
                          moved)
    for got, want in zip(results[1], results[0]):
        assert got.device == torch.device("cuda", 1) and _same(got, want)
