"""A prefill daemon and a DCP decode instance (``--dcp N``) on loopback, for the tests that attack or
break such an instance: started, checked ready and serving, logs shown on failure, stopped after."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from kpool_pd.model import ModelConfig
from kpool_pd.runtime.launch import Daemon, start_decode, start_prefill
from tests.e2e.test_e2e import DECODE_LIMITS, READY_S, _flags, _logs_on_failure, _ready_and_serving, _stop


@dataclass(frozen=True)
class DcpInstance:
    prefill: Daemon
    decode: Daemon  # rank 0, which started the other ranks
    scratch: Path   # the decode daemon's TMPDIR: its rendezvous folder and its ranks' ready files


@contextlib.contextmanager
def dcp_instance(tmp_path: Path, config: ModelConfig, ranks: int, *, transport: str,
                 prefill_transports: str = "auto", prefill_blocks: int = 64,
                 prefill_extra: Sequence[str] = (), decode_extra: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> Iterator[DcpInstance]:
    """Yield a prefill daemon (``prefill_blocks`` blocks, offering ``prefill_transports``) and a decode instance
    of ``ranks`` DCP ranks pulling from it over ``transport``, once both serve; inside, any failure prints both daemons' logs.
    Both are stopped afterwards, whatever the test did to them."""
    flags = _flags(config)
    prefill = start_prefill(tmp_path, flags, transports=prefill_transports,
                            extra=["--num-blocks", str(prefill_blocks), "--log-format", "text", *prefill_extra])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    decode: Daemon | None = None
    try:
        with _logs_on_failure(prefill):
            prefill.wait_ready(READY_S)
        decode = start_decode(tmp_path, flags, [f"127.0.0.1:{prefill.port}"], name=f"decode-dcp{ranks}",
                              transport=transport, env={"TMPDIR": str(scratch), **(env or {})},
                              extra=[*DECODE_LIMITS, "--dcp", str(ranks), *decode_extra])
        with _logs_on_failure(prefill, decode):
            _ready_and_serving(decode)
            yield DcpInstance(prefill, decode, scratch)
    finally:
        _stop(*([decode] if decode is not None else []), prefill)
