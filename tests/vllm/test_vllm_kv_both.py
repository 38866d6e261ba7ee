"""Two ``kv_both`` engines (KpoolPdConnector as producer and consumer at once, as NixlConnector allows): each
prefills for the other, over the gRPC stream, and each pulls from the other; the greedy tokens equal the
pulling engine's own, and it computes none of the prompts (vLLM's ``vllm:prompt_tokens_by_source``)."""

from __future__ import annotations

import os
import secrets

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.bench import vllm_engines  # noqa: E402
from tests.support.engine_context import engine_context  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.vllm.test_vllm_pd import check_pd_equals_single_engine  # noqa: E402

pytestmark = pytest.mark.vllm


# two engines: 3.1 GiB at the file's peak with this process (2026-12-07)
vllm_memory = module_memory(2, "tests/vllm/test_vllm_kv_both.py's engines")


@pytest.fixture(scope="module")
def both_engines(vllm_memory, tmp_path_factory):
    model = str(vllm_engines.write_model(tmp_path_factory.mktemp("tiny-llama-both")))
    token = secrets.token_hex(16)
    listens = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    context = engine_context()
    started = []
    try:
        for index in range(2):
            settings = {"listen": listens[index], "producers": [listens[1 - index]], "peer_token": token,
                        "transport": "grpc", "integrity": True, "lease_s": 60}
            started.append(vllm_engines.EngineProcess(context, model, vllm_engines.kpool_transfer_config(
                "kv_both", settings, kv_load_failure_policy="recompute")))
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_kv_both_engines_prefill_for_each_other(both_engines):
    first, second = both_engines
    check_pd_equals_single_engine(first, second, seed=11, groups=1)
    check_pd_equals_single_engine(second, first, seed=12, groups=1)
