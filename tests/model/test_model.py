"""The synthetic model's configuration and weights."""

from __future__ import annotations

import json

import pytest
import torch

from kpool_pd.kvcache import CacheConfig, CacheDtype, CacheFamily, PoolMode
from kpool_pd.model import ModelConfig, SyntheticWeights, default_block_size
from kpool_pd.model.cache_io import open_positions


@pytest.mark.parametrize("family,kpool,ratio,num_spec,expected", [
    pytest.param(CacheFamily.KPOOL, 4, 4, 3, 256, id="kpool4-spec3"),
    pytest.param(CacheFamily.KPOOL, 8, 4, 3, 256, id="kpool8-spec3"),
    pytest.param(CacheFamily.KPOOL, 2, 4, 7, 256, id="kpool2-spec7"),
    pytest.param(CacheFamily.KPOOL, 2, 4, 3, 256, id="kpool2-spec3-two-pages"),
    pytest.param(CacheFamily.KPOOL, 3, 4, 0, 384, id="kpool3-spec0-ring3"),
    pytest.param(CacheFamily.KPOOL, 5, 4, 3, 640, id="kpool5-spec3-ring10"),
    pytest.param(CacheFamily.KPOOL, 128, 4, 0, 256, id="kpool128-spec0"),
    pytest.param(CacheFamily.KPOOL, 512, 4, 0, 512, id="kpool512-spec0-ring512"),
    pytest.param(CacheFamily.QSA, 4, 4, 3, 256, id="qsa4-spec3"),
    pytest.param(CacheFamily.QSA, 4, 3, 2, 384, id="qsa3-spec2"),
    pytest.param(CacheFamily.QSA, 4, 4, 5, 384, id="qsa4-spec5-ring12"),
])
def test_default_block_size_is_256_or_the_least_multiple_of_128_the_ring_divides(family, kpool, ratio, num_spec,
                                                                                 expected):
    assert default_block_size(family, kpool, ratio, num_spec) == expected
    group = kpool if family is CacheFamily.KPOOL else ratio
    ring = ModelConfig.build(family=family, kpool=kpool, compress_ratio=ratio, num_spec=num_spec).cache.ring_slots
    assert expected % 128 == 0 and expected % group == 0 and expected % ring == 0
    if expected != 256:  # 256 does not work, and no smaller multiple of 128 than the expected one does
        assert 256 % ring or 256 % group
        assert all(b % ring or b % group for b in range(128, expected, 128))
    config = ModelConfig.build(family=family, kpool=kpool, compress_ratio=ratio, num_spec=num_spec)
    assert config.cache.block_size == expected


def test_invalid_configs_name_the_numbers():
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        ModelConfig.build(num_layers=0)
    with pytest.raises(ValueError, match="S = block_size / kpool = 192 / 2 = 96 exceeds the kernel page of 64"):
        ModelConfig.build(kpool=2, block_size=192)
    with pytest.raises(ValueError, match="does not divide block_size 36"):
        ModelConfig.build(family=CacheFamily.QSA, compress_ratio=4, num_spec=3, block_size=36)
    with pytest.raises(ValueError, match="num_spec must be an integer >= 0"):
        ModelConfig.build(num_spec=-1)


def test_a_model_holds_its_cache_and_build_fills_the_common_case():
    config = ModelConfig.build(family=CacheFamily.QSA, num_layers=3, compress_ratio=2, num_spec=1, block_size=128,
                               qsa_dtype=CacheDtype.FP8, seed=5, topk=6)
    assert config.cache == CacheConfig(family=CacheFamily.QSA, layer_names=("layer.0", "layer.1", "layer.2"),
                                       block_size=128, num_spec=1, compress_ratio=2, qsa_dtype=CacheDtype.FP8)
    assert (config.num_layers, config.seed, config.topk) == (3, 5, 6)
    assert ModelConfig(cache=config.cache, seed=5, topk=6) == config
    assert ModelConfig.build(num_spec=3) == ModelConfig.build(num_spec=3, block_size=256)  # the default, given
    # what the handshake compares reads the cache's fields, under the names it always had
    assert json.loads(config.identity()) == {
        "family": "qsa", "layers": 3, "kpool": 4, "compress_ratio": 2, "num_spec": 1, "seed": 5, "vocab_size": 1024,
        "index_heads": 4, "topk": 6, "mla_entry_bytes": 656, "pool_mode": PoolMode.SOFTMAX.value, "qsa_dtype": "fp8",
        "round_scale": True, "cache_rope_positions": False}
    with pytest.raises(ValueError, match="cache must be a CacheConfig, got dict"):
        ModelConfig(cache={})
    with pytest.raises(ValueError, match="vocab_size must be in"):
        ModelConfig(cache=config.cache, vocab_size=1)


def test_weights_come_from_the_seed_only():
    a, b = SyntheticWeights(ModelConfig.build(seed=3)), SyntheticWeights(ModelConfig.build(seed=3))
    c = SyntheticWeights(ModelConfig.build(seed=4))
    tokens, positions = torch.tensor([0, 5, 5]), torch.tensor([0, 1, 300])
    for name in ("keys", "query"):
        for x, y, z in zip(getattr(a, name)(1, tokens, positions), getattr(b, name)(1, tokens, positions),
                           getattr(c, name)(1, tokens, positions)):
            assert torch.equal(x, y) and not torch.equal(x, z)
    mla = a.mla_bytes(0, tokens, positions)
    assert mla.shape == (3, 656) and mla.dtype == torch.uint8
    assert not torch.equal(mla[1], mla[2])  # one token at two positions: different bytes
    k, gate = a.keys(0, tokens, positions)
    assert k.dtype == gate.dtype == torch.bfloat16 and k.shape == (3, 128)


@pytest.mark.parametrize("family, group", [(CacheFamily.KPOOL, 4), (CacheFamily.QSA, 3)], ids=["kpool", "qsa"])
def test_group_and_open_positions(family, group):
    config = ModelConfig.build(family=family, kpool=4, compress_ratio=3, num_spec=1)
    assert config.cache.tokens_per_entry == group
    block = config.cache.block_size
    lengths = [0, 1, group - 1, group, group + 1, block - 1, block, block + 1]
    got = open_positions(config.cache, torch.tensor(lengths, dtype=torch.int32))
    assert got.shape == (len(lengths), group - 1) and got.dtype == torch.int64
    for row, length in zip(got.tolist(), lengths):
        open_pool = [p for p in range(length) if p >= length - length % group]
        assert row == open_pool + [-1] * (group - 1 - len(open_pool)), length
