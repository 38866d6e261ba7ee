"""Where the consumer's phase of KpoolPdConnector goes in vLLM mode: a producer and a consumer engine (the
bench's 2-layer Llama, as ``kpool-pd bench vllm`` runs them) whose connector is ``kpool_pd.bench.vllm_trace``
(KpoolPdConnector with time stamps, unchanged otherwise), and per decode request the time from the
consumer's generate to each mark: queued by vLLM, its load in a step's metadata, the pull begun on the
connector's thread, the handshaken peer found, the Pull sent, the bytes landed (the producer's hops in
between), the Release answered, ``get_finished`` reporting it, the generate's end; the engine steps run
meanwhile (with no token scheduled: idle), the RPCs and stream messages of each pull.

    python -m kpool_pd.bench.vllm_profile --transports ucx,grpc --reps 3 --out DIR

Writes the engines' logs and traces (<transport>-<role>.log, .jsonl) and profile.txt into DIR and prints the
breakdown.
"""

from __future__ import annotations

import json
import logging
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from kpool_pd.bench import vllm_engines
from kpool_pd.bench.arguments import bench_parser, count
from kpool_pd.bench.vllm_bench_engines import NamedEngine
from kpool_pd.bench.vllm_rows import Scenario, mixed_lengths
from kpool_pd.runtime.ports import spare_ports

TRACE_ENV = "KPOOLPD_TRACE"  # where the engines' traced connector (kpool_pd.bench.vllm_trace) writes its stamps
logger = logging.getLogger("kpool_pd.bench.vllm_profile")


@dataclass(frozen=True)
class Window:
    """One consumer generate: its scenario's label, when it was sent and when it returned."""

    label: str
    begin: float
    end: float


def traced_config(role: str, extra: dict) -> dict:
    return vllm_engines.kpool_transfer_config(role, extra) | {"kv_connector_module_path": "kpool_pd.bench.vllm_trace"}


def run(transport: str, model: str, scenarios: list[Scenario], reps: int, max_model_len: int,
        out: Path) -> list[Window]:
    """The pair over ``transport`` (ucx or grpc): a warm-up, then ``reps`` reps of each scenario; the
    consumer's generates as windows (the traces are in ``out``)."""
    import multiprocessing

    [port] = spare_ports(1)
    token = secrets.token_hex(16)
    context = multiprocessing.get_context("spawn")
    engines = []
    for role, config in (("producer", traced_config("kv_producer", {"listen": f"127.0.0.1:{port}",
                                                                    "transport": transport})),
                         ("consumer", traced_config("kv_consumer", {"transport": transport,
                                                                    "producers": [f"127.0.0.1:{port}"]}))):
        log, trace = out / f"{transport}-{role}.log", out / f"{transport}-{role}.jsonl"
        log.write_text("")
        trace.write_text("")
        env = {"KPOOLPD_PEER_TOKEN": token, TRACE_ENV: str(trace)}
        engines.append(NamedEngine(f"{transport} {role}", log, vllm_engines.EngineProcess(
            context, model, config, max_model_len=max_model_len, env=env, log=log)))
    producer, consumer = engines
    def rep(scenario: Scenario, number: int) -> Window:
        prompts = scenario.prompts(number)
        answers = producer.run(prompts, 1, [{"do_remote_decode": True}] * len(prompts)).outputs
        begin = time.perf_counter()
        consumer.run(prompts, scenario.new_tokens, [a[2] for a in answers])
        return Window(label=f"{scenario.requests} request(s) at once, {scenario.tokens} prompt tokens, "
                            f"{scenario.new_tokens} new token(s) each", begin=begin, end=time.perf_counter())

    try:
        producer.wait_ready()
        consumer.wait_ready()
        for scenario in scenarios:  # warm-ups: the connections, the first pulls
            rep(scenario, -1)
        return [rep(scenario, number) for scenario in scenarios for number in range(reps)]
    finally:
        consumer.process.stop()
        producer.process.stop()


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}" if values else "       -"


MARKS = ("queued", "in step metadata", "pull begun", "peer found", "Pull sent (hop written)", "producer read",
         "producer sent", "landed", "Pull returned", "Release answered", "pull ended", "get_finished reported",
         "scheduled after the load", "generate returned")


