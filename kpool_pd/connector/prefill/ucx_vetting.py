"""The prefill role's check of a decode engine's UCX worker address before any endpoint is made to it.

A worker address comes from the wire (the Handshake), and UCX trusts it: a malformed one aborts the
process. So the sending side vets it first: a structural check of its bytes
(``kpool_pd.connector.prefill.ucx_address``), then a first endpoint made in a child process
(``kpool_pd.connector.prefill.ucx_probe``), which UCX may take down instead of the daemon. Only then does
``UcxNode.endpoint_to`` see it. Verdicts are remembered, so a reconnect costs no probe.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping

from kpool_pd.connector.prefill.ucx_address import WorkerAddressError, check_worker_address
from kpool_pd.connector.prefill.ucx_probe import ProbeOutcome, UcxProbe
from kpool_pd.connector.shared.ucx import UcxUnreachableError

logger = logging.getLogger(__name__)

VETTED_MEMORY = 1024  # worker addresses whose verdict is remembered (each way), so a reconnect costs no probe


class AddressVetting:
    """Vets worker addresses for a node whose UCX runs with ``options`` (``UcxNode.options``) and, with
    ``unified_mode``, UCX's unified mode (``UcxNode.unified_mode``: its addresses are shorter)."""

    def __init__(self, options: Mapping[str, str], *, unified_mode: bool) -> None:
        self.options, self.unified_mode = dict(options), unified_mode
        self._probe: UcxProbe | None = None
        self._vetted: OrderedDict[bytes, None] = OrderedDict()
        self._refused: OrderedDict[bytes, str] = OrderedDict()

    def start(self) -> None:
        """Start the probe child in the background, so that the first ``vet`` does not wait for it (a
        sending node calls it once UCX is up; idempotent)."""
        if self._probe is None:
            self._probe = UcxProbe(self.options)
        self._probe.start()

    async def ready(self) -> None:
        """``start``, then wait until the probe child is ready (a loaded machine may take seconds to start it,
        which a Handshake's share of its deadline would otherwise pay). A child that cannot start is logged
        and left to the first ``vet``, which starts another."""
        self.start()
        try:
            await self._probe.ready()
        except Exception as exc:
            logger.warning("the UCX address probe did not start (%s); the first handshake over UCX starts it again",
                           exc)

    async def vet(self, address: bytes, timeout_s: float) -> None:
        """Check a worker address from the wire before ``UcxNode.endpoint_to`` may hand it to UCX here.

        First its bytes (``check_worker_address``), then, for an address not vetted before, a first
        endpoint made by the probe child. Returns when UCX reached it there. Raises
        ``WorkerAddressError`` (a ValueError naming why) when the bytes are malformed or took the
        probe down, ``UcxUnreachableError`` when UCX refused the endpoint or the probe did not answer
        within ``timeout_s``. Verdicts are remembered (the last ``VETTED_MEMORY`` each way), a time-out
        excepted. Called on this node's event loop; probes run one at a time."""
        known = bytes(address) if isinstance(address, (bytes, bytearray, memoryview)) else None
        if known in self._vetted:  # a verdict is only ever kept for an address whose bytes passed
            self._vetted.move_to_end(known)
            return
        if known in self._refused:
            raise WorkerAddressError(self._refused[known])
        check_worker_address(address, unified_mode=self.unified_mode)
        address = bytes(address)
        self.start()
        result = await self._probe.probe(address, timeout_s)
        if result.outcome is ProbeOutcome.REACHED:
            _remember(self._vetted, address, None)
            logger.info("UCX worker address of %d bytes vetted in %.0f ms (%s)", len(address), result.seconds * 1000,
                        result.detail)
            return
        if result.outcome is ProbeOutcome.CRASHED:
            reason = f"making an endpoint to it crashed UCX: {result.detail}"
            _remember(self._refused, address, reason)
            raise WorkerAddressError(reason)
        if result.outcome is ProbeOutcome.UNREACHABLE:
            raise UcxUnreachableError(f"UCX cannot make an endpoint to it: {result.detail}")
        raise UcxUnreachableError(f"it could not be checked in time: {result.detail}")

    async def stop(self) -> None:
        """End the probe child and wait until it is gone (idempotent)."""
        if self._probe is not None:
            await self._probe.close()

    def kill(self) -> None:
        """End the probe child now, without waiting (idempotent)."""
        if self._probe is not None:
            self._probe.kill()


def _remember(memory: OrderedDict, key: bytes, value) -> None:
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > VETTED_MEMORY:
        memory.popitem(last=False)
