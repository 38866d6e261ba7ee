"""The serving geometry (``kpool_pd.runtime.geometry``): blocks of a multiple of 128 tokens, kernel pages of exactly
32 or 64 states (a block of more states split into pages), and of 64 only on a GPU of compute capability 12.x. The daemons' refusals are in
``tests/workers/test_daemon_settings_refused.py``; here the rules as functions of the cache and the capability."""

from __future__ import annotations

import pytest

from kpool_pd.model import ModelConfig
from kpool_pd.kvcache import CacheFamily
from kpool_pd.runtime.geometry import GeometryError, check_kernel_page_for_capability, check_serving_geometry

KPOOL, QSA = CacheFamily.KPOOL, CacheFamily.QSA


def _cache(family=KPOOL, *, kpool=4, block_size=256, page=64, ratio=4):
    return ModelConfig.build(family=family, kpool=kpool, compress_ratio=ratio, block_size=block_size,
                             kernel_page_states=page).cache


@pytest.mark.parametrize("family,kpool,block_size,page", [
    pytest.param(KPOOL, 4, 256, 64, id="kpool4-256-one-page-of-64"),
    pytest.param(KPOOL, 2, 256, 64, id="kpool2-256-two-pages-of-64"),
    pytest.param(KPOOL, 8, 256, 64, id="kpool8-256-one-page-of-32"),
    pytest.param(KPOOL, 4, 128, 64, id="kpool4-128-one-page-of-32"),
    pytest.param(KPOOL, 2, 256, 32, id="kpool2-256-four-pages-of-32"),
    pytest.param(KPOOL, 8, 1536, 64, id="kpool8-1536-three-pages-of-64"),
    pytest.param(KPOOL, 8, 768, 32, id="kpool8-768-three-pages-of-32"),
    pytest.param(QSA, 8, 128, 64, id="qsa8-128"),
])
def test_the_serving_geometry_accepts_blocks_of_128_and_pages_of_32_or_64(family, kpool, block_size, page):
    cache = _cache(family, kpool=kpool, ratio=kpool, block_size=block_size, page=page)
    check_serving_geometry(cache)
    if family is KPOOL:
        indexer = cache.kpool_indexer
        assert indexer.states_per_page in (32, 64)
        assert indexer.pages_per_block * indexer.states_per_page == block_size // kpool


@pytest.mark.parametrize("family,kpool,block_size,options,words", [
    pytest.param(KPOOL, 4, 64, ("block_size",), "a block of 64 tokens is refused", id="kpool-block-64"),
    pytest.param(KPOOL, 4, 192, ("block_size",), "a multiple of 128 tokens", id="kpool-block-192"),
    pytest.param(QSA, 4, 64, ("block_size",), "a block of 64 tokens", id="qsa-block-64"),
    pytest.param(KPOOL, 16, 256, ("kpool", "block_size"), "kernel pages of 16 states", id="kpool16-256"),
    pytest.param(KPOOL, 8, 128, ("kpool", "block_size"), "at least 32", id="kpool8-128"),
    pytest.param(KPOOL, 8, 384, ("kpool", "block_size"), "kernel pages of 48 states: the paged-MQA indexer kernel "
                 "takes pages of 32 or 64 states and no other", id="kpool8-384-pages-of-48"),
    pytest.param(KPOOL, 16, 768, ("kpool", "block_size"), r"768 / 16 = 48\) must be 32 or 64, or a multiple of the "
                 "64-state page", id="kpool16-768-pages-of-48"),
])
def test_the_serving_geometry_refuses_small_blocks_and_pages_naming_the_rule(family, kpool, block_size, options, words):
    cache = ModelConfig.build(family=family, kpool=kpool, compress_ratio=kpool, block_size=block_size).cache
    with pytest.raises(GeometryError, match=words) as caught:
        check_serving_geometry(cache)
    assert caught.value.options == options


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)], ids=["sm120", "sm121"])
@pytest.mark.parametrize("kpool,page", [(8, 64), (2, 32), (4, 32)], ids=["kpool8-S32", "kpool2-P32", "kpool4-P32"])
def test_pages_of_32_states_are_refused_on_compute_capability_12(capability, kpool, page):
    cache = _cache(kpool=kpool, page=page)
    assert cache.kpool_indexer.states_per_page == 32
    with pytest.raises(GeometryError, match=rf"compute capability {capability[0]}\.{capability[1]}.* 64 states only"):
        check_kernel_page_for_capability(cache, capability)
    for other in ((9, 0), (10, 0), (8, 9)):  # Hopper, Blackwell B200, Ada: pages of 32 states are fine
        check_kernel_page_for_capability(cache, other)


def test_pages_of_64_states_and_qsa_caches_pass_on_compute_capability_12():
    check_kernel_page_for_capability(_cache(kpool=4), (12, 0))
    check_kernel_page_for_capability(_cache(kpool=2), (12, 0))
    check_kernel_page_for_capability(_cache(QSA, ratio=8, block_size=128), (12, 0))
