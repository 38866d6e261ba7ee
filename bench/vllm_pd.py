"""Time to first token of a vLLM PD pair (a kv_producer and a kv_consumer engine, two processes, a 2-layer
Llama of seeded weights on the CPU) with KpoolPdConnector over UCX and over the gRPC stream and with vLLM's
NixlConnector (kv_buffer_device cpu), one connector after the other in one run, at each prompt length.
Prints per connector and length the median prefill time (the producer's one-token prefill), the median
time the consumer takes from the decode request to its first token (the pull of the prompt's KV plus one
token's compute: the compute is the same whatever the connector, so the difference between connectors is
the transfer), their sum (TTFT), its ratio to NixlConnector's, and whether the consumer's first token
equals one engine's.

    python -m bench.vllm_pd --tokens 1024,8192 --reps 5     (kpool-pd bench vllm)

Needs vLLM (pip install -e '.[vllm]', see README) and, for the NixlConnector rows, nixl (pip install nixl).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import random
import secrets
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

from bench import vllm_engines
from bench.arguments import bench_parser, count, counts

logger = logging.getLogger("bench.vllm_pd")


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


def measure(connector: Connector, model: str, lengths: list[int], reps: int, max_model_len: int) -> list[Row]:
    """One producer and one consumer engine of ``connector``; ``reps`` PD requests of each length, one at
    a time, after one warm-up request (the connections, the first pull); each rep a new random prompt."""
    ports = [unused_port(), unused_port()]
    producer_config, consumer_config, producer_env, consumer_env = transfer_configs(connector, ports)
    context = multiprocessing.get_context("spawn")
    producer = vllm_engines.EngineProcess(context, model, producer_config, max_model_len=max_model_len,
                                          env=producer_env)
    consumer = vllm_engines.EngineProcess(context, model, consumer_config, max_model_len=max_model_len,
                                          env=consumer_env)
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
        producer.wait_ready()
        consumer.wait_ready()
        pd_once(min(lengths))  # warm-up: the connections, the first pull
        rows = []
        for tokens in lengths:
            runs = [pd_once(tokens) for _ in range(reps)]
            prefill = statistics.median(r[0] for r in runs)
            first = statistics.median(r[1] for r in runs)
            rows.append(Row(connector=connector.value, tokens=tokens, reps=reps, prefill_ms=prefill * 1e3,
                            decode_first_token_ms=first * 1e3, ttft_ms=(prefill + first) * 1e3,
                            same_tokens=all(r[2] for r in runs), pulled_tokens=sum(r[3] for r in runs)))
            logger.info("%s, %d tokens: TTFT %.1f ms", connector.value, tokens, rows[-1].ttft_ms)
        return rows
    finally:
        consumer.stop()
        producer.stop()


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


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kpool-pd bench vllm", __doc__)
    parser.add_argument("--tokens", type=counts, default=[1024, 8192], metavar="N,N",
                        help="prompt lengths in tokens (default 1024,8192)")
    parser.add_argument("--reps", type=count, default=5, help="PD requests per length and connector (default 5)")
    parser.add_argument("--connectors", default=",".join(c.value for c in Connector), metavar="NAME,NAME",
                        help="which connectors, in order (default: all of " +
                             ", ".join(c.value for c in Connector) + ")")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="folder for vllm_pd.json (default bench/results)")
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
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    max_model_len = max(args.tokens) + 16
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kpoolpd-bench-vllm-") as folder:
        model = str(vllm_engines.write_model(Path(folder) / "model", max_positions=max_model_len))
        for connector in connectors:
            logger.info("%s: starting a producer and a consumer engine", connector.value)
            rows += measure(connector, model, args.tokens, args.reps, max_model_len)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_pd.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(table(rows))
    return 0 if all(r.same_tokens for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