def breakdown(transport: str, windows: list[Window], consumer: list[dict], producer: list[dict]) -> str:
    """Per window label: the median over requests of each mark's time since the generate was sent, and the
    counts (steps, idle steps, RPCs and messages per pull)."""
    producer_hops = defaultdict(dict)
    for e in producer:
        if e["event"] == "hop":
            producer_hops[e["grant"]].setdefault(e["hop"], e["at"])
    lines = [f"== KpoolPdConnector, transport {transport}: ms since the consumer's generate was sent "
             "(median over requests and reps) =="]
    by_label = defaultdict(list)
    for w in windows:
        by_label[w.label].append(w)
    for label, group in by_label.items():
        marks = defaultdict(list)
        steps, idle, waited, rpcs, messages, pulls, regions, nbytes, gf_calls = [], [], [], Counter(), Counter(), 0, [], [], []
        ended_to_reported, sent_to_landed, release_rtt, steps_waited = [], [], [], []
        for w in group:
            inside = [e for e in consumer if w.begin <= e.get("end", e.get("t")) <= w.end + 0.001]
            at = defaultdict(dict)  # request -> mark -> time
            hop = defaultdict(dict)
            of_grant = {g: e["request"] for e in inside if e["event"] == "pull" for g in e.get("grants", ())}
            for e in inside:  # a step's batch names its pulls by grant (kpool_pd.vllm.step_pulls)
                if not e.get("request") and e.get("grant") in of_grant and e["event"] in ("land", "hop"):
                    e["request"] = of_grant[e["grant"]]
            for e in inside:
                kind, rid = e["event"], e.get("request", "")
                if kind == "queued":
                    at[rid].setdefault("queued", e["end"])
                elif kind == "meta":
                    for r in e.get("loads", []):
                        at[r].setdefault("in step metadata", e["end"])
                elif kind == "pull":
                    at[rid]["pull begun"], at[rid]["pull ended"] = e["begin"], e["end"]
                elif kind == "peer" and rid:
                    at[rid].setdefault("peer found", e["end"])
                elif kind == "land" and rid:
                    at[rid]["Pull returned"] = e["end"]
                    regions.append(e.get("regions") or 0)
                    nbytes.append(e.get("bytes") or 0)
                elif kind == "release" and rid:
                    at[rid]["Release answered"] = e["end"]
                    release_rtt.append(e["end"] - e["begin"])
                elif kind == "get_finished":
                    for r in e.get("recving", []):
                        at[r].setdefault("get_finished reported", e["end"])
                elif kind == "rpc":
                    rpcs[e["rpc"]] += 1
                elif kind == "message":
                    messages[e.get("kind")] += 1
                elif kind == "hop" and rid:
                    hop[rid].setdefault(e["hop"], e["at"])
                    hop[rid]["grant"] = e["grant"]
            by_grant = {h["grant"]: rid for rid, h in hop.items()}
            for e in inside:  # hops stamped outside the pull's task (the session's writer) name only the grant
                if e["event"] == "hop" and not e.get("request") and e["grant"] in by_grant:
                    hop[by_grant[e["grant"]]].setdefault(e["hop"], e["at"])
            schedule = [e for e in inside if e["event"] == "schedule"]
            for rid, m in at.items():
                reported = m.get("get_finished reported")
                if reported is not None:
                    after = [e for e in schedule if e["begin"] >= reported and rid in e.get("scheduled", [])]
                    if after:
                        m["scheduled after the load"] = after[0]["end"]
                        between = [e for e in schedule if m.get("pull begun", reported) <= e["begin"] <= reported]
                        steps_waited.append(len(between))
            for rid, h in hop.items():
                if "written" in h:
                    at[rid]["Pull sent (hop written)"] = h["written"]
                if "landed" in h:
                    at[rid]["landed"] = h["landed"]
                p = producer_hops.get(h.get("grant"), {})
                if "read" in p:
                    at[rid]["producer read"] = p["read"]
                if "sent" in p:
                    at[rid]["producer sent"] = p["sent"]
                if "written" in h and "landed" in h:
                    sent_to_landed.append(h["landed"] - h["written"])
            for rid, m in at.items():
                if "pull begun" not in m:
                    continue
                pulls += 1
                m["generate returned"] = w.end
                for mark, t in m.items():
                    marks[mark].append(t - w.begin)
                if "get_finished reported" in m:
                    ended_to_reported.append(m["get_finished reported"] - m["pull ended"])
            steps.append(len(schedule))
            idle.append(sum(1 for e in schedule if e.get("tokens") == 0))
            finished = [e for e in inside if e["event"] == "get_finished"]
            gf_calls.append(len(finished))
            waited.append(sum(e["end"] - e["begin"] for e in finished))
        lines.append(f"-- {label}: {len(group)} reps, {pulls} pulls, {statistics.median(regions) if regions else 0:.0f} "
                     f"regions and {statistics.median(nbytes) / 1024 if nbytes else 0:.0f} KiB a pull (median)")
        for mark in MARKS:
            lines.append(f"  {mark:<26} {_median_ms(marks.get(mark, []))}")
        lines.append(f"  engine steps in the generate: {statistics.median(steps):.0f} (median of reps), of which "
                     f"idle (no token scheduled): {statistics.median(idle):.0f}; get_finished calls "
                     f"{statistics.median(gf_calls):.0f}, time inside them {statistics.median(waited) * 1e3:.1f} ms")
        lines.append(f"  steps from the pull's start to get_finished reporting it: median "
                     f"{statistics.median(steps_waited) if steps_waited else float('nan'):.0f}")
        lines.append(f"  pull ended -> get_finished reported it: median {_median_ms(ended_to_reported).strip()} ms; "
                     f"Pull sent -> landed: {_median_ms(sent_to_landed).strip()} ms; Release round trip: "
                     f"{_median_ms(release_rtt).strip()} ms")
        per_pull = max(pulls, 1)
        lines.append("  per pull: " + ", ".join(f"{name} {n / per_pull:.2f}" for name, n in sorted(rpcs.items()))
                     + "; stream messages read: " + ", ".join(f"{k} {n / per_pull:.2f}" for k, n in
                                                               sorted(messages.items())))
    return "\n".join(lines)


