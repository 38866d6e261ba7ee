"""The batch engine and the colocated runner: determinism, lossless speculative decoding, batch
invariance, and a transferred state whose every byte matters."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.connector.shared.plan import PoolKind, plan_transfer, ring_live_range
from kpool_pd.kvcache import BlockLayout, CacheFamily, CachePool
from kpool_pd.model import DecodeSequence, Engine, ModelConfig, PrefillJob, output_digest
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from tests.support.allocations import placed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


FAMILIES = [pytest.param(CacheFamily.KPOOL, id="kpool"), pytest.param(CacheFamily.QSA, id="qsa")]


def _config(family: CacheFamily, **kw) -> ModelConfig:
    return ModelConfig.build(family=family, num_layers=2, **kw)


def _digests(results):
    return [(r.tokens, r.output_digest, r.state_digest) for r in results]


@pytest.mark.parametrize("family", FAMILIES)
def test_runs_are_deterministic_and_the_seed_matters(family):
    config = _config(family, num_spec=1)
    requests = make_prompts(3, 37, seed=5, vocab_size=config.vocab_size, max_tokens=12)
    first = run_colocated(config, requests)
    assert _digests(run_colocated(config, requests)) == _digests(first)
    other = run_colocated(_config(family, num_spec=1, seed=1), requests)
    assert all(a.output_digest != b.output_digest for a, b in zip(first, other))
    assert all(len(r.tokens) == 12 for r in first)


LOSSLESS = [
    pytest.param(CacheFamily.KPOOL, 2, 3, [1, 31, 32, 33], id="kpool2-spec3"),
    pytest.param(CacheFamily.KPOOL, 4, 3, [1, 7, 8, 63, 64, 65], id="kpool4-spec3"),
    pytest.param(CacheFamily.KPOOL, 4, 7, [3, 4, 5, 66], id="kpool4-spec7"),
    pytest.param(CacheFamily.KPOOL, 8, 3, [8, 15, 127, 128, 129], id="kpool8-spec3"),
    pytest.param(CacheFamily.QSA, 4, 3, [1, 7, 8, 9, 63, 64, 65], id="qsa4-spec3"),
    pytest.param(CacheFamily.QSA, 2, 2, [1, 2, 3, 31, 32], id="qsa2-spec2"),
]


def test_kernel_pages_of_32_states_change_no_token_and_no_entry():
    """kpool 4 in 256-token blocks: one page of 64 states, or two pages of 32. The layouts differ (another layout
    hash), the tokens and every entry read back in pool order do not."""
    requests = make_prompts(3, 300, seed=8, vocab_size=1024, max_tokens=12)
    one_page, two_pages = (_config(CacheFamily.KPOOL, num_spec=3, block_size=256, kernel_page_states=p)
                           for p in (64, 32))
    assert one_page.cache.family_spec.pages_per_block == 1
    assert two_pages.cache.family_spec.pages_per_block == 2
    assert _digests(run_colocated(two_pages, requests)) == _digests(run_colocated(one_page, requests))


@pytest.mark.parametrize("family,group,num_spec,prompt_lens", LOSSLESS)
def test_drafts_change_nothing(family, group, num_spec, prompt_lens):
    """Tokens and final cache state with drafts equal those without (drafts only save steps)."""
    key = "kpool" if family is CacheFamily.KPOOL else "compress_ratio"
    requests = [GenerateRequest(request_id=f"r{i}", prompt=tuple(p.prompt), max_tokens=19)
                for i, p in enumerate(make_prompts(len(prompt_lens), max(prompt_lens), seed=3,
                                                   vocab_size=1024, max_tokens=19))]
    requests = [GenerateRequest(request_id=r.request_id, prompt=r.prompt[:n], max_tokens=r.max_tokens)
                for r, n in zip(requests, prompt_lens)]
    plain = run_colocated(_config(family, num_spec=0, **{key: group}), requests)
    drafted = run_colocated(_config(family, num_spec=num_spec, **{key: group}), requests)
    assert _digests(drafted) == _digests(plain)
    proposed = sum(r.drafts_proposed for r in drafted)
    accepted = sum(r.drafts_accepted for r in drafted)
    assert 0 < accepted < proposed, "the draft rule should be right often but not always"
    assert sum(r.steps for r in drafted) < sum(r.steps for r in plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_results_do_not_depend_on_the_batch(family):
    config = _config(family, num_spec=3)
    requests = make_prompts(5, 21, seed=9, vocab_size=config.vocab_size, max_tokens=10)
    alone = run_colocated(config, requests, max_batch=1)
    together = run_colocated(config, requests, max_batch=5)
    assert _digests(alone) == _digests(together)


def test_a_prompt_token_outside_the_vocabulary_is_refused():
    config = _config(CacheFamily.KPOOL)
    engine = Engine(config, CachePool(BlockLayout(config.cache), num_blocks=2, num_rings=1))
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        engine.prefill([PrefillJob(prompt=[5, 1024], block_ids=[0], ring_id=0)])
    with pytest.raises(ValueError, match="needs 1 blocks"):
        engine.prefill([PrefillJob(prompt=[5], block_ids=[], ring_id=0)])


def test_output_digest_is_sha256_of_little_endian_uint32():
    import hashlib
    assert output_digest([1, 256]) == hashlib.sha256(bytes([1, 0, 0, 0, 0, 1, 0, 0])).hexdigest()


class _TwoPools:
    """Prefill on one pool, move the request's blocks and ring with the connector's plan into
    another pool at different ids, decode there: the PD path without processes."""

    def __init__(self, config: ModelConfig, prompt: list[int], max_tokens: int) -> None:
        self.config = config
        layout = BlockLayout(config.cache)
        need = config.cache.blocks_for_request(len(prompt), max_tokens)
        self.src = Engine(config, CachePool(layout, num_blocks=need + 3, num_rings=2))
        self.dst = Engine(config, CachePool(layout, num_blocks=need + 5, num_rings=3), weights=self.src.weights)
        generator = torch.Generator().manual_seed(11)
        for pool in (self.src.pool, self.dst.pool):  # poison: bytes that are not moved never match
            pool.blocks.random_(0, 256, generator=generator)
            pool.rings.random_(0, 256, generator=generator)
        prompt_blocks = config.cache.blocks_for_tokens(len(prompt))
        self.src_blocks = list(range(2, 2 + prompt_blocks))
        self.dst_blocks = [b for b in range(need + 5) if b % 2 == 1][:need]
        self.first = self.src.prefill([PrefillJob(prompt=prompt, block_ids=self.src_blocks, ring_id=1)])[0]
        self.plan = plan_transfer(layout, self.src_blocks, self.dst_blocks[:prompt_blocks], 1, 2,
                                  ring_live_range(config.cache, len(prompt)))
        self.prompt, self.max_tokens = prompt, max_tokens

    def move(self, flip: tuple[int, int] | None = None) -> None:
        """Copy every region; ``flip = (region index, byte)`` inverts one byte of one region."""
        for index, pair in enumerate(self.plan.pairs):
            src = (self.src.pool.blocks if pair.src.kind is PoolKind.BLOCKS else self.src.pool.rings).view(-1)
            dst = (self.dst.pool.blocks if pair.dst.kind is PoolKind.BLOCKS else self.dst.pool.rings).view(-1)
            dst[pair.dst.offset:pair.dst.offset + pair.dst.nbytes] = src[pair.src.offset:pair.src.offset + pair.src.nbytes]
            if flip is not None and flip[0] == index:
                dst[pair.dst.offset + flip[1]] ^= 0xFF

    def decode(self) -> tuple[str, str]:
        seq = DecodeSequence(request_id="r", prompt_len=len(self.prompt), max_tokens=self.max_tokens,
                             allocation=placed(self.dst.pool, self.dst_blocks, 2), output=[self.first])
        while not seq.finished:
            self.dst.decode_step([seq])
        return output_digest(seq.output), self.dst.state_digest(seq.block_ids, seq.ring_id, seq.cached)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_faithful_transfer_matches_colocated_and_any_flipped_byte_shows(family):
    config = _config(family, num_spec=3)
    request = make_prompts(1, 75, seed=2, vocab_size=config.vocab_size, max_tokens=14)[0]
    reference = run_colocated(config, [request])[0]
    pd = _TwoPools(config, list(request.prompt), request.max_tokens)
    assert pd.plan.pairs[-1].src.kind is PoolKind.RINGS  # 75 tokens: the ring is not empty
    pd.move()
    assert pd.decode() == (reference.output_digest, reference.state_digest)

    layout = pd.src.pool.layout
    first_layer = layout.layer(0)
    block_region = 0
    cases = {
        "indexer entry of pool 0": (block_region, first_layer.indexer_offset),
        "MLA byte of token 3": (block_region, first_layer.mla_offset + 3 * config.cache.mla_entry_bytes + 17),
        "last layer, last block": (block_region, pd.plan.pairs[0].src.nbytes - layout.block_bytes
                                   + layout.layer(1).mla_offset + 5),
        "open pool in the ring": (len(pd.plan.pairs) - 1, 1),
    }
    changed_tokens = 0
    for name, flip in cases.items():
        pd = _TwoPools(config, list(request.prompt), request.max_tokens)
        pd.move(flip)
        out, state = pd.decode()
        assert (out, state) != (reference.output_digest, reference.state_digest), name
        changed_tokens += out != reference.output_digest
    assert changed_tokens >= 1
