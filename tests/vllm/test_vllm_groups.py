"""Which KV cache groups KpoolPdConnector moves and which of a request's blocks in each
(``kpool_pd.vllm.groups``), on vLLM's own spec and config objects."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kpool_pd.vllm.groups import GroupKind, GroupRule, request_blocks, transfer_rules  # noqa: E402

pytestmark = pytest.mark.vllm

HEADS = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}


def config(*specs, transfer=None) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec, enable_kv_transfer=True if transfer is None else transfer[i])
              for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_rules_of_full_window_and_ring_groups():
    rules = transfer_rules(config(FullAttentionSpec(block_size=16, **HEADS),
                                  SlidingWindowSpec(block_size=16, sliding_window=100, **HEADS),
                                  CircularBufferSpec(block_size=8, head_size_v=0, num_kv_heads=1, head_size=64,
                                                     dtype=torch.bfloat16)))
    assert [(r.group, r.kind, r.block_size, r.window) for r in rules] == [
        (0, GroupKind.FULL, 16, 0), (1, GroupKind.WINDOW, 16, 100), (2, GroupKind.RING, 8, 0)]


def test_a_group_vllm_does_not_transfer_is_left_out():
    rules = transfer_rules(config(FullAttentionSpec(block_size=16, **HEADS),
                                  ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32, **HEADS),
                                  transfer=[True, False]))
    assert [r.group for r in rules] == [0]


@pytest.mark.parametrize("spec, why", [
    (ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32, **HEADS), "ChunkedLocalAttentionSpec"),
    (MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)), "MambaSpec"),
], ids=["chunked-local", "mamba"])
def test_a_group_that_cannot_be_moved_is_refused_naming_it(spec, why):
    with pytest.raises(ValueError, match=rf"KV cache group 1 \({why}.*cannot be moved"):
        transfer_rules(config(FullAttentionSpec(block_size=16, **HEADS), spec))


@pytest.mark.parametrize("num_tokens, full, window, nulls", [
    (7, 1, (0, 1), 0),      # one partial block; the window holds it all
    (16, 1, (0, 1), 0),     # exactly one block
    (17, 2, (0, 2), 0),
    (116, 8, (1, 8), 0),    # the window starts at position 17: block 1
    (129, 9, (1, 9), 0),    # ... 30: block 1 still
    (260, 17, (10, 17), 0),  # ... 161: block 10
    (260, 17, (10, 17), 10),  # vLLM nulled the blocks before the window
], ids=["7", "16", "17", "116", "129", "260", "260-nulled"])
def test_prompt_blocks_per_group(num_tokens, full, window, nulls):
    """A full group's prompt blocks (its table may hold more: lookahead); a sliding window of 100's blocks
    from position num_tokens - 99 on; the ring's one block; nothing of a group not moved."""
    rules = (GroupRule(group=0, kind=GroupKind.FULL, block_size=16),
             GroupRule(group=1, kind=GroupKind.WINDOW, block_size=16, window=100),
             GroupRule(group=2, kind=GroupKind.RING, block_size=8))
    paged = list(range(100, 120))
    sliding = [0] * nulls + list(range(200 + nulls, 220))
    chosen = request_blocks(rules, (paged, sliding, [40], [99]), num_tokens)
    assert chosen == (tuple(paged[:full]), tuple(sliding[window[0]:window[1]]), (40,), ())


def test_a_null_block_where_the_prompt_is_needed_is_refused():
    rule = GroupRule(group=1, kind=GroupKind.WINDOW, block_size=16, window=100)
    with pytest.raises(ValueError, match="group 1 .*null block"):
        rule.prompt_blocks([0, 0, 7, 8], 60)
