"""The decode engines a prefill node knows: one record per engine, made by its Handshake.

A record holds everything the node keeps about one engine: the transports it offered, when it was last
heard from (Handshake, Prefill, Pull, Heartbeat) and, when it offered UCX, the link to its worker address
(``kpool_pd.connector.prefill.ucx_link``: the address and the endpoints made to it). A Handshake that passes every
check replaces the engine's record whole (``DecodeEngineTable.admit``); a refused one leaves it as it was.
An engine not heard from for ``FORGET_AFTER_LEASES`` leases, or ``FORGET_AFTER_FAILED_SEND_LEASES`` after
a UCX send to it failed, is forgotten with its link (``forget_silent``, which the lease reaper calls);
Heartbeat then tells it (``engine_unknown``) and it handshakes again.

An engine id belongs to the engine whose Handshake first claimed it: the record keeps the random ``secret``
that Handshake returned, and every later call naming the engine must present it (``authenticate``); a
re-handshake that presents it keeps it. A call naming a known engine without its secret is refused
PERMISSION_DENIED and changes nothing, so that nobody who holds the peer token can take over another
engine's id (its record, its UCX link, the bytes of its pulls). A forgotten engine's id is free again.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time

import grpc

from kpool_pd.connector.prefill.ucx_link import UcxLink
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.wire import Transport

logger = logging.getLogger(__name__)

FORGET_AFTER_LEASES = 10  # a decode engine silent this many leases is forgotten (a live one heartbeats every lease)
FORGET_AFTER_FAILED_SEND_LEASES = 3  # the same, once a UCX send to it failed
SECRET_BYTES = 32  # an engine's secret (HandshakeResponse.engine_secret)
MAX_ID_CHARS = 256  # engine and request ids


def new_secret() -> bytes:
    """A fresh engine secret (random)."""
    return secrets.token_bytes(SECRET_BYTES)


class DecodeEngine:
    """One handshaken decode engine: ``transports`` it offered, its UCX ``link`` (None without UCX), the
    ``secret`` its calls present and ``heard_at`` (``time.monotonic()`` of its last call, the one field that
    changes)."""

    __slots__ = ("engine_id", "transports", "link", "secret", "heard_at")

    def __init__(self, engine_id: str, transports: frozenset[Transport], link: UcxLink | None, secret: bytes,
                 heard_at: float | None = None) -> None:
        if Transport.UCX in transports and link is None:
            raise ValueError(f"engine {engine_id!r} offered UCX: its record needs the UCX link to it")
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError(f"engine {engine_id!r} needs a secret of at least 16 bytes")
        self.engine_id, self.transports, self.link, self.secret = engine_id, frozenset(transports), link, secret
        self.heard_at = time.monotonic() if heard_at is None else heard_at

    @property
    def ucx_address(self) -> bytes | None:
        return self.link.address if self.link is not None else None

    def reaches_over(self, transport: Transport) -> bool:
        """Whether a pull may go to this engine over ``transport`` (it offered it; UCX: its link is open)."""
        if transport not in self.transports:
            return False
        return transport is not Transport.UCX or (self.link is not None and not self.link.closed)

    def __repr__(self) -> str:
        return (f"DecodeEngine({self.engine_id!r}, {sorted(t.label for t in self.transports)}, "
                f"link={self.link!r})")


class DecodeEngineTable:
    """The records by engine id. ``lease_s`` is the node's lease, the unit of ``forget_silent``'s horizons.
    Not thread-safe: the node's event loop only."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._engines: dict[str, DecodeEngine] = {}

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, engine_id: str) -> DecodeEngine | None:
        return self._engines.get(engine_id)

    def ids(self) -> tuple[str, ...]:
        return tuple(self._engines)

    def authenticate(self, engine_id: str, secret: bytes, what: str) -> DecodeEngine:
        """The record of ``engine_id`` if ``secret`` is its secret. StatusError FAILED_PRECONDITION for an
        engine not handshaken (or forgotten), PERMISSION_DENIED for a wrong or missing secret (``what``, the
        call, is named; the record is untouched)."""
        record = self._engines.get(engine_id)
        if record is None:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"engine {engine_id[:MAX_ID_CHARS]!r} has not handshaken")
        if not self.owns(record, secret):
            logger.warning("%s naming engine %r refused: it did not present the engine's secret", what,
                           engine_id[:MAX_ID_CHARS])
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"{what}: engine id {engine_id[:MAX_ID_CHARS]!r} is held by another engine "
                              f"(the engine secret from its Handshake is missing or wrong)")
        return record

    @staticmethod
    def owns(record: DecodeEngine, secret: bytes) -> bool:
        """Whether ``secret`` is the record's (compared in constant time)."""
        return hmac.compare_digest(record.secret, bytes(secret))

    def secret_for(self, engine_id: str, presented: bytes, what: str = "Handshake") -> bytes:
        """The secret a Handshake of ``engine_id`` that presents ``presented`` will hold: the engine's own for
        a known engine (PERMISSION_DENIED unless presented); for an id not held, the claimant's own when it
        presents one of SECRET_BYTES (a decode engine draws its secret before its first Handshake, so a
        Handshake retried after its reply was lost, or after this node forgot the engine, presents the same
        secret and is admitted as the same engine, where another claimant of the id, lacking it, is refused),
        else a fresh one."""
        if engine_id in self._engines:
            return self.authenticate(engine_id, presented, what).secret
        return bytes(presented) if len(presented) == SECRET_BYTES else new_secret()

    def admit(self, record: DecodeEngine) -> None:
        """Make ``record`` the engine's, replacing its earlier record whole. The earlier record's link is
        closed (its endpoints aborted) unless the new record keeps it (the same address: a re-handshake).
        PERMISSION_DENIED (nothing changed) when the id is held under another secret (a claim that won a
        race with this one while it reached the engine's UCX address)."""
        old = self._engines.get(record.engine_id)
        if old is not None and not self.owns(old, record.secret):
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"engine id {record.engine_id[:MAX_ID_CHARS]!r} was claimed by another engine")
        self._engines[record.engine_id] = record
        if old is not None and old.link is not None and old.link is not record.link:
            old.link.close(reason="the engine handshook again" + (" with another worker address"
                           if old.link.address != record.ucx_address else ""))

    def heard_from(self, engine_id: str, now: float | None = None) -> None:
        """Note a call from ``engine_id`` (an engine without a record is not tracked)."""
        record = self._engines.get(engine_id)
        if record is not None:
            record.heard_at = time.monotonic() if now is None else now

    def forget(self, engine_id: str, why: str) -> bool:
        """Drop the engine's record and close its link (idempotent); True if it had one."""
        record = self._engines.pop(engine_id, None)
        if record is None:
            return False
        if record.link is not None:
            record.link.close()
        logger.info("forgetting decode engine %s (%s); it must handshake again", engine_id, why)
        return True

    def forget_silent(self, now: float | None = None) -> list[str]:
        """Forget the engines not heard from for ``FORGET_AFTER_LEASES`` leases, or for
        ``FORGET_AFTER_FAILED_SEND_LEASES`` when the last UCX send to them failed. ``now``
        (``time.monotonic()``) is for tests. Returns the engines forgotten."""
        now = time.monotonic() if now is None else now
        gone = []
        for record in list(self._engines.values()):
            failed = record.link is not None and record.link.send_failed_at is not None
            leases = FORGET_AFTER_FAILED_SEND_LEASES if failed else FORGET_AFTER_LEASES
            silent = now - record.heard_at
            if silent >= leases * self.lease_s:
                gone.append(record.engine_id)
                self.forget(record.engine_id, f"not heard from for {silent:.1f} s"
                            + (" after a failed UCX send" if failed else ""))
        return gone

    def close(self) -> None:
        """Close every engine's link and drop every record (a node that stops)."""
        for record in self._engines.values():
            if record.link is not None:
                record.link.close()
        self._engines.clear()
