"""Data planes: ``--transports`` (what a node offers; on a decode node also what it can receive
with) and ``--transport`` (what a decode node's pulls ask for).

``auto`` offers UCX when ``ucxx`` imports here, and the gRPC stream always; otherwise the option
names them, comma-separated (``ucx``, ``grpc``). A pull transport that is not offered is added
to what the node offers, since the node must receive what it asks for. The option parsers check
the names when settings load; ``transports_of`` checks that UCX can be used here when the daemon
starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kpool_pd.connector import Transport, ucx_available
from kpool_pd.runtime.options import SettingsError

AUTO = "auto"
_NO_UCX = "transport ucx asked for, but ucxx cannot be imported here (pip install 'kpool-pd[ucx]')"


def _names(text: str) -> tuple[Transport, ...]:
    chosen = tuple(dict.fromkeys(Transport.parse(name.strip()) for name in text.split(",") if name.strip()))
    if not chosen:
        raise ValueError(f"transports must be auto or a comma-separated list of ucx and grpc, got {text!r}")
    return chosen


def transport_list(text: Any) -> str:
    """Parser of ``--transports``: ``auto`` or known names; returns the text without surrounding space."""
    value = str(text).strip()
    if value != AUTO:
        _names(value)
    return value


def pull_choice(text: Any) -> str:
    """Parser of ``--transport``: ``auto``, ``ucx`` or ``grpc``; returns the text without surrounding space."""
    value = str(text).strip()
    if value != AUTO:
        Transport.parse(value)
    return value


def parse_transports(text: str, *, ucx: bool | None = None) -> tuple[Transport, ...]:
    """The transports ``text`` names, in order, each once; ``auto``: UCX (when ``ucx``) and the
    gRPC stream. ``ucx`` says whether UCX can be used here (None: whether ``ucxx`` imports).
    ``ValueError`` naming the text when it is empty or holds an unknown name, or when it names
    UCX and UCX cannot be used."""
    ucx = ucx_available() if ucx is None else ucx
    if text.strip() == AUTO:
        return (Transport.UCX, Transport.GRPC_STREAM) if ucx else (Transport.GRPC_STREAM,)
    chosen = _names(text)
    if Transport.UCX in chosen and not ucx:
        raise ValueError(_NO_UCX)
    return chosen


def parse_pull(text: str) -> Transport | None:
    """The transport a pull asks for; None for ``auto`` (UCX when the peer offers it)."""
    return None if text.strip() == AUTO else Transport.parse(text.strip())


@dataclass(frozen=True, kw_only=True)
class Transports:
    """What a node offers (a decode node: can receive with) and what its pulls ask for."""

    offered: tuple[Transport, ...]
    pull: Transport | None = None  # None: UCX when the peer offers it, else the gRPC stream

    def __post_init__(self) -> None:
        if not self.offered:
            raise ValueError("a node must offer at least one transport")
        if self.pull is not None and self.pull not in self.offered:
            raise ValueError(f"pull transport {self.pull.label} is not among those offered "
                             f"({', '.join(t.label for t in self.offered)})")


def transports_of(settings: Mapping[str, Any], *, ucx: bool | None = None) -> Transports:
    """The node's transports from its ``transports`` setting and, when it has one, its
    ``transport`` (pull) setting. ``SettingsError`` naming the option when UCX is asked for and
    cannot be used here."""
    ucx = ucx_available() if ucx is None else ucx
    try:
        offered = parse_transports(settings["transports"], ucx=ucx)
    except ValueError as exc:
        raise SettingsError(f"transports {settings['transports']}: {exc}") from None
    pull = parse_pull(settings.get("transport", AUTO))
    if pull is not None and pull not in offered:
        if pull is Transport.UCX and not ucx:
            raise SettingsError(f"transport {settings['transport']}: {_NO_UCX}")
        offered = (*offered, pull)
    return Transports(offered=offered, pull=pull)
