"""The daemons on GPUs: a prefill daemon with its pool on cuda:0 and a decode daemon on cuda:1
(cuda:0 with one GPU), pulling over UCX (cuda_ipc between the two GPUs) and over the gRPC stream;
every request's tokens and state digest must equal the colocated run on the GPU, byte for byte."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys

import pytest
import torch

from kpool_pd.connector import ucx_available
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.kvcache import CacheFamily
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from kpool_pd.runtime import model_flags, model_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run tests/gpu/run_all.sh on the H200"),
]

READY_S = 240
LENGTHS = [1, 3, 63, 64, 65, 130, 200, 257, 500, 640, 700, 17]  # on and around pool, ring and block boundaries
TRANSPORTS = ["ucx", "grpc"] if ucx_available() else ["grpc"]


def _colocated_on_gpu(config: ModelConfig, requests):
    return {r.request_id: r for r in run_colocated(config, requests, device="cuda:0")}


@pytest.mark.parametrize("prefill_block", [None, 128], ids=["same-blocks", "prefill-128-blocks"])
@pytest.mark.parametrize("family", [CacheFamily.KPOOL, CacheFamily.QSA], ids=lambda f: f.value)
def test_gpu_daemons_equal_colocated(tmp_path, family, prefill_block):
    """``prefill-128-blocks``: the prefill daemon stores 128-token blocks, the decode daemon its default 256
    (the Triton token repack places the staged prompt on the decode GPU)."""
    config = ModelConfig.build(family=family, num_layers=2, num_spec=3, seed=11)
    flags = model_flags(model_settings(config))
    prefill_flags = model_flags(model_settings(dataclasses.replace(config, cache=dataclasses.replace(config.cache, block_size=prefill_block or config.cache.block_size))))
    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    prefill = start_prefill(tmp_path, prefill_flags, extra=["--device", "cuda:0", "--num-blocks", "512", "--log-format", "text"])
    decodes = []
    try:
        prefill.wait_ready(READY_S)
        decodes = [start_decode(tmp_path, flags, [f"127.0.0.1:{prefill.port}"], name=f"decode-{t}", transport=t,
                                extra=["--device", decode_device, "--log-format", "text", "--max-running", "16"])
                   for t in TRANSPORTS]
        for d in decodes:
            d.wait_ready(READY_S)
        for transport, decode in zip(TRANSPORTS, decodes):
            prompts = make_prompts(len(LENGTHS), max(LENGTHS), seed=3, vocab_size=config.vocab_size, max_tokens=24,
                                   prefix=transport)
            requests = [GenerateRequest(request_id=p.request_id, prompt=p.prompt[:n], max_tokens=p.max_tokens)
                        for p, n in zip(prompts, LENGTHS)]
            reference = _colocated_on_gpu(config, requests)
            results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests))
            failed = [r for r in results if isinstance(r, RequestFailed)]
            assert not failed, f"{len(failed)} failed over {transport}: {failed[0]}\n{decode.log_tail()}"
            for r in results:
                want = reference[r.request_id]
                assert (r.tokens, r.output_digest, r.state_digest) == (want.tokens, want.output_digest, want.state_digest), \
                    f"{transport} {r.request_id}"
                assert r.transport == transport
    finally:
        for d in (*decodes, prefill):
            d.signal(signal.SIGTERM)
        for d in (*decodes, prefill):
            d.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_up_on_the_gpu_equals_its_colocated_run(transport):
    """``kpool-pd up --device cuda``: prefill on cuda:0, decode on cuda:1 when there are two GPUs;
    its own check against the colocated run on the GPU passes, and the summary says where each ran."""
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "up", "--device", "cuda", "--json", "--transport", transport,
                           "--requests", "4", "--prompt-len", "300", "--max-tokens", "12"],
                          capture_output=True, text=True, timeout=READY_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])["summary"]
    assert summary["ok"] == summary["colocated_match"] == 4
    assert summary["prefill_device"] == "cuda:0"
    assert summary["decode_device"] == ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
