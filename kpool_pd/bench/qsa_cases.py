"""Kernel bench cases of the QSA family: metadata builder, forward update (the token repack: bench.repack_cases)."""

from __future__ import annotations

import torch

from kpool_pd.bench.timing import BenchCase, Prepared
from kpool_pd.kernels import build_qsa_metadata, qsa_forward_update
from kpool_pd.kernels.qsa_rope import RopeCache
from kpool_pd.kernels.qsa_update.launch import UpdateLaunch
from kpool_pd.kernels.qsa_update.triton import qsa_forward_update_triton
from kpool_pd.kvcache import INDEX_HEAD_DIM, CacheConfig, CacheFamily, qsa_ring_capacity

D = INDEX_HEAD_DIM


def qsa_batch(device: torch.device, requests: int, q_len: int, context: int, r: int, block_size: int):
    """A batch of `requests` chunks of `q_len` tokens ending at random lengths up to `context` (+ q_len)."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    seq = torch.randint(0, context, (requests,), generator=gen) + q_len
    cols = CacheConfig(family=CacheFamily.QSA, compress_ratio=r, block_size=block_size).blocks_for_tokens(
        context + q_len)
    table = torch.randperm(requests * cols, generator=gen).view(requests, cols)
    qsl = torch.arange(0, requests * q_len + 1, q_len)
    rings = torch.randperm(requests, generator=gen)
    return [t.to(torch.int32).to(device) for t in (qsl, seq, table, rings)]


def make_qsa_metadata(requests: int = 256, tokens: int = 8192, r: int = 4, num_spec: int = 3, block_size: int = 64):
    """QSA metadata builder: every output of one forward from the batch's offsets, lengths and tables."""
    def make(device: torch.device) -> Prepared:
        qsl, seq, table, rings = qsa_batch(device, requests, tokens // requests, 16_384, r, block_size)
        cap = qsa_ring_capacity(r, num_spec)
        outputs = tokens * (4 + 8 + 4 + 8 + 8) + ((tokens + (r - 1) * requests) // r) * 8 + 4
        moved = (qsl.numel() + seq.numel() + rings.numel()) * 4 + tokens // r * 4 + outputs
        return Prepared(lambda: build_qsa_metadata(qsl, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                                   block_size=block_size, num_tokens=tokens), moved)
    return make


POSITION_RANGE = 1 << 20  # the update cases' MRoPE positions are drawn from [0, 2**20)


def make_qsa_update(requests: int = 64, q_len: int = 4096, r: int = 4, heads: int = 1, num_spec: int = 3,
                    block_size: int = 64, fp8: bool = False, table: bool = True, launch: UpdateLaunch | None = None):
    """QSA forward update of one layer for a prefill batch: compress + write every completed group, then the
    ring rows (keys and packed positions) of each request's last C tokens. ``table``: the op reads cos/sin
    from a RopeCache of every position drawn (2**20 rows, 256 MiB, built once), as vLLM's rotary reads its
    cos_sin_cache; else it computes them. The table's reads are not counted in the bytes moved. ``launch``: time
    the kernels alone with this launch (``kpool_pd.kernels.qsa_update.launch``) instead of the public op."""
    def make(device: torch.device) -> Prepared:
        qsl, seq, table_, rings = qsa_batch(device, requests, q_len, 2 * block_size, r, block_size)
        cap = qsa_ring_capacity(r, num_spec)
        tokens = requests * q_len
        gen = torch.Generator(device=device).manual_seed(8)
        meta = build_qsa_metadata(qsl, seq, table_, rings, compress_ratio=r, ring_capacity=cap,
                                  block_size=block_size, num_tokens=tokens)
        keys = torch.randn(tokens, heads, D, generator=gen, device=device).to(torch.bfloat16)
        positions = torch.randint(0, POSITION_RANGE, (tokens, 3), generator=gen, device=device)
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        compressed = torch.zeros(table_.numel(), block_size // r, heads, D, dtype=dtype, device=device)
        ring = torch.zeros(requests, cap, heads, D + 12, dtype=torch.bfloat16, device=device)
        weight = torch.randn(D, generator=gen, device=device)
        rope_cache = RopeCache.build(POSITION_RANGE, rotary_dim=64, theta=10000.0, device=device) if table else None
        groups = int(meta.num_work)
        moved = keys.numel() * 2 + positions.numel() * 8 + groups * heads * D * compressed.element_size() + \
            requests * cap * (heads * (D + 12) * 2 + D * heads * 2 + 24)
        if launch is None:
            return Prepared(lambda: qsa_forward_update(
                keys, positions, meta, ring, compressed, weight, compress_ratio=r, block_size=block_size, eps=1e-6,
                rotary_dim=64, theta=10000.0, section=(12, 10, 10), cache_rope_positions=True,
                rope_cache=rope_cache), moved)
        return Prepared(lambda: qsa_forward_update_triton(  # a launch variant: the kernels alone
            keys, positions, meta, ring, compressed, weight, eps=1e-6, rotary_dim=64, theta=10000.0,
            section=(12, 10, 10), cache_rope_positions=True, rope_cache=rope_cache, launch=launch), moved)
    return make


QSA_DECODE_VARIANTS = (UpdateLaunch(block=1, num_warps=1), UpdateLaunch(block=1, num_warps=2),
                       UpdateLaunch(block=1, num_warps=1, pdl=False), UpdateLaunch(block=1, num_warps=1, paired=False))
QSA_PREFILL_VARIANTS = tuple(UpdateLaunch(block=block, num_warps=warps) for block, warps in
                             ((2, 1), (1, 1), (4, 1), (2, 2), (4, 2), (1, 2))) + (
                                 UpdateLaunch(block=2, num_warps=1, paired=False),)
TABLE_NOTE = "cos/sin table of 2**20 positions"

QSA_CASES: list[BenchCase] = [
    BenchCase(name="qsa metadata builder", size="8,192 tokens in 256 requests, r 4, C 8", make=make_qsa_metadata(),
              decode=True, target_flush1_us=10.0),
    BenchCase(name="qsa forward update (prefill), bf16", size=f"1 layer, 64 x 4096 tokens, r 4, 1 head; {TABLE_NOTE}",
              make=make_qsa_update(), target_copy_fraction=0.30),
    BenchCase(name="qsa forward update (prefill), bf16, computed cos/sin", size="1 layer, 64 x 4096 tokens, r 4, 1 head",
              make=make_qsa_update(table=False)),
    BenchCase(name="qsa forward update (prefill), fp8, 4 heads", size=f"1 layer, 16 x 4096 tokens, r 4; {TABLE_NOTE}",
              make=make_qsa_update(requests=16, heads=4, fp8=True)),
    BenchCase(name="qsa forward update (decode), 3 drafts", size=f"1 layer, 256 requests x 4 tokens; {TABLE_NOTE}",
              make=make_qsa_update(requests=256, q_len=4), decode=True, target_flush1_us=10.0),
    BenchCase(name="qsa forward update (decode), 3 drafts, computed cos/sin", size="1 layer, 256 requests x 4 tokens",
              make=make_qsa_update(requests=256, q_len=4, table=False), decode=True),
]

# Launch variants of the kernels alone, for choosing the defaults (kpool_pd/bench/kernels.py --variants).
QSA_VARIANTS: list[BenchCase] = [
    *[BenchCase(name=f"qsa update (decode) {launch.label}", size=f"256 requests x 4 tokens; {TABLE_NOTE}",
                make=make_qsa_update(requests=256, q_len=4, launch=launch), decode=True)
      for launch in QSA_DECODE_VARIANTS],
    *[BenchCase(name=f"qsa update (prefill) {launch.label}", size=f"64 x 4096 tokens; {TABLE_NOTE}",
                make=make_qsa_update(launch=launch)) for launch in QSA_PREFILL_VARIANTS],
]
