"""DESIGN section 2 invariant: prefill of the whole sequence == prefill of a prefix + decode
steps with any draft accept/reject history == a run without drafts, byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpool_pd.kvcache import CacheConfig, PoolMode, tail_ring_size
from tests.support.kpool_sim import RequestCache, decode_history, random_ape, random_keys

STATES = 16
# (S states a block, P states a kernel page): one page; two pages of 32; two of 64; four of 32
LAYOUTS = [(STATES, 64), (64, 32), (128, 64), (128, 32)]
MAX_BLOCK = 256  # tokens: longer blocks make the histories slow without a new boundary


def _config(kpool: int, num_spec: int, mode: PoolMode = PoolMode.SOFTMAX, round_scale: bool = True,
            layout: tuple[int, int] = LAYOUTS[0]) -> CacheConfig:
    states, page = layout
    return CacheConfig(kpool=kpool, num_spec=num_spec, block_size=states * kpool, pool_mode=mode,
                       round_scale=round_scale, kernel_page_states=page)


def _boundary_lengths(config: CacheConfig) -> list[int]:
    """Lengths on and around pool, ring, kernel page and block boundaries."""
    page = config.family_spec.states_per_page * config.kpool
    marks = {1, config.kpool, config.tail_ring.ring_size, page, config.block_size, config.block_size + page,
             2 * config.block_size}
    return sorted({n + d for n in marks for d in (-1, 0, 1) if n + d >= 1})


@st.composite
def histories(draw):
    kpool = draw(st.sampled_from([2, 4, 8]))
    num_spec = draw(st.sampled_from([0, 1, 3, 7]))
    mode = draw(st.sampled_from(list(PoolMode)))
    round_scale = draw(st.booleans())
    layout = draw(st.sampled_from([(s, p) for s, p in LAYOUTS if s * kpool <= MAX_BLOCK]))
    config = _config(kpool, num_spec, mode, round_scale, layout)
    lengths = _boundary_lengths(config)
    total = draw(st.sampled_from(lengths))
    prompt = draw(st.one_of(st.sampled_from([n for n in lengths if n <= total]), st.integers(1, total)))
    accepts = draw(st.lists(st.integers(0, num_spec), min_size=total, max_size=total))
    seed = draw(st.integers(0, 2**31 - 1))
    return config, prompt, total, accepts, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_prefix_plus_drafted_decode_equals_full_prefill(case):
    config, prompt, total, accepts, seed = case
    gen = torch.Generator().manual_seed(seed)
    k, gate = random_keys(total, gen)
    ape = random_ape(config.kpool, gen)

    full = RequestCache(config, total + config.num_spec, ape, gen)
    full.prefill(k, gate)

    drafted = RequestCache(config, total + config.num_spec, ape, gen)
    length = decode_history(drafted, k, gate, prompt, accepts, config.num_spec, gen)
    assert length == total

    plain = RequestCache(config, total + config.num_spec, ape, gen)
    assert decode_history(plain, k, gate, prompt, [0] * total, 0, gen) == total

    expected = full.snapshot(total)
    assert drafted.snapshot(total) == expected
    assert plain.snapshot(total) == expected


REJECTED_CASES = [pytest.param(kpool, spec, LAYOUTS[0], id=f"kpool{kpool}-spec{spec}")
                  for kpool in (2, 4, 8) for spec in (0, 1, 3, 7)] + [
    pytest.param(2, 3, (128, 64), id="kpool2-spec3-two-pages-of-64"),
    pytest.param(2, 1, (128, 32), id="kpool2-spec1-four-pages-of-32"),
    pytest.param(4, 1, (64, 32), id="kpool4-spec1-two-pages-of-32"),
]


@pytest.mark.parametrize("kpool,num_spec,layout", REJECTED_CASES)
def test_every_boundary_length_with_all_drafts_rejected(kpool, num_spec, layout):
    """The one-page layouts cross into a third block; a layout of several pages stops after the first page of
    its second block (its page boundaries: the third block's repeat the second's, at ~500 decode steps each)."""
    config = _config(kpool, num_spec, layout=layout)
    gen = torch.Generator().manual_seed(kpool * 10 + num_spec)
    lengths = _boundary_lengths(config)
    if layout != LAYOUTS[0]:
        second_block_page = config.block_size + config.family_spec.states_per_page * kpool
        lengths = [n for n in lengths if n <= second_block_page + 1]
    for total in lengths:
        k, gate = random_keys(total, gen)
        ape = random_ape(kpool, gen)
        full = RequestCache(config, total + num_spec, ape, gen)
        full.prefill(k, gate)
        drafted = RequestCache(config, total + num_spec, ape, gen)
        assert decode_history(drafted, k, gate, 1, [0] * total, num_spec, gen) == total
        assert drafted.snapshot(total) == full.snapshot(total), f"length {total}"


def test_one_pool_ring_breaks_the_invariant():
    """With R = kpool, drafts behind a rejected pool-completing draft overwrite the keys its redo
    reads: kpool 4, 3 drafts, prompt of 2 tokens; the step at positions 2..5 completes pool 0 with
    the draft at position 3, which is rejected; drafts 4 and 5 land on slots 0 and 1."""
    config = _config(4, 3)
    assert tail_ring_size(4, 3) == 8
    gen = torch.Generator().manual_seed(7)
    total = 8
    k, gate = random_keys(total, gen)
    ape = random_ape(config.kpool, gen)
    full = RequestCache(config, total + 3, ape, gen)
    full.prefill(k, gate)

    good = RequestCache(config, total + 3, ape, gen)
    decode_history(good, k, gate, 2, [0, 3, 3], 3, torch.Generator().manual_seed(1))
    assert good.snapshot(total) == full.snapshot(total)

    small = RequestCache(config, total + 3, ape, gen)
    small_ring = torch.empty(3, 2, 4, 128, dtype=torch.bfloat16)  # one pool only
    small.views = lambda layer=0: (small_ring, small.pool.indexer_q(0), small.pool.indexer_scale(0))
    decode_history(small, k, gate, 2, [0, 3, 3], 3, torch.Generator().manual_seed(1))
    broken_q, _, _ = small.snapshot(total)
    expected_q, _, _ = full.snapshot(total)
    assert broken_q[:128] != expected_q[:128], "pool 0 must be corrupted by the one-pool ring"
