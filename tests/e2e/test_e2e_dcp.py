"""End to end with decode-context parallelism: a decode daemon with ``--dcp N`` (N rank processes)
served by a prefill daemon that is not DCP equals the colocated run byte for byte, over both
transports; each rank receives only its own blocks plus the ring; and a rank killed in the middle of
its requests fails them within their deadline and leaves no block or ring in use anywhere; when
rank 0 itself is killed, the other ranks stop and remove the instance's rendezvous folder.

Prompt lengths sit on and around the pool, ring, block and interleave boundaries (1 token
included). Each case starts one prefill daemon and two DCP decode daemons (2 and 4 ranks, one per
transport), so the whole file runs about ten daemon processes per case: the matrix is kept small
(``tests/model/test_dcp_model.py`` covers kpool 2/4/8, drafts 0/3 and the interleaves at the model level).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kpool_pd.connector.shared.plan import ring_live_range
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.kvcache import BlockLayout
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from tests.support.cli_refusals import refused
from tests.support.dcp_daemons import dcp_instance
from tests.support.polling import process_alive, wait_for
from tests.support.ports import free_port
from tests.e2e.test_e2e import (
    DECODE_LIMITS,
    SETTLE_S,
    TRANSPORTS,
    _assert_match,
    _flags,
    _free_blocks,
    _logs_on_failure,
    _metric,
    _ready_and_serving,
    _stop,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_PROMPT = 512  # the decode daemons' --max-prompt-tokens (DECODE_LIMITS)
ORPHAN_STOP_S = 60.0  # ranks whose rank 0 died: SIGTERM from the kernel, a drain of nothing, their teardown


def _prompts(config: ModelConfig, interleaves: list[int], ranks: int, max_tokens: int, *, seed: int,
             prefix: str) -> list[GenerateRequest]:
    g, ring, block = config.cache.tokens_per_entry, config.cache.ring_slots, config.cache.block_size
    edges = {g, ring, block, *interleaves, *(i * ranks for i in interleaves)}
    lengths = sorted({n for e in edges for n in (e - 1, e, e + 1) if 1 <= n <= MAX_PROMPT} | {1})
    base = make_prompts(len(lengths), max(lengths), seed=seed, vocab_size=config.vocab_size, max_tokens=max_tokens,
                        prefix=prefix)
    requests = [GenerateRequest(request_id=p.request_id, prompt=p.prompt[:n], max_tokens=max_tokens)
                for p, n in zip(base, lengths)]
    # one request of a single output token: no step, its state digest alone (every rank takes part)
    return [*requests, GenerateRequest(request_id=f"{prefix}-one", prompt=base[-1].prompt[:block + 1], max_tokens=1)]


def _whole_request_bytes(config: ModelConfig, prompt_len: int, ranks: int) -> int:
    """What a decode instance of ``ranks`` ranks receives for a prompt when whole blocks move: the
    prompt's blocks once, and the ring's live slots on every rank."""
    layout = BlockLayout(config.cache)
    ring = ring_live_range(config.cache, prompt_len).num_slots * layout.ring_slot_bytes
    return config.cache.blocks_for_tokens(prompt_len) * layout.block_bytes + ranks * ring


CASES = [  # (kpool, drafts, interleave of the 2-rank decode, of the 4-rank one; 0: the block size)
    pytest.param(4, 3, 0, 0, id="kpool4-spec3-block"),
    pytest.param(2, 0, 128, 6, id="kpool2-spec0-two-blocks-and-three-pools"),
    pytest.param(8, 3, 8, 0, id="kpool8-spec3-one-pool-and-block"),
]


@pytest.mark.parametrize("kpool,num_spec,interleave2,interleave4", CASES)
def test_dcp_equals_colocated(tmp_path, kpool, num_spec, interleave2, interleave4):
    config = ModelConfig.build(num_layers=2, kpool=kpool, num_spec=num_spec, seed=kpool + num_spec)
    flags = _flags(config)
    block = config.cache.block_size
    port = free_port()
    prefill = start_prefill(tmp_path, flags, extra=["--port", str(port), "--num-blocks", "256", "--log-format", "text"])
    shapes = [(2, interleave2, TRANSPORTS[0]), (4, interleave4, TRANSPORTS[-1])]
    decodes = [start_decode(tmp_path, flags, [f"127.0.0.1:{port}"], name=f"decode-dcp{n}", transport=t,
                            extra=[*DECODE_LIMITS, "--health-interval-s", "0.5", "--dcp", str(n),
                                   "--dcp-interleave", str(i)]) for n, i, t in shapes]
    try:
        with _logs_on_failure(prefill, *decodes):
            max_tokens = max(10, kpool + 3)
            batches = [_prompts(config, [i or block], n, max_tokens, seed=n, prefix=f"dcp{n}") for n, i, _ in shapes]
            references = [run_colocated(config, batch) for batch in batches]
            _ready_and_serving(prefill, *decodes)
            start_free = [_free_blocks(d) for d in (prefill, *decodes)]

            async def everything():
                return await asyncio.gather(*(generate_all(f"127.0.0.1:{d.port}", b) for d, b in zip(decodes, batches)))
            for (ranks, interleave, transport), results, reference in zip(shapes, asyncio.run(everything()),
                                                                          references):
                failed = [r for r in results if isinstance(r, RequestFailed)]
                assert not failed, f"{len(failed)} failed on DCP {ranks} over {transport}: {failed[0]}"
                assert {r.transport for r in results} == {transport}
                _assert_match(results, reference)
                if (interleave or block) % block == 0:  # DCP adds no byte: whole blocks once, a ring per rank
                    for r in results:
                        assert r.transfer_bytes == _whole_request_bytes(config, r.prompt_len, ranks), r.request_id
            assert wait_for(lambda: [_free_blocks(d) for d in (prefill, *decodes)] == start_free, SETTLE_S)
            for decode, (ranks, _, _) in zip(decodes, shapes):  # every rank's pool is free again, and each stepped
                for rank in range(ranks):
                    labels = f'{{rank="{rank}"}}'
                    held = f"kpoolpd_decode_dcp_rank_requests{labels}"
                    assert wait_for(lambda d=decode, name=held: _metric(d, name) == 0, SETTLE_S)
                    assert _metric(decode, f"kpoolpd_decode_dcp_rank_up{labels}") == 1
                    assert _metric(decode, f"kpoolpd_decode_dcp_rank_steps{labels}") > 0
                    assert _metric(decode, f"kpoolpd_decode_dcp_rank_transfer_bytes{labels}") > 0
    finally:
        _stop(*decodes, prefill)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(found)


STOPPED = re.compile(r"decode node stopped; free: (\d+) of (\d+) blocks, (\d+) of (\d+) rings")


def test_a_rank_killed_mid_request_fails_the_requests_and_frees_every_rank_and_the_prefill(tmp_path):
    config = ModelConfig.build(num_layers=2, num_spec=3, seed=11)
    with dcp_instance(tmp_path, config, 3, transport=TRANSPORTS[0], prefill_blocks=128,
                      decode_extra=["--transfer-timeout-s", "20", "--drain-s", "10"]) as instance:
        prefill, decode, scratch = instance.prefill, instance.decode, instance.scratch
        prefill_free = _free_blocks(prefill)
        ranks = _children(decode.proc.pid)
        assert len(ranks) == 2, f"rank 0 should have started 2 rank processes, found {ranks}"
        doomed = make_prompts(4, 150, seed=12, vocab_size=config.vocab_size, max_tokens=256, prefix="doomed")

        async def scenario():
            task = asyncio.ensure_future(generate_all(f"127.0.0.1:{decode.port}", doomed))
            while not task.done() and _metric(decode, "kpoolpd_decode_running") < len(doomed):
                await asyncio.sleep(0.01)
            signal_sent = time.monotonic()
            os.kill(ranks[0], signal.SIGKILL)
            results = await task
            return results, time.monotonic() - signal_sent
        results, took = asyncio.run(scenario())
        assert all(isinstance(r, RequestFailed) and r.code == grpc.StatusCode.UNAVAILABLE and "DCP" in r.message
                   for r in results), results
        assert took < 20, f"the requests took {took:.1f} s to fail (deadline 20 s)"
        assert wait_for(lambda: _free_blocks(prefill) == prefill_free, SETTLE_S), "the prefill still holds blocks"
        # rank 0 stops by itself (the instance is broken), after freeing everything; so does rank 2
        assert wait_for(lambda: decode.proc.poll() is not None, 90), "rank 0 did not stop by itself"
        log = decode.log_path.read_text()
        stopped = STOPPED.findall(log)
        assert len(stopped) == 2, f"rank 0 and the surviving rank each report their pool: {stopped}"
        for free, total, free_rings, rings in stopped:
            assert (free, free_rings) == (total, rings), f"blocks or rings left in use: {stopped}"
        # a broken instance exits non-zero (a supervisor restarts it), blaming the rank, not the prefill node
        assert decode.proc.returncode not in (0, None), f"rank 0 exited with status {decode.proc.returncode}"
        assert re.search(r"stopped because it broke: DCP rank 1 (exited|failed)", log), log[-3000:]
        blamed = [line for line in log.splitlines() if "prefill" in line.lower() and
                  re.search(r"unusable|not usable|failed|unreachable", line, re.IGNORECASE)]
        assert not blamed, f"the log blames the prefill node for the broken rank: {blamed[:3]}"
        assert not list(scratch.iterdir()), f"rendezvous folder left behind: {list(scratch.iterdir())}"


@pytest.mark.parametrize("command", [["kpool_pd.decode_worker"], ["kpool_pd", "up"]], ids=["decode", "up"])
def test_qsa_with_dcp_is_refused_at_start_naming_dcp(capsys, command):
    flags = ("--family", "qsa", "--dcp", "2")
    if command[0] == "kpool_pd":  # up refuses before it starts a daemon: through its entry point, in this process
        code, stderr = refused(capsys, *command[1:], *flags)
    else:  # the daemon's own process
        proc = subprocess.run([sys.executable, "-m", *command, *flags], capture_output=True, text=True, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    assert code == 2, stderr
    assert "declares no decode-context parallel (DCP) support" in stderr and "got 2" in stderr
    assert "starting" not in stderr and "ready" not in stderr


def test_the_surviving_ranks_remove_the_rendezvous_folder_when_rank_0_is_killed(tmp_path):
    config = ModelConfig.build(num_layers=2, num_spec=0, seed=13)
    with dcp_instance(tmp_path, config, 3, transport=TRANSPORTS[0]) as instance:
        decode, scratch = instance.decode, instance.scratch
        ranks = _children(decode.proc.pid)
        assert len(ranks) == 2, f"rank 0 should have started 2 rank processes, found {ranks}"
        assert [p.name for p in scratch.iterdir()], "no rendezvous folder while the instance serves?"
        decode.kill()  # SIGKILL: rank 0 gets no chance to stop its ranks or remove the folder
        assert wait_for(lambda: not any(process_alive(pid) for pid in ranks), ORPHAN_STOP_S), \
            f"ranks {[pid for pid in ranks if process_alive(pid)]} outlived rank 0"
        assert wait_for(lambda: not list(scratch.iterdir()), ORPHAN_STOP_S), \
            f"rendezvous folder left behind: {list(scratch.rglob('*'))}"