WAIT_REPORTED_S = 0.05  # a PackedPull that waited longer than this before the producer read it is listed


def batch_waits(consumer: list[dict], producer: list[dict]) -> str:
    """How long each PackedPull batch waited between the consumer writing it (hop ``written``, stamped for all
    its pulls at once) and the producer's handler reading it (hop ``read``, its first pull): the count, the
    median, those over ``WAIT_REPORTED_S``, and for each of these the stall probes' events in either process
    that overlap its wait (``kpool_pd.bench.stall_probe``, traced with $KPOOLPD_TRACE_STALLS)."""
    read = {e["grant"]: e["at"] for e in producer if e["event"] == "hop" and e["hop"] == "read"}
    batches = defaultdict(list)  # a batch's first written stamp -> its pulls' read stamps
    first = last = float("-inf")
    for at, grant in sorted((e["at"], e["grant"]) for e in consumer
                            if e["event"] == "hop" and e["hop"] == "written" and e["grant"] in read):
        if at - last > 0.001:  # a batch's stamps come within microseconds of each other
            first = at
        batches[first].append(read[grant])
        last = at
    waits = sorted((min(reads) - written, written) for written, reads in batches.items())
    if not waits:
        return "PackedPull batches: none traced"
    long = [(wait, written) for wait, written in waits if wait > WAIT_REPORTED_S]
    lines = [f"PackedPull batches, written -> producer read: {len(waits)} batches, median "
             f"{statistics.median(w for w, _ in waits) * 1e3:.1f} ms, {len(long)} over {WAIT_REPORTED_S * 1e3:.0f} ms"
             + (": " + ", ".join(f"{w * 1e3:.0f}" for w, _ in sorted(long, key=lambda x: x[1])) + " ms" if long else "")]
    for wait, written in sorted(long, key=lambda x: x[1]):
        for side, events in (("consumer", consumer), ("producer", producer)):
            for e in events:
                if e["event"] == "stall" and e["begin"] < written + wait and e["end"] > written:
                    lines.append(f"  wait at {written:.3f} ({wait * 1e3:.0f} ms): {side} {e['kind']} stall "
                                 f"{(e['begin'] - written) * 1e3:+.0f} .. {(e['end'] - written) * 1e3:+.0f} ms"
                                 + (f" {json.dumps(e['stacks'])}" if "stacks" in e else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m kpool_pd.bench.vllm_profile", __doc__)
    parser.add_argument("--transports", default="ucx,grpc", help="ucx, grpc or both (default ucx,grpc)")
    parser.add_argument("--reps", type=count, default=3)
    parser.add_argument("--concurrent", type=count, default=8, help="requests at once, mixed lengths (default 8)")
    parser.add_argument("--new-tokens", type=count, default=12)
    parser.add_argument("--tokens", type=count, default=1024, help="the single request's length (default 1024)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kpoolpd-vllm-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"writing to {out}", file=sys.stderr, flush=True)
    scenarios = [Scenario(lengths=(args.tokens,), new_tokens=1),
                 Scenario(lengths=mixed_lengths(args.concurrent), new_tokens=args.new_tokens)]
    max_model_len = max(max(s.lengths) for s in scenarios) + 16 + args.new_tokens
    reports = []
    with tempfile.TemporaryDirectory(prefix="kpoolpd-vllm-profile-model-") as folder:
        model = str(vllm_engines.write_model(Path(folder) / "model", max_positions=max_model_len))
        for transport in args.transports.split(","):
            windows = run(transport, model, scenarios, args.reps, max_model_len, out)
            consumer, producer = (read_trace(out / f"{transport}-{role}.jsonl") for role in ("consumer", "producer"))
            reports.append(breakdown(transport, windows, consumer, producer) + "\n" + batch_waits(consumer, producer))
    text = "\n\n".join(reports)
    (out / "profile.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
