"""Time to first token of a vLLM PD pair (a kv_producer and a kv_consumer engine, two processes, a 2-layer Llama of
seeded weights on the CPU) with KpoolPdConnector over UCX (kpool-ucx: each grant pulled when its decode request
comes; kpool-ucx-prefetch: the proxy names the consumer in the prefill request, ``prefetch_by``, so the producer
announces each grant to it and it pulls the grant before its decode request comes; kpool-ucx-prefetch-idle: the same,
the producer announcing at its first step that computes nothing) and over the gRPC stream, with vLLM's NixlConnector
(kv_buffer_device cpu) and with vLLM's MooncakeConnector (TCP), one connector after the other in one run
(--together: all of them up at once, each rep run on every connector in turn), each with both engines up before its
first request; the floor: the same generate served from one engine's own prefix cache (no transfer); and
no-transfer: the consumer phase's compute alone, one engine with vLLM's DecodeBenchConnector, which claims the prompts'
KV and moves none (what any connector's consumer phase would be if its transfer took no time; its tokens are not
compared). Each scenario sends its requests at once: one request per prompt length (--tokens; the consumer makes one
token, so the sum is TTFT), and --concurrent N requests of mixed lengths (7 to 2,000 tokens, the consumer makes
--new-tokens each). Every connector gets the same prompts. Prints per connector and scenario the median prefill
phase (the producer's generate of one token), the median consumer phase (the pull of the prompts' KV plus the new
tokens' compute: the compute is the same whatever the connector, so the difference between connectors is the
transfer), their sum, the consumer phase's and the sum's ratio to the fastest of vLLM's connectors in the run (for
vLLM's own: the fastest other one), the consumer phase less the no-transfer engine's (what the transfer added), and
whether the consumer's tokens equal one engine's (where not, how many requests of a rep differed at most, and from
which new token: 0 the first).

    python -m kpool_pd.bench.vllm_pd --tokens 1024,8192 --reps 3     (kpool-pd bench vllm)

Its first line names the folder it writes to (--out DIR, else a new temporary folder): vllm_pd.json, and
each engine's log (<connector>-producer.log, <connector>-consumer.log; the floor's floor-engine.log, the
no-transfer engine's no-transfer-engine.log), which
takes everything the engine prints (vLLM's logging and warnings included). The terminal shows the bench's
progress, a line a phase, and its table; an engine that fails shows the end of its log and the log's path.

Needs vLLM (pip install -e '.[vllm]', see README); for the NixlConnector rows nixl (pip install nixl); for
the MooncakeConnector rows the Mooncake Transfer Engine (kpool_pd/bench/vllm_mooncake.py says how to
install it): without it they are skipped, with the reason printed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kpool_pd.bench import vllm_engines, vllm_mooncake
from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.bench.vllm_bench_engines import EngineFailed, engine_log, log_tail, start_engines
from kpool_pd.bench.vllm_one_engine import ONE_ENGINE, decode_bench_unavailable
from kpool_pd.bench.vllm_rows import (MIXED_LONGEST, MIXED_SHORTEST, Connector, Rep, Row, Scenario,
                                      label, mixed_lengths, row_of, table, token_mismatch)
from kpool_pd.runtime.ports import spare_ports

logger = logging.getLogger("kpool_pd.bench.vllm_pd")

OUT_PREFIX = "kpoolpd-bench-vllm-"  # a default output folder's name starts so


@dataclass(frozen=True)
class Handover:
    """The PD proxy's part: the prefill requests' params, and the decode requests' from them and the
    producer's answers. NixlConnector's protocol (KpoolPdConnector speaks it) unless ``mooncake``."""

    mooncake: vllm_mooncake.MooncakeProxy | None = None
    prefetch_by: str = ""  # KpoolPdConnector: the consumer's vLLM engine_id, named to the producer (prefetch)

    def prefill_params(self, requests: int) -> list[dict]:
        if self.mooncake is None:
            named = {"prefetch_by": self.prefetch_by} if self.prefetch_by else {}
            return [{"do_remote_decode": True} | named for _ in range(requests)]
        return [self.mooncake.prefill_params(self.mooncake.new_transfer_id()) for _ in range(requests)]

    def decode_params(self, prefill: list[dict], answers: list[dict | None]) -> list[dict | None]:
        if self.mooncake is None:
            return answers
        return [self.mooncake.decode_params(p["transfer_id"]) for p in prefill]


def transfer_configs(connector: Connector, ports: list[int]) -> tuple[dict, dict, dict, dict]:
    """(producer config, consumer config, producer env, consumer env) of one connector."""
    if connector is Connector.NIXL:
        def nixl(role: str) -> dict:
            return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        return (nixl("kv_producer"), nixl("kv_consumer"), {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[0])},
                {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[1])})
    if connector is Connector.MOONCAKE:
        return (vllm_mooncake.transfer_config("kv_producer"), vllm_mooncake.transfer_config("kv_consumer"),
                vllm_mooncake.engine_env(ports[0]), vllm_mooncake.engine_env(ports[1]))
    token = {"KPOOLPD_PEER_TOKEN": secrets.token_hex(16)}
    transport = "grpc" if connector is Connector.KPOOL_GRPC else "ucx"
    kpool = vllm_engines.kpool_transfer_config
    announce = "idle" if connector is Connector.KPOOL_UCX_PREFETCH_IDLE else "computed"
    return (kpool("kv_producer", {"listen": f"127.0.0.1:{ports[0]}", "transport": transport, "announce": announce}),
            kpool("kv_consumer", {"transport": transport, "producers": [f"127.0.0.1:{ports[0]}"]},
                  engine_id=consumer_engine_id(ports)), token, token)


PREFETCHING = (Connector.KPOOL_UCX_PREFETCH, Connector.KPOOL_UCX_PREFETCH_IDLE)  # rows whose proxy names the consumer


def consumer_engine_id(ports: list[int]) -> str:
    """The vLLM engine_id a KpoolPdConnector consumer of the pair on ``ports`` runs as (what its proxy names)."""
    return f"bench-consumer-{ports[1]}"

class PdPair:
    """A connector's producer and consumer engines, started at once (``ready`` waits for them); a rep sends the
    scenario's prompts to the producer at once, then to the consumer at once with the params the proxy makes
    of the producer's answers, then to the consumer alone (no params: it computes them) to compare tokens."""

    def __init__(self, connector: Connector, model: str, max_model_len: int, out: Path) -> None:
        self.connector = connector
        self.ports = spare_ports(2)
        producer_config, consumer_config, producer_env, consumer_env = transfer_configs(connector, self.ports)
        self.producer, self.consumer = start_engines(connector, [("producer", producer_config, producer_env),
                                                          ("consumer", consumer_config, consumer_env)],
                                              model, max_model_len, out)
        named = consumer_engine_id(self.ports) if connector in PREFETCHING else ""
        self.handover = Handover(prefetch_by=named)

    def ready(self) -> None:
        self.producer.wait_ready()
        self.consumer.wait_ready()
        if self.connector is Connector.MOONCAKE:
            self.handover = Handover(mooncake=vllm_mooncake.MooncakeProxy.query("127.0.0.1", self.ports[0]))

    def rep(self, scenario: Scenario, number: int) -> Rep:
        prompts = scenario.prompts(number)
        prefill = self.handover.prefill_params(len(prompts))
        started = time.perf_counter()
        answers = self.producer.run(prompts, 1, prefill).outputs
        prefilled = time.perf_counter()
        decoded = self.consumer.run(prompts, scenario.new_tokens,
                                    self.handover.decode_params(prefill, [a[2] for a in answers]))
        done = time.perf_counter()
        alone = self.consumer.run(prompts, scenario.new_tokens)  # no params: the consumer computes the prompts itself
        got, want = [o[0] for o in decoded.outputs], [o[0] for o in alone.outputs]
        differing, first = token_mismatch(got, want)
        return Rep(prefill_s=prefilled - started, consumer_s=done - prefilled, same_tokens=not differing,
                   pulled_tokens=decoded.prompt_tokens.get("external_kv_transfer", 0),
                   differing_requests=differing, first_difference=first)

    def stop(self) -> None:
        self.consumer.process.stop()
        self.producer.process.stop()


