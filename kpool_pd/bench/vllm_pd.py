"""Time to first token of a vLLM PD pair (a kv_producer and a kv_consumer engine, two processes, a 2-layer
Llama of seeded weights on the CPU) with KpoolPdConnector over UCX and over the gRPC stream and with vLLM's
NixlConnector (kv_buffer_device cpu), one connector after the other in one run, at each prompt length.
Prints per connector and length the median prefill time (the producer's one-token prefill), the median
time the consumer takes from the decode request to its first token (the pull of the prompt's KV plus one
token's compute: the compute is the same whatever the connector, so the difference between connectors is
the transfer), their sum (TTFT), its ratio to NixlConnector's, and whether the consumer's first token
equals one engine's.

    python -m kpool_pd.bench.vllm_pd --tokens 1024,8192 --reps 5     (kpool-pd bench vllm)

Its first line names the folder it writes to (--out DIR, else a new temporary folder): vllm_pd.json, and
each engine's log (<connector>-producer.log, <connector>-consumer.log), which takes everything the engine
prints (vLLM's logging and warnings included). The terminal shows the bench's progress, a line a phase,
and its table; an engine that fails shows the end of its log and the log's path.

Needs vLLM (pip install -e '.[vllm]', see README) and, for the NixlConnector rows, nixl (pip install nixl).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import queue
import random
import secrets
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

from kpool_pd.bench import vllm_engines
from kpool_pd.bench.arguments import bench_parser, count, counts

logger = logging.getLogger("kpool_pd.bench.vllm_pd")

OUT_PREFIX = "kpoolpd-bench-vllm-"  # a default output folder's name starts so
LOG_TAIL_LINES = 40  # of a failed engine's log, shown on the terminal
READY_POLL_S = 2.0  # how often a starting engine's process is checked for life


class Connector(Enum):
    KPOOL_UCX = "kpool-ucx"
    KPOOL_GRPC = "kpool-grpc"
    NIXL = "nixl"


@dataclass(frozen=True)
class Row:
    connector: str
    tokens: int
    reps: int
    prefill_ms: float  # median, the producer's one-token prefill
    decode_first_token_ms: float  # median, the consumer's pull plus one token
    ttft_ms: float  # prefill_ms + decode_first_token_ms
    same_tokens: bool  # the consumer's first token equals one engine's, every rep
    pulled_tokens: int  # prompt tokens vLLM counted as loaded by the connector (the rest it computed)


def transfer_configs(connector: Connector, ports: list[int]) -> tuple[dict, dict, dict, dict]:
    """(producer config, consumer config, producer env, consumer env) of one connector."""
    if connector is Connector.NIXL:
        def nixl(role: str) -> dict:
            return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        return (nixl("kv_producer"), nixl("kv_consumer"), {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[0])},
                {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[1])})
    token = {"KPOOLPD_PEER_TOKEN": secrets.token_hex(16)}
    transport = "ucx" if connector is Connector.KPOOL_UCX else "grpc"
    kpool = vllm_engines.kpool_transfer_config
    return (kpool("kv_producer", {"listen": f"127.0.0.1:{ports[0]}", "transport": transport}),
            kpool("kv_consumer", {"transport": transport, "producers": [f"127.0.0.1:{ports[0]}"]}), token, token)


def unused_port() -> int:
    """A port the OS just handed out on loopback (free a moment ago; the engine binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


class _Engine:
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


def measure(connector: Connector, model: str, lengths: list[int], reps: int, max_model_len: int, out: Path,
            progress: Callable[[str], None] = logger.info) -> list[Row]:
    """One producer and one consumer engine of ``connector``, their output in their logs in ``out``
    (``engine_log``); ``reps`` PD requests of each length, one at a time, after one warm-up request (the
    connections, the first pull); each rep a new random prompt. ``progress`` gets a line per phase.
    EngineFailed when an engine fails."""
    ports = [unused_port(), unused_port()]
    producer_config, consumer_config, producer_env, consumer_env = transfer_configs(connector, ports)
    context = multiprocessing.get_context("spawn")
    engines = []
    for role, config, env in (("producer", producer_config, producer_env),
                              ("consumer", consumer_config, consumer_env)):
        log = engine_log(out, connector, role)
        log.write_text("")  # this run's output only
        engines.append(_Engine(f"{connector.value} {role}", log, vllm_engines.EngineProcess(
            context, model, config, max_model_len=max_model_len, env=env, log=log)))
    producer, consumer = engines
    rng = random.Random(0)

    def pd_once(tokens: int) -> tuple[float, float, bool, int]:
        """One PD request: (prefill s, consumer's first token s, same tokens as one engine, pulled tokens)."""
        prompt = [rng.randrange(3, vllm_engines.TINY_LLAMA["vocab_size"]) for _ in range(tokens)]
        started = time.perf_counter()
        params = producer.run([prompt], 1, [{"do_remote_decode": True}]).outputs[0][2]
        prefilled = time.perf_counter()
        decoded = consumer.run([prompt], 1, [params])  # the pull, then the prompt's last token: the first token
        done = time.perf_counter()
        alone = consumer.run([prompt], 1)  # no params: the consumer computes the prompt itself
        return (prefilled - started, done - prefilled, decoded.outputs[0][0] == alone.outputs[0][0],
                decoded.prompt_tokens.get("external_kv_transfer", 0))

    try:
        started = time.perf_counter()
        producer.wait_ready()
        consumer.wait_ready()
        progress(f"{connector.value}: engines ready in {time.perf_counter() - started:.0f} s; a warm-up request")
        pd_once(min(lengths))  # warm-up: the connections, the first pull
        rows = []
        for tokens in lengths:
            runs = [pd_once(tokens) for _ in range(reps)]
            prefill = statistics.median(r[0] for r in runs)
            first = statistics.median(r[1] for r in runs)
            rows.append(Row(connector=connector.value, tokens=tokens, reps=reps, prefill_ms=prefill * 1e3,
                            decode_first_token_ms=first * 1e3, ttft_ms=(prefill + first) * 1e3,
                            same_tokens=all(r[2] for r in runs), pulled_tokens=sum(r[3] for r in runs)))
            progress(f"{connector.value}, {tokens} tokens: TTFT {rows[-1].ttft_ms:.1f} ms")
        return rows
    finally:
        consumer.process.stop()
        producer.process.stop()


def table(rows: list[Row]) -> str:
    """The rows side by side, with each TTFT's ratio to NixlConnector's at the same length."""
    nixl = {r.tokens: r.ttft_ms for r in rows if r.connector == Connector.NIXL.value}
    lines = [f"{'connector':<11} {'tokens':>6} {'prefill ms':>10} {'pull+1 tok ms':>13} {'TTFT ms':>8} "
             f"{'vs NIXL':>7} {'pulled':>7} same tokens"]
    for r in sorted(rows, key=lambda r: (r.tokens, r.connector)):
        ratio = f"{r.ttft_ms / nixl[r.tokens]:.2f}x" if r.tokens in nixl else "-"
        lines.append(f"{r.connector:<11} {r.tokens:>6} {r.prefill_ms:>10.1f} {r.decode_first_token_ms:>13.1f} "
                     f"{r.ttft_ms:>8.1f} {ratio:>7} {r.pulled_tokens:>7} {'yes' if r.same_tokens else 'NO'}")
    return "\n".join(lines)


def _say(line: str) -> None:
    """One line of the bench's progress on the terminal (stderr; the table goes to stdout)."""
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kpool-pd bench vllm", __doc__)
    parser.add_argument("--tokens", type=counts, default=[1024, 8192], metavar="N,N",
                        help="prompt lengths in tokens (default 1024,8192)")
    parser.add_argument("--reps", type=count, default=5, help="PD requests per length and connector (default 5)")
    parser.add_argument("--connectors", default=",".join(c.value for c in Connector), metavar="NAME,NAME",
                        help="which connectors, in order (default: all of " +
                             ", ".join(c.value for c in Connector) + ")")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder for vllm_pd.json and the engines' logs, made if missing (default: a new "
                             f"temporary folder, {OUT_PREFIX}*, named on the first line)")
    args = parser.parse_args(argv)
    try:
        connectors = [Connector(name.strip()) for name in args.connectors.split(",")]
    except ValueError:
        parser.error(f"--connectors: expected names among {[c.value for c in Connector]}, got {args.connectors!r}")
    missing = [f"{name} ({hint})" for name, hint, needed in (
        ("vllm", "pip install -e '.[vllm]', see README", True),
        ("nixl", "pip install nixl, or leave nixl out of --connectors", Connector.NIXL in connectors))
        if needed and importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: kpool-pd bench vllm needs {' and '.join(missing)}", file=sys.stderr)
        return 2
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix=OUT_PREFIX))
    else:
        out = args.out
        out.mkdir(parents=True, exist_ok=True)
    _say(f"kpool-pd bench vllm: writing to {out}")
    _say("vLLM's output goes to a log per engine there: <connector>-producer.log and <connector>-consumer.log")
    max_model_len = max(args.tokens) + 16
    rows: list[Row] = []
    failure: EngineFailed | None = None
    with tempfile.TemporaryDirectory(prefix="kpoolpd-bench-vllm-model-") as folder:
        _say("writing the model (a 2-layer Llama, seeded weights)")
        model = str(vllm_engines.write_model(Path(folder) / "model", max_positions=max_model_len))
        for connector in connectors:
            _say(f"{connector.value}: starting a producer and a consumer engine (logs "
                 f"{engine_log(out, connector, 'producer').name}, {engine_log(out, connector, 'consumer').name})")
            try:
                rows += measure(connector, model, args.tokens, args.reps, max_model_len, out, progress=_say)
            except EngineFailed as failed:
                failure = failed
                break
    results = out / "vllm_pd.json"
    results.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if failure is not None:
        tail = log_tail(failure.log)
        print(f"error: {failure}; the last {len(tail)} lines of its log, {failure.log}:", file=sys.stderr)
        print("\n".join(f"  {line}" for line in tail), file=sys.stderr, flush=True)
    if rows:
        print(table(rows))
    _say(f"results: {results}")
    return 0 if failure is None and all(r.same_tokens for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
