"""The rows of ``kpool-pd bench vllm`` that run one engine and no PD pair: the floor (the prompts served from the
engine's own prefix cache) and no-transfer (vLLM's DecodeBenchConnector: the prompts' KV claimed, none moved)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from kpool_pd.bench.vllm_bench_engines import start_engines
from kpool_pd.bench.vllm_rows import Connector, Rep, Scenario, token_mismatch


class _OneEngine:
    """A row's one engine: ``config`` its kv_transfer_config (None: no connector), ``prefix_caching`` vLLM's."""

    connector: Connector
    config: dict | None = None
    prefix_caching = False

    def __init__(self, model: str, max_model_len: int, out: Path) -> None:
        [self.engine] = start_engines(self.connector, [("engine", self.config, {})], model, max_model_len, out,
                                      prefix_caching=self.prefix_caching)

    def ready(self) -> None:
        self.engine.wait_ready()

    def stop(self) -> None:
        self.engine.process.stop()


class FloorEngine(_OneEngine):
    """The floor: one engine with no connector and its prefix cache on. A rep sends the scenario's prompts
    (it computes them), then the same generate again, timed: the prompts' KV comes from its own cache (a
    prompt's last token, and any tail short of a block, are computed again, as after a pull). Its tokens
    must equal the first generate's."""

    connector = Connector.FLOOR
    prefix_caching = True

    def rep(self, scenario: Scenario, number: int) -> Rep:
        prompts = scenario.prompts(number)
        computed = self.engine.run(prompts, scenario.new_tokens)
        started = time.perf_counter()
        cached = self.engine.run(prompts, scenario.new_tokens)
        done = time.perf_counter()
        got, want = [o[0] for o in cached.outputs], [o[0] for o in computed.outputs]
        differing, first = token_mismatch(got, want)
        return Rep(prefill_s=None, consumer_s=done - started, same_tokens=not differing,
                   pulled_tokens=cached.prompt_tokens.get("local_cache_hit", 0),
                   differing_requests=differing, first_difference=first)


# vLLM's DecodeBenchConnector: every prompt token but the last counted as loaded, no bytes moved; the KV cache
# filled with a constant once, when the engine starts (startup_fill), so that a request's steps do no filling
DECODE_BENCH_CONFIG = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"startup_fill": True, "fill_std": 0.0}}
DECODE_BENCH_MODULE = Path("distributed", "kv_transfer", "kv_connector", "v1", "decode_bench_connector.py")


class NoTransferEngine(_OneEngine):
    """The consumer phase of a transfer that takes no time: one engine with vLLM's DecodeBenchConnector
    (``DECODE_BENCH_CONFIG``), which claims every prompt token but the last as loaded and moves nothing. A
    rep sends the scenario's prompts, timed: the engine computes each prompt's last token and the new tokens
    over a constant KV, the same compute as a consumer after a pull, with no pull before it. Its tokens are
    not compared (its KV is not the prompts')."""

    connector = Connector.NO_TRANSFER
    config = DECODE_BENCH_CONFIG

    def rep(self, scenario: Scenario, number: int) -> Rep:
        prompts = scenario.prompts(number)
        started = time.perf_counter()
        job = self.engine.run(prompts, scenario.new_tokens)
        done = time.perf_counter()
        return Rep(prefill_s=None, consumer_s=done - started, same_tokens=None,
                   pulled_tokens=job.prompt_tokens.get("external_kv_transfer", 0))


def decode_bench_unavailable() -> str | None:
    """Why this vLLM cannot run the no-transfer engine (it has no DecodeBenchConnector), or None."""
    spec = importlib.util.find_spec("vllm")
    folders = list(getattr(spec, "submodule_search_locations", None) or [])
    if not folders or any((Path(folder) / DECODE_BENCH_MODULE).exists() for folder in folders):
        return None
    return f"this vLLM has no DecodeBenchConnector ({Path(folders[0]) / DECODE_BENCH_MODULE} is missing)"


ONE_ENGINE = {Connector.FLOOR: FloorEngine, Connector.NO_TRANSFER: NoTransferEngine}  # the one-engine rows
