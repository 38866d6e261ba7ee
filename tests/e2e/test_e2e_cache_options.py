"""End to end with each cache option the daemons take (``--pool-mode --round-scale --qsa-dtype
--block-order --kernel-page-states --cache-rope-positions``): one prefill daemon and one decode daemon
per transport, 16 concurrent requests around the pool, ring and block boundaries, every request equal to
the colocated run of the same model byte for byte (``tests/e2e/test_e2e.py``'s pattern), with the daemons' nodes
in this process (``tests.support.served_nodes``). Then ``kpool-pd up``
with the options combined, each family on one transport, against its own colocated run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kpool_pd.kvcache import BlockOrder, CacheDtype, CacheFamily, PoolMode
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import run_colocated
from tests.e2e.test_e2e import DECODE_LIMITS, TRANSPORTS, _flags, boundary_prompts
from tests.support.served_nodes import match_and_free, pd_nodes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KPOOL, QSA = CacheFamily.KPOOL, CacheFamily.QSA
OPTIONS = [  # family, the cache options (ModelConfig.build's names), alone and all together; 128-token blocks
    (KPOOL, dict(pool_mode=PoolMode.KEEP_LAST), "kpool-keep-last"),
    (KPOOL, dict(round_scale=False), "kpool-round-scale-false"),
    (KPOOL, dict(block_order=BlockOrder.BLHNC), "kpool-hnc"),
    (KPOOL, dict(kpool=2, kernel_page_states=32), "kpool2-pages-of-32"),
    (QSA, dict(qsa_dtype=CacheDtype.FP8), "qsa-fp8"),
    (QSA, dict(cache_rope_positions=True), "qsa-rope-positions"),
    (KPOOL, dict(kpool=2, pool_mode=PoolMode.KEEP_LAST, round_scale=False, block_order=BlockOrder.BLHNC,
                 kernel_page_states=32), "kpool-all-options"),
    (QSA, dict(qsa_dtype=CacheDtype.FP8, block_order=BlockOrder.BLHNC, cache_rope_positions=True),
     "qsa-all-options"),
]
CASES = [pytest.param(family, num_spec, options, id=f"{name}-spec{num_spec}")
         for family, options, name in OPTIONS for num_spec in (0, 3)]


@pytest.mark.parametrize("family,num_spec,options", CASES)
def test_pd_with_a_cache_option_equals_colocated(family, num_spec, options):
    config = ModelConfig.build(family=family, num_layers=2, num_spec=num_spec, seed=7 + num_spec, block_size=128,
                               **options)
    assert all(getattr(config.cache, "order" if k == "block_order" else k) == v for k, v in options.items())
    batches = {t: boundary_prompts(config, 16, 10, seed=num_spec, prefix=t) for t in TRANSPORTS}
    references = {t: run_colocated(config, batches[t]) for t in TRANSPORTS}

    async def main():
        async with pd_nodes(_flags(config), TRANSPORTS, prefill_extra=["--num-blocks", "256"],
                            decode_extra=[*DECODE_LIMITS, "--health-interval-s", "0.5"]) as (prefill, decodes):
            await match_and_free(prefill, decodes, batches, references)
    asyncio.run(main())


UP_CASES = [
    pytest.param(("--family", "kpool", "--kpool", "2", "--pool-mode", "keep-last", "--round-scale", "false",
                  "--block-order", "hnc", "--kernel-page-states", "32"), TRANSPORTS[0], id=f"kpool-{TRANSPORTS[0]}"),
    pytest.param(("--family", "qsa", "--qsa-dtype", "fp8", "--block-order", "hnc", "--cache-rope-positions", "true"),
                 TRANSPORTS[-1], id=f"qsa-{TRANSPORTS[-1]}"),
]


@pytest.mark.parametrize("flags,transport", UP_CASES)
def test_up_with_the_cache_options_equals_its_colocated_run(flags, transport):
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "up", "--json", "--requests", "3", "--prompt-len", "140",
                           "--max-tokens", "6", "--transport", transport, *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])["summary"]
    assert summary["ok"] == summary["colocated_match"] == 3, summary
    model = summary["model"]
    assert model["block_order"] == "BLHNC" and model["family"] == flags[1], model
