"""`kpool-pd router --prefill URL... --decode URL...`: parses its flags and serves until stopped."""

from __future__ import annotations

import argparse
import logging
import sys

from kpool_pd.router.settings import add_router_arguments, settings_from_args

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kpool-pd router",
        description="An OpenAI-compatible PD router: each POST /v1/completions or /v1/chat/completions request "
                    "is prefilled on a prefill vllm serve instance (max_tokens 1, kv_transfer_params "
                    "do_remote_decode) and generated on a decode instance with the kv_transfer_params the prefill "
                    "returned; a prefill instance is chosen by its outstanding prompt tokens, a decode instance by "
                    "its outstanding requests and tokens, either where the prompt's prefix went before unless it is "
                    "loaded past --affinity-margin-tokens; one that fails (connect failure, timeout, 5xx) or whose "
                    "GET /health probe fails is tried last. Instances may be found through DNS (dns:///NAME:PORT, "
                    "re-resolved every --discovery-s). A request the decode "
                    "cannot take releases the prefill's grant; a decode instance's 5xx after the prefill is named "
                    "to the client as a likely failed or timed-out KV transfer. Refused before any instance sees "
                    "it: a batch of prompts, n, best_of above 1, beam search, bodies that are not JSON objects or "
                    "are over --max-body-mb. GET /v1/models, GET /version, POST /tokenize and POST /detokenize are "
                    "passed through to a decode instance, its answer as it is. Also GET /health (each instance's "
                    "state and last failure) and GET /metrics. Any other path is answered 404, a wrong method 405, "
                    "in OpenAI's error shape listing what is served.")
    add_router_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        from kpool_pd.router.app import run_router
    except ImportError as error:
        print(f"error: the router needs aiohttp ({error}); pip install 'kpool-pd[router]'", file=sys.stderr)
        return 2
    return run_router(settings)


if __name__ == "__main__":
    sys.exit(main())
