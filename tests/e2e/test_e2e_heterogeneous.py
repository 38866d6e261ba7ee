"""End to end with prefill and decode daemons of different block sizes: the decode daemon lands the
prefill daemon's blocks in staging and places them in its own (``kernels.repack_tokens``); every
request equals the colocated run with the decode block size, byte for byte, over both transports.

The three block-size pairs of the contract (128 -> 256, 512 -> 128, 256 -> 512), each with both
families, the kpool sizes 2, 4, 8 and QSA ratios 2, 4, 8, and 0 to 5 drafts spread over the cases
(a case's ring or group must divide both block sizes). Prompt lengths sit on and around the pool,
ring and both block boundaries. The cases run the daemons' nodes in this process
(``tests.support.served_nodes``); then ``kpool-pd up --prefill-block-size A --decode-block-size B`` runs the
daemons as processes.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest

from kpool_pd.kvcache import CacheFamily
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from tests.e2e.test_e2e import DECODE_LIMITS, TRANSPORTS, _flags
from tests.support.cli_refusals import refused
from tests.support.served_nodes import match_and_free, pd_nodes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KPOOL, QSA = CacheFamily.KPOOL, CacheFamily.QSA
CASES = [  # family, kpool or ratio, drafts, prefill block, decode block
    pytest.param(KPOOL, 2, 5, 128, 256, id="kpool2-spec5-128-to-256"),
    pytest.param(QSA, 4, 3, 128, 256, id="qsa4-spec3-128-to-256"),
    pytest.param(KPOOL, 4, 0, 512, 128, id="kpool4-spec0-512-to-128"),
    pytest.param(QSA, 8, 5, 512, 128, id="qsa8-spec5-512-to-128"),
    pytest.param(KPOOL, 8, 4, 256, 512, id="kpool8-spec4-256-to-512"),
    pytest.param(QSA, 2, 1, 256, 512, id="qsa2-spec1-256-to-512"),
    pytest.param(KPOOL, 4, 2, 512, 128, id="kpool4-spec2-512-to-128"),
]


def _prompts(config: ModelConfig, blocks: tuple[int, int], count: int, max_tokens: int, *, seed: int,
             prefix: str) -> list[GenerateRequest]:
    """Lengths on and around the pool (group), the ring and both block sizes (1 included), then
    seeded random ones up to ``count`` requests, none over two of the larger blocks and a bit."""
    g, ring, longest = config.cache.tokens_per_entry, config.cache.ring_slots, 2 * max(blocks) + config.cache.tokens_per_entry
    bases = (g, ring, *blocks, longest - 1)
    lengths = sorted({n for base in bases for n in (base - 1, base, base + 1) if 1 <= n <= longest} | {1})
    rng = random.Random(seed)
    while len(lengths) < count:
        lengths.append(rng.randint(1, longest))
    prompts = make_prompts(count, max(lengths), seed=seed, vocab_size=config.vocab_size, max_tokens=max_tokens,
                           prefix=prefix)
    return [GenerateRequest(request_id=p.request_id, prompt=p.prompt[:n], max_tokens=max_tokens)
            for p, n in zip(prompts, lengths[:count])]


@pytest.mark.parametrize("family,group,num_spec,prefill_block,decode_block", CASES)
def test_pd_with_different_block_sizes_equals_colocated(family, group, num_spec, prefill_block, decode_block):
    key = "kpool" if family is KPOOL else "compress_ratio"
    configs = [ModelConfig.build(family=family, num_layers=2, num_spec=num_spec, seed=group + num_spec, block_size=size,
                           **{key: group}) for size in (prefill_block, decode_block)]
    prefill_config, decode_config = configs
    longest = ["--max-prompt-tokens", str(2 * max(prefill_block, decode_block) + group)]
    max_tokens = max(10, group + num_spec + 2)
    batches = {t: _prompts(decode_config, (prefill_block, decode_block), 12, max_tokens, seed=num_spec,
                           prefix=t) for t in TRANSPORTS}
    references = {t: run_colocated(decode_config, batches[t]) for t in TRANSPORTS}

    async def main():
        async with pd_nodes(_flags(prefill_config), TRANSPORTS, decode_model=_flags(decode_config),
                            prefill_extra=["--num-blocks", "128"],
                            decode_extra=[*DECODE_LIMITS, *longest, "--health-interval-s", "0.5"]) as (prefill, decodes):
            await match_and_free(prefill, decodes, batches, references)
    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_up_with_different_block_sizes_equals_colocated(transport):
    """``kpool-pd up`` runs the prefill daemon with 128-token blocks and the decode daemon with 256, and
    checks against the colocated run itself; ``--colocated`` with the decode block size agrees."""
    flags = ("--requests", "3", "--prompt-len", "300", "--max-tokens", "6", "--kpool", "2", "--num-spec", "3")
    code, rows, stderr = _up(*flags, "--prefill-block-size", "128", "--decode-block-size", "256",
                             "--transport", transport)
    assert code == 0, stderr
    *requests, last = rows
    assert last["summary"]["ok"] == last["summary"]["colocated_match"] == 3
    assert (last["summary"]["model"]["block_size"], last["summary"]["model"]["prefill_block_size"]) == (256, 128)
    assert "128-token blocks" in stderr and "256-token blocks" in stderr
    code, colocated, _ = _up(*flags, "--block-size", "256", "--colocated")
    assert code == 0
    assert [(r["tokens"], r["state_digest"]) for r in colocated[:-1]] == [(r["tokens"], r["state_digest"])
                                                                         for r in requests]


def test_up_refuses_a_bad_block_size_before_starting_anything(capsys):
    code, stderr = refused(capsys, "up", "--json", "--prefill-block-size", "130", "--decode-block-size", "256")
    assert code == 2
    assert "block_size 130" in stderr and "starting" not in stderr
    code, stderr = refused(capsys, "up", "--json", "--prefill-block-size", "-1")
    assert code == 2 and "--prefill-block-size must be >= 0" in stderr
    code, stderr = refused(capsys, "up", "--json", "--prefill-block-size", "128", "--decode-block-size", "256",
                           "--dcp", "2")
    assert code == 2 and "needs one block size for prefill and decode, got 128 and 256" in stderr


def _up(*flags: str) -> tuple[int, list[dict], str]:
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "up", "--json", *flags], capture_output=True, text=True,
                          timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, rows, proc.stderr
