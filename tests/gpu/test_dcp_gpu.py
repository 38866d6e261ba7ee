"""Decode-context parallelism on GPUs: two ranks, one GPU each, joined by NCCL, equal the colocated
run on the GPU byte for byte, at the model level and through the daemons (``kpool-pd up --dcp 2
--device cuda``). Needs two GPUs (the H200 pair: ``nvidia-h200-x2``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from tests.support.dcp_ranks import DcpCase, run_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: run tests/gpu/run_all.sh on "
                                                             "the H200 pair"),
]


def _requests(lengths: list[int], max_tokens: int) -> tuple[GenerateRequest, ...]:
    base = make_prompts(len(lengths), max(lengths), seed=4, vocab_size=1024, max_tokens=max_tokens)
    return tuple(GenerateRequest(request_id=r.request_id, prompt=r.prompt[:n], max_tokens=max_tokens)
                 for r, n in zip(base, lengths))


@pytest.mark.parametrize("kpool,num_spec,interleave", [(4, 3, None), (2, 0, 6), (8, 3, 8)],
                         ids=["kpool4-spec3-block", "kpool2-spec0-three-pools", "kpool8-spec3-one-pool"])
def test_two_ranks_over_nccl_equal_the_colocated_run_on_the_gpu(kpool, num_spec, interleave):
    config = ModelConfig.build(kpool=kpool, num_spec=num_spec, num_layers=2)
    block = config.cache.block_size
    edge = interleave or block
    lengths = sorted({1, kpool - 1, kpool, kpool + 1, block - 1, block, block + 1, edge + 1, 2 * edge - 1, 2 * edge,
                      2 * edge + 1, 700} - {0})
    case = DcpCase(config=config, interleave=interleave, requests=_requests(lengths, 24))
    (got,) = run_processes(2, [case], device="cuda")
    reference = run_colocated(config, case.requests, device="cuda:0")
    assert got == [(r.tokens, r.output_digest, r.state_digest) for r in reference]


def test_up_with_two_dcp_ranks_on_gpus_equals_colocated():
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "up", "--json", "--dcp", "2", "--device", "cuda",
                           "--requests", "6", "--prompt-len", "300", "--max-tokens", "24"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.splitlines()[-1])["summary"]
    assert summary["dcp"] == 2 and summary["ok"] == summary["colocated_match"] == 6
