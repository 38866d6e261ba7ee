"""The multiprocessing context the vLLM tests start their engine processes from: a fork server that imported vLLM
and the connector once (``PRELOAD``), so that each engine forks from it where a spawned process imported vLLM
afresh (about 11 CPU-seconds an engine on the 2-core machine, before the engine itself starts). vLLM's own worker
processes (a TP engine's) are started by vLLM as it chooses. A child forked from the server inherits the server's
environment as it was when the server started: what an engine needs set goes in its ``env``."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

PRELOAD = ("vllm", "kpool_pd.vllm", "kpool_pd.bench.vllm_engines")


def engine_context() -> BaseContext:
    """The fork server's context (the server starts with the first process started from it, once a test process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context
