"""The cache options' defaults follow the seeds (vLLM's cache code), and README's table "Defaults and the
seeds" says so for what the code does: its column "ours" is each option's default in the daemons' option table
and in ``CacheConfig`` / the specs, and a row whose seed default differs from ours names a reason."""

from __future__ import annotations

import re

import pytest

from kpool_pd.kvcache import CacheConfig, CacheFamily, QsaKeyStateRingSpec
from kpool_pd.model import ModelConfig
from kpool_pd.runtime.model_options import CACHE_OPTIONS, model_config, model_settings
from tests.support.paths import REPO

README = REPO / "README.md"
BASE = {"family": "qsa", "layers": 1, "kpool": 4, "ratio": 4, "num_spec": 0, "block_size": 0, "seed": 0}


def _seed_table() -> dict[str, tuple[str, str, str]]:
    """README's rows: option key -> (seed's default, ours, why)."""
    text = README.read_text()
    section = text.split("### Defaults and the seeds", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `--([a-z-]+)` \| `([^`]+)` \| `([^`]+)` \| (.*) \|$", line)
        if match:
            option, seed, ours, why = match.groups()
            rows[option.replace("-", "_")] = (seed, ours, why)
    return rows


def test_cache_rope_positions_defaults_to_false_as_in_the_seed():
    assert CacheConfig().cache_rope_positions is False
    assert CacheConfig(family=CacheFamily.QSA).qsa_ring.cache_rope_positions is False
    assert QsaKeyStateRingSpec(compress_ratio=4, num_spec=0, block_size=256).cache_rope_positions is False
    assert ModelConfig.build(family=CacheFamily.QSA).cache.cache_rope_positions is False
    assert model_config(BASE).cache.cache_rope_positions is False  # a daemon given no --cache-rope-positions
    # without positions a ring row is the raw key alone; with them, off + 12 bf16 slots
    assert CacheConfig(family=CacheFamily.QSA).qsa_ring.row_width == 128
    assert CacheConfig(family=CacheFamily.QSA, cache_rope_positions=True).qsa_ring.row_width == 140


def test_the_readme_seed_table_lists_the_cache_rope_positions_and_the_kernel_page():
    assert {"cache_rope_positions", "kernel_page_states"} <= set(_seed_table())


@pytest.mark.parametrize("key", sorted(_seed_table()))
def test_the_readme_seed_table_says_what_the_code_does(key):
    seed, ours, why = _seed_table()[key]
    assert str(CACHE_OPTIONS[key].default) == ours, (key, CACHE_OPTIONS[key].default, ours)
    defaults = model_settings(ModelConfig(cache=CacheConfig(family=CacheFamily.QSA)))
    assert str(defaults[key]) == ours, (key, defaults[key], ours)
    if seed != ours:
        assert why.strip() and not why.startswith("(same"), f"{key}: the seed's {seed}, ours {ours}, and no reason"
    else:
        assert why.startswith("(same"), f"{key}: the row says the defaults differ, and they do not"
