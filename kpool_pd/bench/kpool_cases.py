"""Kernel bench cases of the kpool family: prefill, decode update, compress, paged write, scores + top-k."""

from __future__ import annotations

import torch

from kpool_pd.bench.timing import BenchCase, Prepared
from kpool_pd.kernels import kpool_decode_update, kpool_indexer_topk, kpool_prefill
from kpool_pd.kernels.kpool_cache.triton import write_entries_triton
from kpool_pd.kernels.kpool_compress.triton import compress_pools_triton
from kpool_pd.kernels.kpool_decode.triton import decode_update_triton
from kpool_pd.kernels.kpool_prefill import prefill_pool_offsets
from kpool_pd.kernels.kpool_prefill.triton import prefill_compress_write_triton
from kpool_pd.kvcache import DEFAULT_KERNEL_PAGE_STATES, INDEX_HEAD_DIM, CacheConfig, PoolMode, tail_ring_size

D = INDEX_HEAD_DIM
DECODE_VARIANTS = ((1, 1, False), (1, 2, False), (1, 4, False), (2, 4, False), (1, 1, True), (1, 4, True))
# (requests a program, warps, programmatic dependent launch)


def _keys(tokens: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> k, gate: [tokens, 128] bf16 (random, never zeros)"""
    k = torch.randn(tokens, D, generator=gen, device=device).to(torch.bfloat16)
    gate = (2 * torch.randn(tokens, D, generator=gen, device=device)).to(torch.bfloat16)
    return k, gate


def _pages(num_blocks: int, states: int, device: torch.device,
           page: int = DEFAULT_KERNEL_PAGE_STATES) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``states`` entries in kernel pages of min(states, page) entries, laid out as the pool's:
    each page its fp8 entries, then their fp32 scales.

    # -> indexer_q: [num_blocks, pages, states_per_page, 128] fp8, indexer_scale: [num_blocks, pages, states_per_page]
    #    fp32 (strided views of one buffer)
    """
    per_page = min(states, page)
    pages = states // per_page
    raw = torch.empty(num_blocks, pages, per_page * (D + 4), dtype=torch.uint8, device=device)
    iq = raw[..., : per_page * D].view(torch.float8_e4m3fn).view(num_blocks, pages, per_page, D)
    iscale = raw[..., per_page * D:].view(torch.float32)
    iq.copy_(torch.randn(iq.shape, device=device).to(torch.float8_e4m3fn))
    iscale.copy_(torch.rand(iscale.shape, device=device) + 0.01)
    return iq, iscale


def _prefill_inputs(device: torch.device, requests: int, tokens_each: int, kpool: int, states: int):
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = requests * tokens_each
    k, gate = _keys(tokens, device, gen)
    ape = torch.randn(kpool, D, generator=gen, device=device)
    qsl = torch.arange(0, tokens + 1, tokens_each, dtype=torch.int32, device=device)
    blocks_each = CacheConfig(kpool=kpool, block_size=kpool * states).blocks_for_tokens(tokens_each)
    table = torch.randperm(requests * blocks_each, generator=gen, device=device).view(requests, blocks_each)
    iq, iscale = _pages(requests * blocks_each, states, device)
    return k, gate, ape, qsl, table.to(torch.int32), iq, iscale


def make_prefill(requests: int = 256, tokens_each: int = 4096, kpool: int = 4, states: int = 64,
                 block_p: int | None = None, num_warps: int = 4, public: bool = True):
    """Prefill of one layer: compress + paged write of every pool (+ ring seeding through the public op)."""
    def make(device: torch.device) -> Prepared:
        k, gate, ape, qsl, table, iq, iscale = _prefill_inputs(device, requests, tokens_each, kpool, states)
        ring = torch.empty(requests, 2, tail_ring_size(kpool, 3), D, dtype=torch.bfloat16, device=device)
        ring_ids = torch.arange(requests, device=device)
        pools = requests * (tokens_each // kpool)
        moved = k.numel() * 2 * 2 + pools * (D + 4)
        if public:
            return Prepared(lambda: kpool_prefill(k, gate, ape, qsl, table, ring_ids, iq, iscale, ring), moved)
        offsets = prefill_pool_offsets(qsl, None, kpool)
        return Prepared(lambda: prefill_compress_write_triton(
            k, gate, ape, qsl, None, offsets, table, ring_ids, ring, iq, iscale, mode=PoolMode.SOFTMAX, round_scale=True, block_p=block_p,
            num_warps=num_warps), moved)
    return make


def make_decode(batch: int, tokens_each: int = 4, kpool: int = 4, states: int = 64, num_spec: int = 3,
                block_r: int | None = None, num_warps: int | None = None, pdl: bool | None = None):
    """Decode step of one layer: every request stashes its tokens and compresses the pools they complete (ring of
    a num_spec-draft config; tokens_each = 1 is a step without drafts on it)."""
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device="cpu").manual_seed(2)
        ring_size = tail_ring_size(kpool, num_spec)
        start = torch.randint(64, 16_384, (batch,), generator=gen)
        blocks_each = (16_384 + tokens_each) // (kpool * states) + 1
        table = torch.randperm(batch * blocks_each, generator=gen).view(batch, blocks_each).to(torch.int32)
        iq, iscale = _pages(batch * blocks_each, states, device)
        k, gate = _keys(batch * tokens_each, device, torch.Generator(device=device).manual_seed(3))
        ring = torch.randn(batch, 2, ring_size, D, device=device).to(torch.bfloat16)
        ape = torch.randn(kpool, D, device=device)
        qsl = torch.arange(0, batch * tokens_each + 1, tokens_each, dtype=torch.int32, device=device)
        ring_ids = torch.randperm(batch, generator=gen).to(device)
        completed = int(((start + tokens_each) // kpool - start // kpool).sum())
        old_slots = int(torch.where((start + tokens_each) // kpool > start // kpool, start % kpool, 0).sum())
        moved = k.numel() * 2 * 2 * 2 + old_slots * 2 * D * 2 + completed * (D + 4)  # read + ring write
        args = (k, gate, start.to(device), qsl, ring_ids, table.to(device), ape, ring, iq, iscale)
        if block_r is None and num_warps is None and pdl is None:
            return Prepared(lambda: kpool_decode_update(*args), moved)
        return Prepared(lambda: decode_update_triton(  # a launch variant: the kernel alone
            *args, mode=PoolMode.SOFTMAX, round_scale=True, block_r=block_r, num_warps=num_warps, pdl=pdl), moved)
    return make


def make_compress(pools: int = 262_144, kpool: int = 4):
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device=device).manual_seed(4)
        k, gate = _keys(pools * kpool, device, gen)
        ape = torch.randn(kpool, D, generator=gen, device=device)
        k, gate = k.view(pools, kpool, D), gate.view(pools, kpool, D)
        run = lambda: compress_pools_triton(k, gate, ape, mode=PoolMode.SOFTMAX, round_scale=True)  # noqa: E731
        return Prepared(run, k.numel() * 2 * 2 + pools * (D + 4))
    return make


def make_write(entries: int = 262_144, states: int = 64):
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device=device).manual_seed(5)
        iq, iscale = _pages(entries // states * 2, states, device)
        q = torch.randint(0, 256, (entries, D), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        scale = torch.rand(entries, device=device)
        slots = torch.randperm(iq.shape[0] * states, generator=gen, device=device)[:entries]
        # the kernel alone: the public op checks the slot range on the host, which a graph cannot capture
        return Prepared(lambda: write_entries_triton(iq, iscale, q, scale, slots), 2 * entries * (D + 4))
    return make


def make_score(batch: int = 64, seq_len: int = 16_384, heads: int = 64, kpool: int = 4, states: int = 64,
               topk: int = 2048):
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device=device).manual_seed(6)
        blocks_each = seq_len // (kpool * states)
        iq, iscale = _pages(batch * blocks_each, states, device)
        table = torch.randperm(batch * blocks_each, generator=gen, device=device).view(batch, blocks_each)
        q = torch.randn(batch, heads, D, generator=gen, device=device).to(torch.bfloat16)
        w = torch.randn(batch, heads, generator=gen, device=device)
        seq_lens = torch.full((batch,), seq_len, device=device)
        pools = seq_len // kpool
        moved = batch * pools * (D + 4) + q.numel() * 2 + batch * pools * 4 + batch * topk * 12
        return Prepared(lambda: kpool_indexer_topk(q, w, seq_lens, table.to(torch.int32), iq, iscale, kpool=kpool,
                                                   topk=topk), moved)
    return make


_VLLM = "vLLM {}, issue 11 (2026-11-30, same H200 harness)"

KPOOL_CASES: list[BenchCase] = [
    BenchCase(name="prefill compress+write+seed (public op)", size="1 layer, 256 x 4096 tokens = 262,144 pools of 4",
              make=make_prefill(), target_copy_fraction=0.60, anchor=_VLLM.format("363 us, 38% of copy")),
    BenchCase(name="decode update, 3 drafts", size="1 layer, 256 requests x 4 tokens", make=make_decode(256),
              decode=True, target_graph32_us=3.0, target_flush1_us=8.5, anchor=_VLLM.format("3.13 us"),
              anchor_flush1=_VLLM.format("8.8 us")),
    BenchCase(name="decode update, 3 drafts", size="1 layer, 1,024 requests x 4 tokens", make=make_decode(1024),
              decode=True, target_graph32_us=4.3, target_flush1_us=10.0, anchor=_VLLM.format("4.46 us"),
              anchor_flush1=_VLLM.format("10.3 us")),
    BenchCase(name="decode update, no drafts", size="1 layer, 256 requests x 1 token (ring 8)",
              make=make_decode(256, tokens_each=1), decode=True, target_graph32_us=2.3,
              anchor=_VLLM.format("2.33 us")),
    BenchCase(name="compress (standalone op)", size="262,144 pools of 4", make=make_compress()),
    BenchCase(name="paged write of entries", size="262,144 entries", make=make_write()),
    BenchCase(name="indexer scores + top-2048", size="64 requests x 16k tokens, 64 heads", make=make_score(),
              decode=True),
    # kpool 2 in 256-token blocks: 128 states a block, two kernel pages of 64 (the same work as above, paged)
    BenchCase(name="prefill, two kernel pages a block", size="1 layer, 256 x 4096 tokens = 524,288 pools of 2",
              make=make_prefill(kpool=2, states=128)),
    BenchCase(name="decode update, 3 drafts, two kernel pages a block", size="1 layer, 256 requests x 4 tokens",
              make=make_decode(256, kpool=2, states=128), decode=True),
    BenchCase(name="indexer scores + top-2048, two kernel pages a block", size="64 requests x 16k tokens, 64 heads",
              make=make_score(kpool=2, states=128), decode=True),
]

# Launch variants of the kernels alone, for choosing the defaults (kpool_pd/bench/kernels.py --variants).
KPOOL_VARIANTS: list[BenchCase] = [
    *[BenchCase(name=f"prefill compress+write BLOCK_P={bp} warps={nw}", size="262,144 pools of 4",
                make=make_prefill(block_p=bp, num_warps=nw, public=False)) for bp, nw in ((8, 4), (16, 4), (16, 8))],
    *[BenchCase(name=f"decode update BLOCK_R={br} warps={nw}{' PDL' if pdl else ''}", size=f"{b} requests x {t} tokens",
                make=make_decode(b, tokens_each=t, block_r=br, num_warps=nw, pdl=pdl), decode=True)
      for b, t in ((256, 4), (1024, 4), (256, 1)) for br, nw, pdl in DECODE_VARIANTS],
]
