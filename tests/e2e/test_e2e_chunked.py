"""End to end with chunked prefill: a prefill daemon whose token budget splits prompts across steps
(``--max-batch-tokens``) equals the colocated run byte for byte, over both transports.

Budgets one under the ring and one over a block, with 16 concurrent requests a decode daemon whose prompt
lengths sit on and around the pool (group), ring and block boundaries: chunk edges fall at every residue
of the pool, ring and block (a request alone in a step is cut at multiples of the budget; requests sharing
a step at the leftovers), with the daemons' nodes in this process (``tests.support.served_nodes``). Then
``kpool-pd up --max-batch-tokens N`` (the daemons as processes) against ``--colocated``, once a family.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kpool_pd.kvcache import CacheFamily
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import run_colocated
from tests.e2e.test_e2e import DECODE_LIMITS, TRANSPORTS, _flags, boundary_prompts
from tests.support.served_nodes import match_and_free, pd_nodes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [  # family, group, drafts, budget (ring 8 and block 128, the smallest the daemons take, in every case)
    pytest.param(CacheFamily.KPOOL, 4, 3, 7, id="kpool4-spec3-budget7"),
    pytest.param(CacheFamily.KPOOL, 4, 3, 129, id="kpool4-spec3-budget129"),
    pytest.param(CacheFamily.QSA, 4, 3, 9, id="qsa4-spec3-budget9"),
    pytest.param(CacheFamily.QSA, 4, 3, 127, id="qsa4-spec3-budget127"),
]


def _sample(node, name: str) -> float:
    """A node's metric: the sum of its samples over all its labels."""
    return sum(sample.value for metric in node.context.registry.collect() for sample in metric.samples
               if sample.name == name)


@pytest.mark.parametrize("family,group,num_spec,budget", CASES)
def test_chunked_pd_equals_colocated(family, group, num_spec, budget):
    key = "kpool" if family is CacheFamily.KPOOL else "compress_ratio"
    config = ModelConfig.build(family=family, num_layers=2, num_spec=num_spec, seed=budget, block_size=128, **{key: group})
    assert (config.cache.ring_slots, config.cache.block_size) == (8, 128)
    batches = {t: boundary_prompts(config, 16, 8, seed=budget, prefix=t) for t in TRANSPORTS}
    references = {t: run_colocated(config, batches[t]) for t in TRANSPORTS}

    async def main():
        budgeted = ["--num-blocks", "256", "--max-batch-tokens", str(budget)]
        async with pd_nodes(_flags(config), TRANSPORTS, prefill_extra=budgeted,
                            decode_extra=[*DECODE_LIMITS, "--health-interval-s", "0.5"]) as (prefill, decodes):
            chunks_before = _sample(prefill, "kpoolpd_prefill_chunks_total")
            outcomes = await match_and_free(prefill, decodes, batches, references)
            prompts = sum(len(b) for b in batches.values())
            assert _sample(prefill, "kpoolpd_prefill_chunks_total") - chunks_before > prompts, "no prompt was split"
            # every request moved its blocks; whether they went as pieces of the budget's worth of blocks depends on
            # its pull reaching the prefill node before the prompt's last chunk (on a loaded machine it may come
            # after, and a cold pull sends a region per run of blocks): tests/connector/test_connector_pipelined.py
            # checks the pieces with the order fixed
            assert _sample(prefill, "kpoolpd_prefill_transfer_regions_total") >= prompts
            for (transport, decode), results in zip(decodes.items(), outcomes):  # each request's times, in metrics too
                assert all(r.prefill_ms > 0 and r.transfer_ms > 0 and r.exposed_transfer_ms >= 0 for r in results)
                for name in ("prefill", "transfer", "exposed_transfer"):
                    count = _sample(decode, f"kpoolpd_decode_request_{name}_seconds_count")
                    assert count == len(results), f"decode over {transport}: {name} observed {count} times"
    asyncio.run(main())


def _up(*flags: str) -> tuple[int, list[dict], str]:
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "up", "--json", *flags], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


UP_CASES = [pytest.param(family, transport, id=f"{family}-{transport}")  # each family, the transports in turn
            for family, transport in zip(("kpool", "qsa"), (TRANSPORTS[0], TRANSPORTS[-1]))]


@pytest.mark.parametrize("family,transport", UP_CASES)
def test_up_with_a_token_budget_equals_colocated(family, transport):
    """A 141-token prompt (two blocks, a pool, a ring and 13) in 2, 3 or 4 chunks of a 65-token budget."""
    flags = ("--requests", "3", "--prompt-len", "141", "--max-tokens", "6", "--family", family, "--num-spec", "3")
    code, rows, stderr = _up(*flags, "--max-batch-tokens", "65", "--transport", transport)
    assert code == 0, stderr
    *requests, last = rows
    assert last["summary"]["ok"] == last["summary"]["colocated_match"] == 3
    for row in requests:
        assert row["prefill_ms"] > 0 and row["transfer_ms"] > 0 and row["exposed_transfer_ms"] >= 0, row
        assert row["exposed_transfer_ms"] < row["ttft_ms"] and row["prefill_ms"] < row["ttft_ms"], row
    assert last["summary"]["exposed_transfer_ms_mean"] >= 0 and last["summary"]["prefill_ms_mean"] > 0
    code, colocated, _ = _up(*flags, "--colocated")
    assert code == 0
    assert [(r["tokens"], r["output_digest"], r["state_digest"]) for r in colocated[:-1]] == [
        (r["tokens"], r["output_digest"], r["state_digest"]) for r in requests]
