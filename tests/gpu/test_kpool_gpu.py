"""The kpool kernels compiled on a CUDA device.

The kernel-against-reference bodies are tests/kernels/test_kpool_triton.py's, run here on the ``cuda`` backend
(tests/support/kernel_backends.py; that module states the comparison rules), over one-page blocks and blocks of two and
four kernel pages, with tests/kernels/test_kpool_pages.py's check of the page bytes against DESIGN's formula. Here as
well, what only a GPU shows: how far libdevice's exp is from torch's, that the decode update captures in a CUDA
graph and never synchronises with the host (one-page and multi-page blocks), and that every op runs on its
tensors' device (cuda:1 while cuda:0 is current). The token repack's bodies (tests/kernels/test_token_repack.py) run
here too, with its check that device ids never make it synchronise.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kpool_pd.kernels import (kpool_compress, kpool_decode_update, kpool_indexer_topk, kpool_prefill, kpool_read_entries,
                     kpool_write_entries)
from kpool_pd.kernels.kpool_decode.ref import decode_update
from kpool_pd.kernels.kpool_metadata import build_kpool_metadata
from kpool_pd.kvcache import PoolMode
from tests.support.kernel_backends import Backend, make_backend
from tests.kernels.test_chunked_prefill import test_a_chunk_inside_a_pool_reads_the_ring  # noqa: F401
from tests.kernels.test_mla_rows import test_kernel_writes_what_the_reference_writes  # noqa: F401
from tests.kernels.test_chunked_prefill import test_kernel_chunks_equal_one_whole_prefill  # noqa: F401
from tests.kernels.test_kpool_pages import test_prefill_writes_each_entry_where_design_says  # noqa: F401
from tests.kernels.test_kpool_metadata import test_the_decode_update_writes_each_pool_at_the_metadatas_slot  # noqa: F401
from tests.kernels.test_kpool_triton import (CONFIG, D, GEOMETRIES, assert_pools_match, keys, make_pool,  # noqa: F401
                                     test_compress,
                                     test_compress_encodes_rounding_edges_like_torch, test_decode_step_with_drafts,
                                     test_indexer_topk, test_prefill,
                                     test_prefill_and_drafted_decode_give_the_same_bytes, test_write_and_read_entries)
from tests.kernels.test_token_repack import (test_block_ids_on_the_device_are_the_ints,  # noqa: F401
                                     test_buffers_at_other_alignments_after_an_aligned_call,
                                     test_device_ids_never_sync, test_fused_launch_writes_what_one_launch_a_field_writes,
                                     test_python_id_lists_and_longer_tables,
                                     test_random_pairs_match_view_copy, test_rejects_bad_inputs,
                                     test_repack_matches_view_copy,
                                     test_valid_arguments_pass_and_unread_ids_are_not_checked)

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: run tests/gpu/run_all.sh on the H200 through the device tool")


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=True)


@triton.jit
def _exp_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, libdevice.exp(tl.load(x_ptr + offs)))


@pytest.mark.gpu
@needs_cuda
def test_exp_ulp_difference():
    """libdevice's expf (the kernels) against torch.exp on CUDA and on CPU, over softmax-like arguments."""
    x = (-20 * torch.rand(1 << 20, generator=torch.Generator().manual_seed(8))).cuda()
    y = torch.empty_like(x)
    _exp_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024)
    ulps_cuda = (y.view(torch.int32) - torch.exp(x).view(torch.int32)).abs()
    ulps_cpu = (y.cpu().view(torch.int32) - torch.exp(x.cpu()).view(torch.int32)).abs()
    print(f"\nexp ulp differences over {x.numel()} args: vs torch CUDA {int((ulps_cuda > 0).sum())} "
          f"(max {int(ulps_cuda.max())}), vs torch CPU {int((ulps_cpu > 0).sum())} (max {int(ulps_cpu.max())})")
    assert int(ulps_cuda.max()) <= 2 and int(ulps_cpu.max()) <= 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("geometry", ["S16-one-page", "S128-two-pages-of-64", "S128-four-pages-of-32"])
def test_decode_is_graph_capturable_and_never_syncs(entry_rule, geometry):
    config = GEOMETRIES[geometry]
    gen = torch.Generator().manual_seed(5)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    batch, tokens = 64, 4
    pool, ref_pool = make_pool(config, 3 * batch, batch, 3, cuda), make_pool(config, 3 * batch, batch, 3, cpu)
    k, gate = keys(batch * tokens, gen, cuda)
    starts = torch.randint(0, 180, (batch,), generator=gen)
    qsl = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
    ring_ids = torch.randperm(batch, generator=gen)
    tables = torch.randperm(3 * batch, generator=gen).view(batch, 3).to(torch.int32)
    ape = torch.randn(config.kpool, D, generator=gen)
    earlier = torch.randn(pool.tail_ring(0).shape, generator=gen).to(torch.bfloat16)
    pool.tail_ring(0).copy_(earlier)  # finite earlier keys (see test_decode_step_with_drafts)
    ref_pool.tail_ring(0).copy_(earlier)
    meta = tuple(t.cuda() for t in (starts, qsl, ring_ids, tables, ape))
    views = (pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0))
    first_k, first_gate = k.cpu(), gate.cpu()
    kpool_decode_update(k, gate, *meta[:4], meta[4], *views)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        kpool_decode_update(k, gate, *meta[:4], meta[4], *views)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kpool_decode_update(k, gate, *meta[:4], meta[4], *views)
    new_k, new_gate = keys(batch * tokens, gen, cpu)
    k.copy_(new_k)
    gate.copy_(new_gate)
    graph.replay()
    ref_views = (ref_pool.tail_ring(0), ref_pool.indexer_q(0), ref_pool.indexer_scale(0))
    for step_k, step_gate in ((first_k, first_gate), (first_k, first_gate), (new_k, new_gate)):
        decode_update(step_k, step_gate, starts, qsl, ring_ids, tables, ape, *ref_views, mode=PoolMode.SOFTMAX,
                      round_scale=True)
    assert_pools_match(pool, ref_pool, 0, PoolMode.SOFTMAX, entry_rule)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("geometry", ["S16-one-page", "S128-two-pages-of-64"])
