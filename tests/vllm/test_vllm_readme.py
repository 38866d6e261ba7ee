"""The README's vLLM commands for a CPU machine (the block after ``<!-- vllm-cpu-commands -->``), run as written
from a fresh folder: they make the runnable model (``kpool-pd vllm-model``), start a producer and a consumer
``vllm serve`` and ``kpool-pd router``, wait for them and send a completion. Then an OpenAI client sends
completions and chats through the router, streamed and not, the very first of them on a cold pair: each
answer equals the one server alone (the producer, asked with no kv_transfer_params: it computes the prompt
itself), and the consumer computed none of the prompts (vLLM's ``vllm:prompt_tokens_by_source``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
openai = pytest.importorskip("openai", reason="the OpenAI client comes with vLLM")

from tests.support import vllm_servers  # noqa: E402
from tests.support.machine_lock import machine_lock  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.paths import REPO  # noqa: E402
from tests.support.user_folders import shadowed, shadowing_folder  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

MARKER = "vllm-cpu-commands"
PORTS = {"producer": 8100, "consumer": 8200, "router": 8000}
COMMANDS_S = 900  # installs nothing: the servers' start and warm-up on a loaded 2-core machine
CLIENT_TIMEOUT_S = 300
MAX_TOKENS = 8


def readme_commands() -> str:
    text = (REPO / "README.md").read_text()
    found = re.search(rf"<!-- {MARKER} -->\s*```sh\n(.+?)\n```", text, flags=re.S)
    assert found, f"README.md has no sh block after <!-- {MARKER} -->"
    return found.group(1)


def test_the_readme_names_the_ports_this_test_checks():
    commands = readme_commands()
    for port in PORTS.values():
        assert f"{port}" in commands
    assert "kpool-pd vllm-model tiny-llama" in commands and "--middleware kpool_pd.vllm.KvTransferParamsGuard" in commands


# the README's two servers and router: 4.1 GiB at the file's peak with this process (2026-12-07)
vllm_memory = module_memory(3, "the README's servers")


@pytest.fixture(scope="module")
def deployment(vllm_memory, tmp_path_factory):
    """The README's commands run by bash in a fresh folder, in a session of their own; yields (folder, the
    commands' output). Every process they started is stopped afterwards. Their ports are the README's: a copy of
    the suite running beside this one on the machine waits for the lock (``machine_lock``) until these are gone."""
    with machine_lock("readme-ports", COMMANDS_S):
        yield from run_readme_commands(tmp_path_factory)


def run_readme_commands(tmp_path_factory):
    """The commands in a fresh folder, by bash in a session of its own: yields (folder, their output), then stops
    every process they started."""
    folder = shadowing_folder(tmp_path_factory.mktemp("vllm-readme"))  # a user's folder: model/, runtime/, kernels/...
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    shell = subprocess.Popen(["bash", "-e", "-c", readme_commands()], cwd=folder, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            output, _ = shell.communicate(timeout=COMMANDS_S)
        except subprocess.TimeoutExpired:
            shell.kill()
            output, _ = shell.communicate()
            pytest.fail(f"the README's commands did not finish within {COMMANDS_S} s:\n{tails(folder)}")
        assert shell.returncode == 0, f"the README's commands exited {shell.returncode}:\n{output.decode()}\n{tails(folder)}"
        yield folder, output.decode()
    finally:
        try:
            os.killpg(shell.pid, signal.SIGTERM)  # the servers the commands left running in the background
        except ProcessLookupError:
            pass
        for name in ("vllm.entrypoints.openai.api_server --model tiny-llama", "kpool_pd router --prefill"):
            subprocess.run(["pkill", "-KILL", "-f", name], check=False)


def tails(folder: Path) -> str:
    return "\n".join(f"--- {name}:\n" + "\n".join((folder / name).read_text(errors="replace").splitlines()[-30:])
                     for name in ("producer.log", "consumer.log", "router.log") if (folder / name).exists())


def client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=CLIENT_TIMEOUT_S,
                         max_retries=0)


def completion(port: int, prompt: str, *, stream: bool) -> str:
    answer = client(port).completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                             stream=stream, extra_body={"ignore_eos": True})
    if not stream:
        return answer.choices[0].text
    return "".join(choice.text for chunk in answer for choice in chunk.choices)


def chat(port: int, text: str, *, stream: bool) -> str:
    messages = [{"role": "user", "content": text}]
    answer = client(port).chat.completions.create(model="tiny-llama", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0.0, stream=stream, extra_body={"ignore_eos": True})
    if not stream:
        return answer.choices[0].message.content
    return "".join(choice.delta.content or "" for chunk in answer for choice in chunk.choices)


def local_compute(port: int) -> float:
    server = vllm_servers.Server.__new__(vllm_servers.Server)
    server.port = port
    return vllm_servers.prompt_tokens_by_source(server.metrics()).get("local_compute", 0.0)


def test_the_readme_commands_answer_and_every_request_equals_one_server(deployment):
    folder, output = deployment
    for log in ("producer.log", "consumer.log", "router.log"):  # started beside model/, runtime/, kernels/...
        assert not shadowed((folder / log).read_text(errors="replace")), log
    answer = json.loads(output.strip().splitlines()[-1])  # the README's own curl, the pair's first request
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["choices"][0]["text"] == completion(PORTS["producer"], "Hello, PD!", stream=False)

    computed = local_compute(PORTS["consumer"])
    asks = [("completion", "The quick brown fox", False), ("completion", "jumps over " * 40, True),
            ("chat", "What is a KV cache?", False), ("chat", "Say it twice. " * 20, True)]
    for kind, text, stream in asks:
        ask = completion if kind == "completion" else chat
        through_router = ask(PORTS["router"], text, stream=stream)
        alone = ask(PORTS["producer"], text, stream=stream)
        assert through_router == alone, f"{kind} (stream {stream}): {through_router!r} through the router, {alone!r} alone"
    assert local_compute(PORTS["consumer"]) == computed, "the consumer computed prompt tokens it should have pulled"
