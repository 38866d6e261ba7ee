"""Kernel bench cases of the kpool family: prefill, decode update, compress, paged write, scores + top-k."""

from __future__ import annotations

import torch

from bench.timing import BenchCase, Prepared
from kernels import kpool_decode_update, kpool_indexer_topk, kpool_prefill
from kernels.kpool_cache.triton import write_entries_triton
from kernels.kpool_compress.triton import compress_pools_triton
from kernels.kpool_decode.triton import decode_update_triton
from kernels.kpool_prefill.triton import prefill_compress_write_triton
from kvcache import INDEX_HEAD_DIM, PoolMode, blocks_for_tokens, tail_ring_size

D = INDEX_HEAD_DIM


def _keys(tokens: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> k, gate: [tokens, 128] bf16 (random, never zeros)"""
    k = torch.randn(tokens, D, generator=gen, device=device).to(torch.bfloat16)
    gate = (2 * torch.randn(tokens, D, generator=gen, device=device)).to(torch.bfloat16)
    return k, gate


def _pages(num_blocks: int, states: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> indexer_q: [num_blocks, S, 128] fp8, indexer_scale: [num_blocks, S] fp32"""
    iq = torch.randn(num_blocks, states, D, device=device).to(torch.float8_e4m3fn)
    return iq, torch.rand(num_blocks, states, device=device) + 0.01


def _prefill_inputs(device: torch.device, requests: int, tokens_each: int, kpool: int, states: int):
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = requests * tokens_each
    k, gate = _keys(tokens, device, gen)
    ape = torch.randn(kpool, D, generator=gen, device=device)
    qsl = torch.arange(0, tokens + 1, tokens_each, dtype=torch.int32, device=device)
    block_size = kpool * states
    blocks_each = blocks_for_tokens(tokens_each, block_size)
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
        return Prepared(lambda: prefill_compress_write_triton(
            k, gate, ape, qsl, table, iq, iscale, mode=PoolMode.SOFTMAX, round_scale=True, block_p=block_p,
            num_warps=num_warps), moved)
    return make


def make_decode(batch: int, tokens_each: int = 4, kpool: int = 4, states: int = 64, calls: int = 1,
                block_c: int | None = None, num_warps: int | None = None):
    """Decode step of one layer: every request stashes its tokens and compresses the pools they complete."""
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device="cpu").manual_seed(2)
        ring_size = tail_ring_size(kpool, tokens_each - 1)
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

        def run() -> None:
            for _ in range(calls):
                if num_warps is None:
                    kpool_decode_update(*args)
                else:  # a launch variant: the kernel alone
                    decode_update_triton(*args, mode=PoolMode.SOFTMAX, round_scale=True, block_c=block_c,
                                         num_warps=num_warps)
        return Prepared(run, moved * calls, calls)
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


KPOOL_CASES: list[BenchCase] = [
    BenchCase("prefill compress+write+seed (public op)", "1 layer, 256 x 4096 tokens = 262,144 pools of 4",
              make_prefill(), target_copy_fraction=0.60, anchor="vLLM 362 us, 1.58 TB/s, 37% of copy"),
    *[BenchCase(f"prefill compress+write BLOCK_P={bp} warps={nw}", "262,144 pools of 4",
                make_prefill(block_p=bp, num_warps=nw, public=False), target_copy_fraction=0.60)
      for bp, nw in ((4, 4), (8, 4), (8, 2), (16, 4), (16, 8), (32, 4))],
    BenchCase("decode update, 3 drafts", "1 layer, batch 256 x 4 tokens", make_decode(256), target_us=5.0,
              anchor="vLLM 5.1 us a replay"),
    BenchCase("decode update, 3 drafts, 32 calls a graph", "batch 256 x 4 tokens, per call", make_decode(256, calls=32),
              anchor="vLLM 3.0 us a call"),
    BenchCase("decode update, 3 drafts", "1 layer, batch 1024 x 4 tokens", make_decode(1024), target_us=6.3),
    *[BenchCase(f"decode update, 3 drafts, BLOCK_C={bc} warps={nw}", f"batch {b} x 4 tokens",
                make_decode(b, block_c=bc, num_warps=nw)) for b in (256, 1024) for bc, nw in ((1, 1), (1, 2), (2, 2), (1, 4))],
    BenchCase("compress (standalone op)", "262,144 pools of 4", make_compress()),
    BenchCase("paged write of entries", "262,144 entries", make_write()),
    BenchCase("indexer scores + top-2048", "64 requests x 16k tokens, 64 heads", make_score()),
]