def test_the_step_metadata_and_the_update_that_takes_it_replay_from_a_graph(entry_rule, geometry):
    """The decode step as the engine runs it: the step's KpoolMetadata built once, on the device, and the update
    writing each pool at its slot, without a host synchronisation, captured in one graph and replayed for the next
    step's keys; the bytes are the reference's, fed the same slot mapping."""
    config = GEOMETRIES[geometry]
    gen = torch.Generator().manual_seed(9)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    batch, tokens = 64, 4
    pool, ref_pool = make_pool(config, 3 * batch, batch, 3, cuda), make_pool(config, 3 * batch, batch, 3, cpu)
    k, gate = keys(batch * tokens, gen, cuda)
    starts = torch.randint(0, 180, (batch,), generator=gen).to(torch.int32)
    qsl = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
    seq = starts + tokens
    ring_ids = torch.randperm(batch, generator=gen).to(torch.int32)
    tables = torch.randperm(3 * batch, generator=gen).view(batch, 3).to(torch.int32)
    ape = torch.randn(config.kpool, D, generator=gen)
    earlier = torch.randn(pool.tail_ring(0).shape, generator=gen).to(torch.bfloat16)
    pool.tail_ring(0).copy_(earlier)
    ref_pool.tail_ring(0).copy_(earlier)
    on = [t.cuda() for t in (starts, qsl, seq, ring_ids, tables, ape)]
    views = (pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0))
    pages = config.kpool_indexer.pages_per_block

    def step() -> None:
        meta = build_kpool_metadata(on[1], on[0], on[2], on[4], kpool=config.kpool, block_size=config.block_size,
                                    pages_per_block=pages, num_tokens=batch * tokens)
        kpool_decode_update(k, gate, on[0], on[1], on[3], on[4], on[5], *views, metadata=meta)

    first_k, first_gate = k.cpu(), gate.cpu()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_k, new_gate = keys(batch * tokens, gen, cpu)
    k.copy_(new_k)
    gate.copy_(new_gate)
    graph.replay()
    slots = build_kpool_metadata(qsl, starts, seq, tables, kpool=config.kpool, block_size=config.block_size,
                                 pages_per_block=pages).slot_mapping
    ref_views = (ref_pool.tail_ring(0), ref_pool.indexer_q(0), ref_pool.indexer_scale(0))
    for step_k, step_gate in ((first_k, first_gate), (first_k, first_gate), (new_k, new_gate)):
        decode_update(step_k, step_gate, starts, qsl, ring_ids, tables, ape, *ref_views, mode=PoolMode.SOFTMAX,
                      round_scale=True, slot_mapping=slots)
    assert_pools_match(pool, ref_pool, 0, PoolMode.SOFTMAX, entry_rule)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (runs on the H200 pair)")
def test_every_op_runs_on_its_tensors_device():
    """Every kpool op on cuda:1 tensors while cuda:0 is current gives the bytes it gives on cuda:0."""
    gen = torch.Generator().manual_seed(11)
    k, gate = keys(67 + 12, gen, torch.device("cpu"))
    ape = torch.randn(4, D, generator=gen)
    tables = torch.randperm(12, generator=gen).view(2, 6).to(torch.int32)
    qsl, step_qsl = torch.tensor([0, 67, 67], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    ring_ids, starts = torch.tensor([0, 1]), torch.tensor([67, 0])
    q = torch.randn(5, 3, D, generator=gen).to(torch.bfloat16)
    weights, seq_lens = torch.randn(5, 3, generator=gen), torch.tensor([3, 4, 70, 71, 9])
    score_tables = torch.randint(0, 12, (5, 2), generator=gen).to(torch.int32)
    results = {}
    torch.cuda.set_device(0)
    for index in (0, 1):
        device = torch.device("cuda", index)
        on = lambda t: t.to(device)  # noqa: E731
        pool = make_pool(CONFIG, 12, 2, 1, device)
        ring, iq, iscale = pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0)
        compressed = kpool_compress(on(k[:8].view(2, 4, D)), on(gate[:8].view(2, 4, D)), on(ape))
        kpool_prefill(on(k[:67]), on(gate[:67]), on(ape), on(qsl), on(tables), on(ring_ids), iq, iscale, ring)
        kpool_decode_update(on(k[67:75]), on(gate[67:75]), on(starts), on(step_qsl), on(ring_ids), on(tables), on(ape),
                            ring, iq, iscale)
        kpool_write_entries(iq, iscale, compressed[0], compressed[1], torch.tensor([40, 41], device=device))
        entries = kpool_read_entries(iq, iscale, torch.arange(48, device=device), dequantize=False)
        top = kpool_indexer_topk(on(q), on(weights), on(seq_lens), on(score_tables), iq, iscale, kpool=4, topk=4)
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(device)
        results[index] = (*compressed, pool.blocks, pool.rings, *entries, *top)
    for got, want in zip(results[1], results[0]):
        assert got.device == torch.device("cuda", 1) and _same(got, want)