def starting(connector: Connector, out: Path) -> str:
    """The line that says which engines of ``connector`` start, and their logs."""
    if connector is Connector.FLOOR:
        return f"floor: starting one engine, its prefix cache on (log {engine_log(out, connector, 'engine').name})"
    if connector is Connector.NO_TRANSFER:
        return (f"no-transfer: starting one engine with vLLM's DecodeBenchConnector (log "
                f"{engine_log(out, connector, 'engine').name})")
    return (f"{connector.value}: starting a producer and a consumer engine (logs "
            f"{engine_log(out, connector, 'producer').name}, {engine_log(out, connector, 'consumer').name})")


def measure(connectors: list[Connector], model: str, scenarios: list[Scenario], reps: int, max_model_len: int,
            out: Path, progress: Callable[[str], None] = logger.info) -> list[Row]:
    """The engines of every connector in ``connectors`` up at once (``PdPair``; the floor and no-transfer:
    ``ONE_ENGINE``), their output in their logs in ``out`` (``engine_log``); a warm-up rep on each (the
    connections, the first pull) of the shortest single request and of the first concurrent scenario; then
    ``reps`` reps of each scenario, each rep run on every connector in turn, the order turning by one from rep
    to rep, so that the connectors share the machine's spells of load alike. ``progress`` gets a line per phase. EngineFailed
    when an engine fails (every engine is stopped)."""
    benches = []
    try:
        for connector in connectors:
            progress(starting(connector, out))
            benches.append(ONE_ENGINE[connector](model, max_model_len, out) if connector in ONE_ENGINE
                           else PdPair(connector, model, max_model_len, out))
        warm = [min(scenarios, key=lambda s: (s.requests, s.tokens))]
        warm += [s for s in scenarios if s.requests > 1][:1]
        started = time.perf_counter()
        for bench in benches:
            bench.ready()
            progress(f"{bench.connector.value}: engines ready in {time.perf_counter() - started:.0f} s; "
                     "a warm-up request")
            for scenario in warm:
                bench.rep(scenario, -1)
        rows = []
        for scenario in scenarios:
            done: dict[Connector, list[Rep]] = {bench.connector: [] for bench in benches}
            for number in range(reps):
                turn = number % len(benches)
                for bench in benches[turn:] + benches[:turn]:
                    done[bench.connector].append(bench.rep(scenario, number))
            for bench in benches:
                rows.append(row_of(bench.connector, scenario, done[bench.connector]))
                progress(f"{bench.connector.value}, {label(scenario)}: consumer phase "
                         f"{rows[-1].decode_first_token_ms:.1f} ms"
                         + ("" if rows[-1].ttft_ms is None else f", TTFT {rows[-1].ttft_ms:.1f} ms"))
        return rows
    finally:
        for bench in reversed(benches):
            bench.stop()


