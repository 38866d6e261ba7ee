"""The bench's side of vLLM's MooncakeConnector (``kpool-pd bench vllm``'s mooncake rows): whether the
Mooncake Transfer Engine imports here, the engines' kv_transfer_config and environment, and the PD proxy's
part of its request protocol, which differs from NixlConnector's (vLLM's example
``mooncake_connector_proxy.py`` does the same):

- every prefill request carries a ``transfer_id``, and the producer returns no ``kv_transfer_params``;
- the proxy asks the producer's bootstrap server (``GET /query`` on ``VLLM_MOONCAKE_BOOTSTRAP_PORT``) for
  its ``engine_id``;
- the decode request carries ``remote_engine_id``, ``remote_bootstrap_addr`` and the same ``transfer_id``;
  the consumer sends its block addresses to the producer, which writes the blocks into them.

What a CPU machine needs (not installed by the project's extras, as it needs apt):
``pip install mooncake-transfer-engine-non-cuda`` (the CUDA wheel links libcuda) and
``apt-get install -y libibverbs1`` (the wheel's ``engine.so`` links it without bundling it). The engines
run with ``VLLM_HOST_IP=127.0.0.1`` (a loopback pair) and ``mooncake_protocol`` ``tcp``; the connector class
is ``kpool_pd.bench.mooncake_connector.MooncakeConnector`` (vLLM's, buildable without an accelerator).
"""

from __future__ import annotations

import importlib
import json
import time
import urllib.request
import uuid
from dataclasses import dataclass

ENABLE_HINT = "pip install mooncake-transfer-engine-non-cuda and apt-get install -y libibverbs1 to run them"
CONNECTOR_MODULE = "kpool_pd.bench.mooncake_connector"
QUERY_S = 30.0  # how long the proxy waits for the producer's worker to appear in its bootstrap server


def unavailable() -> str | None:
    """Why the Mooncake Transfer Engine cannot be imported here (one line with the exception), or None
    when it can."""
    try:
        importlib.import_module("mooncake.engine")
    except Exception as exc:  # ImportError, or a wheel's missing shared library (OSError)
        return f"the Mooncake Transfer Engine cannot be imported ({type(exc).__name__}: {exc})"
    return None


def transfer_config(role: str) -> dict:
    """vLLM's kv_transfer_config of MooncakeConnector in ``role`` (kv_producer or kv_consumer), over TCP."""
    return {"kv_connector": "MooncakeConnector", "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def engine_env(bootstrap_port: int) -> dict[str, str]:
    """An engine's environment: the loopback address and the port its bootstrap server listens on (the
    producer's; a consumer starts none)."""
    return {"VLLM_HOST_IP": "127.0.0.1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port)}


@dataclass(frozen=True)
class MooncakeProxy:
    """The proxy's part for one producer: its bootstrap server's address and its engine id."""

    bootstrap_addr: str  # "http://host:port"
    engine_id: str

    @classmethod
    def query(cls, host: str, port: int, timeout_s: float = QUERY_S) -> "MooncakeProxy":
        """Asks the producer's bootstrap server (``GET /query``) for its engine id, until its worker has
        registered or ``timeout_s`` passed (RuntimeError then, naming the address and its last answer)."""
        addr = f"http://{host}:{port}"
        deadline, answer = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{addr}/query", timeout=5) as reply:
                    answer = json.loads(reply.read())
            except OSError as exc:
                answer = f"{type(exc).__name__}: {exc}"
            if isinstance(answer, dict) and answer:
                return cls(bootstrap_addr=addr, engine_id=next(iter(answer.values()))["engine_id"])
            time.sleep(0.2)
        raise RuntimeError(f"the Mooncake bootstrap server at {addr} named no engine within {timeout_s:g} s "
                           f"(its last answer: {answer!r})")

    @staticmethod
    def new_transfer_id() -> str:
        return f"xfer-{uuid.uuid4().hex}"

    @staticmethod
    def prefill_params(transfer_id: str) -> dict:
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}

    def decode_params(self, transfer_id: str) -> dict:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_bootstrap_addr": self.bootstrap_addr, "transfer_id": transfer_id}
