"""An engine of ``kpool-pd bench vllm`` under a name: started in a process of its own (``start_engines``) with its
output in a log of the run's folder (``engine_log``), its failures (a traceback, no answer in time, a process
that died) raised as ``EngineFailed`` naming it and its log, whose tail the bench shows (``log_tail``)."""

from __future__ import annotations

import multiprocessing
import queue
import time
from pathlib import Path

from kpool_pd.bench import vllm_engines
from kpool_pd.bench.vllm_rows import Connector

LOG_TAIL_LINES = 40  # of a failed engine's log, shown on the terminal
READY_POLL_S = 2.0  # how often a starting engine's process is checked for life


class EngineFailed(Exception):
    """An engine of the bench failed: ``name`` (e.g. ``kpool-grpc consumer``), ``why`` in a line, and
    ``log``, the file its output went to."""

    def __init__(self, name: str, why: str, log: Path) -> None:
        super().__init__(f"the {name} engine failed: {why}")
        self.name, self.why, self.log = name, why, log


def engine_log(out: Path, connector: Connector, role: str) -> Path:
    """The file an engine's output goes to: ``<out>/<connector>-<role>.log``."""
    return out / f"{connector.value}-{role}.log"


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of ``log`` (none when it is missing)."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return text.splitlines()[-lines:]


class NamedEngine:
    """An EngineProcess under a name, whose failures (a traceback, no answer in time, a process that died)
    are raised as EngineFailed naming it and its log."""

    def __init__(self, name: str, log: Path, process: vllm_engines.EngineProcess) -> None:
        self.name, self.log, self.process = name, log, process

    def _failed(self, why: str) -> EngineFailed:
        return EngineFailed(self.name, why, self.log)

    @staticmethod
    def _last_line(error: AssertionError) -> str:
        """The exception's own line of the engine's traceback (the last one not indented), 200 characters."""
        lines = str(error).splitlines()[1:]  # after "engine failed:"
        found = next((line for line in reversed(lines) if line.strip() and not line[0].isspace()), "no traceback")
        return found[:200]

    def wait_ready(self, timeout_s: float = vllm_engines.ENGINE_START_S) -> None:
        """Until the engine is ready; EngineFailed when it failed, its process died, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.process.wait_ready(timeout_s=max(0.0, min(READY_POLL_S, deadline - time.monotonic())))
                return
            except AssertionError as error:
                raise self._failed(self._last_line(error)) from None
            except queue.Empty:
                if not self.process.process.is_alive():
                    raise self._failed(f"its process exited with code {self.process.process.exitcode} before it "
                                       "was ready") from None
                if time.monotonic() >= deadline:
                    raise self._failed(f"not ready within {timeout_s:g} s") from None

    def run(self, prompts: list[list[int]], max_tokens: int,
            params: list[dict | None] | None = None) -> vllm_engines.Job:
        try:
            return self.process.run(prompts, max_tokens, params)
        except AssertionError as error:
            raise self._failed(self._last_line(error)) from None
        except queue.Empty:
            raise self._failed(f"no answer to a job within {vllm_engines.JOB_S} s") from None


def start_engines(connector: Connector, roles: list[tuple[str, dict | None, dict]], model: str, max_model_len: int,
           out: Path, **engine) -> list[NamedEngine]:
    """One engine per (role, kv_transfer_config, env), its output in ``engine_log``."""
    context = multiprocessing.get_context("spawn")
    engines = []
    for role, config, env in roles:
        log = engine_log(out, connector, role)
        log.write_text("")  # this run's output only
        engines.append(NamedEngine(f"{connector.value} {role}", log, vllm_engines.EngineProcess(
            context, model, config, max_model_len=max_model_len, env=env, log=log, **engine)))
    return engines