def _say(line: str) -> None:
    """One line of the bench's progress on the terminal (stderr; the table goes to stdout)."""
    print(line, file=sys.stderr, flush=True)


def request_counts(text: str) -> list[int]:
    """``--concurrent``: integers >= 1 separated by commas, or ``none``."""
    return [] if text.strip().lower() == "none" else counts(text)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kpool-pd bench vllm", __doc__)
    parser.add_argument("--tokens", type=counts, default=[1024, 8192], metavar="N,N",
                        help="prompt lengths in tokens, one request of each at a time (default 1024,8192)")
    parser.add_argument("--concurrent", type=request_counts, default=[8, 64], metavar="N,N",
                        help=f"requests sent at once, of mixed lengths ({MIXED_SHORTEST} to {MIXED_LONGEST:,} "
                             "tokens), a scenario per count; none for no such scenario (default 8,64)")
    parser.add_argument("--new-tokens", type=count, default=12,
                        help="tokens the consumer makes for each request of a concurrent scenario (default 12)")
    parser.add_argument("--reps", type=count, default=3, help="reps of each scenario per connector (default 3)")
    parser.add_argument("--connectors", default=",".join(c.value for c in Connector), metavar="NAME,NAME",
                        help="which connectors, in order (default: all of " +
                             ", ".join(c.value for c in Connector) + "; floor: no connector, one engine's "
                             "prefix cache; no-transfer: one engine whose KV is claimed and not moved, vLLM's "
                             "DecodeBenchConnector)")
    parser.add_argument("--together", action="store_true",
                        help="start every connector's engines at once and run each rep on every connector in turn "
                             "(the order turning from rep to rep), so that they share a loaded machine's spells "
                             "alike; by default one connector after the other, each alone on the machine")
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
    skipped: dict[Connector, str] = {}
    if Connector.MOONCAKE in connectors and (why := vllm_mooncake.unavailable()) is not None:
        skipped[Connector.MOONCAKE] = f"{why}; {vllm_mooncake.ENABLE_HINT}"
        connectors.remove(Connector.MOONCAKE)
    if Connector.NO_TRANSFER in connectors and (why := decode_bench_unavailable()) is not None:
        skipped[Connector.NO_TRANSFER] = why
        connectors.remove(Connector.NO_TRANSFER)
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix=OUT_PREFIX))
    else:
        out = args.out
        out.mkdir(parents=True, exist_ok=True)
    _say(f"kpool-pd bench vllm: writing to {out}")
    _say("vLLM's output goes to a log per engine there: <connector>-producer.log and <connector>-consumer.log")
    for connector, why in skipped.items():
        _say(f"{connector.value}: skipped: {why}")
    scenarios = [Scenario(lengths=(n,), new_tokens=1) for n in args.tokens]
    scenarios += [Scenario(lengths=mixed_lengths(n), new_tokens=args.new_tokens) for n in args.concurrent]
    max_model_len = max(max(s.lengths) for s in scenarios) + 16 + args.new_tokens
    rows: list[Row] = []
    failure: EngineFailed | None = None
    with tempfile.TemporaryDirectory(prefix="kpoolpd-bench-vllm-model-") as folder:
        _say("writing the model (a 2-layer Llama, seeded weights)")
        model = str(vllm_engines.write_model(Path(folder) / "model", max_positions=max_model_len))
        for group in ([connectors] if args.together else [[connector] for connector in connectors]):
            try:
                rows += measure(group, model, scenarios, args.reps, max_model_len, out, progress=_say)
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
    for connector, why in skipped.items():
        print(f"{connector.value}: skipped: {why}")
    _say(f"results: {results}")
    return 0 if failure is None and all(r.same_tokens is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
