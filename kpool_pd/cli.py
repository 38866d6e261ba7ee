"""`kpool-pd`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _selfcheck(args: argparse.Namespace) -> int:
    from kpool_pd.selfcheck import DEFAULT_CASES, format_table, run_case

    rows = []
    started = time.perf_counter()
    for index, case in enumerate(DEFAULT_CASES, 1):
        print(f"[{index}/{len(DEFAULT_CASES)}] kpool {case.kpool}, {case.num_spec} drafts, "
              f"{case.prompt_len} -> {case.total_len} tokens ...", file=sys.stderr, flush=True)
        rows.append(run_case(case, seed=args.seed + index))
    print(format_table(rows))
    broken = sum(not row.holds for row in rows)
    print(f"\n{len(rows) - broken} of {len(rows)} configurations hold the invariant "
          f"({time.perf_counter() - started:.1f} s)")
    return 1 if broken else 0


def _up(args: argparse.Namespace) -> int:
    from kpool_pd.up import run_up

    return run_up(args)


def _generate(args: argparse.Namespace) -> int:
    from kpool_pd.up import run_generate

    return run_generate(args)


def _add_request_flags(parser: argparse.ArgumentParser, *, requests: int, prompt_len: int, max_tokens: int,
                       seed_help: str) -> None:
    parser.add_argument("--requests", type=int, default=requests, help=f"requests to send (default {requests})")
    parser.add_argument("--prompt-len", type=int, default=prompt_len,
                        help=f"prompt tokens of each request (default {prompt_len})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"output tokens of each request (default {max_tokens})")
    parser.add_argument("--seed", type=int, default=0, help=f"{seed_help} (default 0)")
    parser.add_argument("--json", action="store_true", help='one JSON object per request, then {"summary": ...}')


def _add_up(commands) -> None:
    from kpool_pd.up import UP_MODEL_DEFAULTS, default_transport
    from kpool_pd.prefill_worker.daemon import DEFAULT_MAX_BATCH_TOKENS
    from kpool_pd.runtime import add_model_arguments

    up = commands.add_parser(
        "up", help="start a prefill and a decode daemon on loopback, run requests through them, report, stop",
        description="Start one prefill and one decode daemon as subprocesses on loopback, send the requests, "
                    "print per request its tokens, bytes moved, transfer time and time to first token, then a "
                    "summary that includes the check against the colocated run, and stop the daemons.")
    _add_request_flags(up, requests=8, prompt_len=200, max_tokens=32,
                       seed_help="seed of the prompts and of the synthetic model's weights (the daemons' --seed)")
    add_model_arguments(up, defaults=UP_MODEL_DEFAULTS, skip=("seed",))
    transport = default_transport()
    up.add_argument("--transport", choices=["ucx", "grpc"], default=transport,
                    help=f"data plane (default here: {transport}; ucx when ucxx is installed, else grpc)")
    up.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the daemons and the colocated reference run (default cpu); cuda: the prefill "
                         "daemon on cuda:0, the decode daemon on cuda:1 when there are two GPUs (else cuda:0)")
    up.add_argument("--max-running", type=int, default=16, metavar="N",
                    help="requests the decode daemon decodes at once (default 16; at most --requests are ever running)")
    up.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, metavar="N",
                    help=f"the prefill daemon's token budget per step (default {DEFAULT_MAX_BATCH_TOKENS}): longer prompts "
                         "are prefilled in chunks, their finished blocks moving to the decode daemon while later "
                         "chunks compute; shorter ones share a step")
    for role in ("prefill", "decode"):
        up.add_argument(f"--{role}-block-size", type=int, default=0, metavar="N",
                        help=f"the {role} daemon's tokens per block (default 0: --block-size); prefill and decode "
                             "may differ, the decode daemon converting what it pulls; the colocated reference uses "
                             "the decode block size")
    up.add_argument("--colocated", action="store_true", help="run the requests in this process with no transfer "
                    "(with the decode block size)")
    up.add_argument("--dcp", type=int, default=1,
                    help="decode-context-parallel ranks of the decode daemon (default 1): N rank processes, the "
                         "kpool cache sharded over them, each with the whole ring; with --device cuda one GPU each")
    up.add_argument("--dcp-interleave", type=int, default=0,
                    help="tokens dealt to one DCP rank at a time, a multiple of kpool (default 0: the block size)")
    up.add_argument("--tls", action="store_true",
                    help="make a throwaway CA and certificates (openssl) and run every connection over mTLS")
    up.set_defaults(handler=_up)


def build_parser() -> argparse.ArgumentParser:
    from kpool_pd.decode_worker.client import DEFAULT_REQUEST_TIMEOUT_S

    parser = argparse.ArgumentParser(prog="kpool-pd", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True)
    selfcheck = commands.add_parser(
        "selfcheck", help="show the cache invariant: colocated prefill == prefix prefill + drafted decode"
    )
    selfcheck.add_argument("--seed", type=int, default=0, help="seed of keys and draft histories (default 0)")
    selfcheck.set_defaults(handler=_selfcheck)
    _add_up(commands)
    generate = commands.add_parser("generate", help="send requests to a running decode daemon's Generate API")
    generate.add_argument("--decode", required=True, metavar="HOST:PORT", help="the decode daemon's gRPC address")
    generate.add_argument("--token", default="", help="the client token (the decode daemon's --token), when it asks "
                          "for one")
    generate.add_argument("--tls-ca", default="", metavar="PEM", help="connect over TLS, checking the daemon against "
                                                                     "this CA bundle")
    generate.add_argument("--tls-cert", default="", metavar="PEM", help="client certificate (mTLS; with --tls-key)")
    generate.add_argument("--tls-key", default="", metavar="PEM", help="private key of --tls-cert")
    generate.add_argument("--tls-server-name", default="", metavar="NAME",
                          help="name expected in the daemon's certificate (default: the host of --decode)")
    _add_request_flags(generate, requests=4, prompt_len=200, max_tokens=32,
                       seed_help="seed of the prompts' random tokens (the model's weights are the decode daemon's: its "
                                 "--seed)")
    generate.add_argument("--timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                          help=f"each request's deadline in seconds from its sending, waiting for room on the decode "
                               f"daemon included; a request past it fails DEADLINE_EXCEEDED (default "
                               f"{DEFAULT_REQUEST_TIMEOUT_S:.0f})")
    generate.set_defaults(handler=_generate)
    for name, text in (("prefill", "run the prefill daemon"), ("decode", "run the decode daemon (the Generate API)")):
        commands.add_parser(name, help=f"{text}; its own flags: kpool-pd {name} --help")
    commands.add_parser("vllm-model", help="write a small model folder vllm serve runs on a CPU (a 2-layer Llama "
                        "with a byte-level tokenizer); its own flags: kpool-pd vllm-model --help")
    commands.add_parser("router", help="an OpenAI-compatible PD router in front of prefill and decode vllm serve "
                        "instances; its own flags: kpool-pd router --help")
    bench = commands.add_parser("bench", help="benchmarks that print a table and write JSON + PNG")
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, text in (("kernels", "kernel timings"), ("transfer", "connector transfers beside copy, socket and NIXL"),
                       ("pipeline", "time to first token with whole and chunked prefill; exposed transfer"),
                       ("dcp", "decode step time, cache and transfer bytes per rank at DCP 1, 2, ..."),
                       ("control", "a control message on gRPC: a new call beside a message on an open stream"),
                       ("vllm", "a vLLM PD pair's phases with KpoolPdConnector beside NixlConnector, "
                                "MooncakeConnector and the prefix-cache floor"),
                       ("decode", "the engine's decode step, eager and from CUDA graphs: host and GPU time, launches"),
                       ("fleet", "N prefill and M decode daemons on one host: least-loaded beside round-robin prefill "
                                 "choice, skewed beside balanced prompts, a restart of every prefill daemon")):
        benches.add_parser(name, help=f"{text}; its own flags: kpool-pd bench {name} --help")
    return parser


DAEMONS = {"prefill": "kpool_pd.prefill_worker.daemon", "decode": "kpool_pd.decode_worker.daemon"}
SERVERS = {**DAEMONS, "router": "kpool_pd.router.main", "vllm-model": "kpool_pd.vllm_model"}  # each parses its own flags
BENCHES = {"kernels": "kpool_pd.bench.kernels", "transfer": "kpool_pd.bench.transfer", "pipeline": "kpool_pd.bench.pipeline", "dcp": "kpool_pd.bench.dcp",
           "control": "kpool_pd.bench.control_latency", "vllm": "kpool_pd.bench.vllm_pd",
           "decode": "kpool_pd.bench.decode_step", "fleet": "kpool_pd.bench.fleet"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SERVERS:  # the daemons and the router parse their own flags (kpool-pd prefill --help)
        import importlib

        return importlib.import_module(SERVERS[argv[0]]).main(argv[1:])
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:  # the benchmarks parse their own flags
        import importlib

        return importlib.import_module(BENCHES[argv[1]]).main(argv[2:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)
