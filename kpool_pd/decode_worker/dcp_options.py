"""The decode daemon's decode-context-parallel (DCP) options, their checks, and the devices of its ranks.

``--dcp N`` makes the daemon rank 0 of N rank processes, which it starts itself (one GPU each on a
GPU host: ranks on ``cuda:K`` .. ``cuda:K+N-1`` from the daemon's ``--device cuda:K``); the ranks
hold the kpool cache sharded by ``--dcp-interleave`` tokens and each keeps the whole tail ring.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import torch

from kpool_pd.connector import MAX_DCP_RANKS
from kpool_pd.kvcache import DcpConfig
from kpool_pd.runtime import Option, SettingsError, int_in, integer, model_config, seconds

# The signal a rank gets when rank 0 dies, however it dies (its parent-death signal): not SIGTERM, which rank 0
# sends on a normal stop, so that a rank knows nobody else will remove the rendezvous folder.
RANK0_DIED = signal.SIGUSR1


def _interleave(text: Any) -> int:
    value = integer(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0 (0: the block size), got {text!r}")
    return value


DCP_OPTIONS: tuple[Option, ...] = (
    Option("dcp", int_in(1, MAX_DCP_RANKS), 1,
           f"decode-context-parallel ranks: this daemon is rank 0 of that many processes (at most {MAX_DCP_RANKS}, "
           "what a prefill node accepts; one GPU each on a GPU host), the cache sharded over them (kpool family only)"),
    Option("dcp-interleave", _interleave, 0, "tokens dealt to one DCP rank at a time, a multiple of kpool (0: the "
                                             "block size, so whole blocks move to one rank)"),
    Option("dcp-timeout-s", seconds, 120.0, "how long DCP ranks wait for each other: to start and join, and "
                                            "in each collective"),
)


def dcp_config(settings: Mapping[str, Any]) -> DcpConfig:
    """The instance's DCP shape from the settings; ValueError naming DCP when it cannot be used
    (the QSA family, an interleave off the pool)."""
    cache = model_config(settings).cache
    return DcpConfig.for_cache(cache, size=settings["dcp"], interleave=settings["dcp_interleave"] or None)


def rank_device(settings: Mapping[str, Any], rank: int) -> str:
    """The device of DCP rank ``rank``: the daemon's ``cpu``, or the ``rank``-th GPU from its own."""
    device = torch.device(settings["device"])
    if device.type != "cuda":
        return device.type
    first = device.index if device.index is not None else 0
    return f"cuda:{first + rank}"


def check_dcp(settings: Mapping[str, Any]) -> None:
    """The daemon's start-up check of its DCP options (SettingsError saying what cannot work)."""
    if settings["dcp"] == 1:
        return
    try:
        dcp_config(settings)
    except ValueError as exc:
        raise SettingsError(f"dcp {settings['dcp']}: {exc}") from None
    device = torch.device(settings["device"])
    if device.type == "cuda" and torch.cuda.is_available():
        first = device.index if device.index is not None else 0
        count = torch.cuda.device_count()
        if first + settings["dcp"] > count:
            raise SettingsError(f"dcp {settings['dcp']} needs one GPU per rank from cuda:{first}; this host has "
                                f"{count} (cuda:0 to cuda:{count - 1})")
