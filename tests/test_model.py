"""The synthetic model's configuration and weights."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheFamily
from model import ModelConfig, SyntheticWeights, default_block_size


@pytest.mark.parametrize("family,kpool,ratio,num_spec,expected", [
    pytest.param(CacheFamily.KPOOL, 4, 4, 3, 64, id="kpool4-spec3"),
    pytest.param(CacheFamily.KPOOL, 8, 4, 3, 128, id="kpool8-spec3"),
    pytest.param(CacheFamily.KPOOL, 2, 4, 7, 32, id="kpool2-spec7"),
    pytest.param(CacheFamily.QSA, 4, 4, 3, 64, id="qsa4-spec3"),
    pytest.param(CacheFamily.QSA, 4, 3, 2, 48, id="qsa3-spec2"),
])
def test_default_block_size_holds_16_pools_and_whole_rings(family, kpool, ratio, num_spec, expected):
    assert default_block_size(family, kpool, ratio, num_spec) == expected
    config = ModelConfig(family=family, kpool=kpool, compress_ratio=ratio, num_spec=num_spec)
    assert config.cache_config().block_size == expected


def test_invalid_configs_name_the_numbers():
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        ModelConfig(num_layers=0)
    with pytest.raises(ValueError, match="S = block_size / kpool = 96 / 8 = 12"):
        ModelConfig(kpool=8, block_size=96)
    with pytest.raises(ValueError, match="does not divide block_size 36"):
        ModelConfig(family=CacheFamily.QSA, compress_ratio=4, num_spec=3, block_size=36)
    with pytest.raises(ValueError, match="num_spec must be an integer >= 0"):
        ModelConfig(num_spec=-1)


def test_weights_come_from_the_seed_only():
    a, b = SyntheticWeights(ModelConfig(seed=3)), SyntheticWeights(ModelConfig(seed=3))
    c = SyntheticWeights(ModelConfig(seed=4))
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
