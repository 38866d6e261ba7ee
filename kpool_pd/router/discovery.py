"""Finding instances through DNS while the router runs: an instance given as ``dns:///NAME:PORT`` stands for
``http://ADDRESS:PORT`` for every address NAME resolves to (a Kubernetes headless Service gives one per
ready pod), re-resolved every ``period_s``. A pod that joins is chosen from the next resolve on; one that
leaves is no longer chosen and finishes the requests it has. A name that fails to resolve (or takes longer
than ``timeout_s``) keeps its last answer, so a DNS hiccup does not empty a pool."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from kpool_pd.router.instances import InstancePool
from kpool_pd.router.settings import DNS_PREFIX

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> addresses, OSError when it does not resolve


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, IPv6 ones in brackets, in the resolver's order without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[str] = []
    for family, *_, sockaddr in infos:
        address = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
        if address not in found:
            found.append(address)
    return found


def split_target(target: str) -> tuple[str, int]:
    """``dns:///NAME:PORT`` -> (NAME, PORT)."""
    host, _, port = target.removeprefix(DNS_PREFIX).rpartition(":")
    return host.strip("[]"), int(port)


class Discovery:
    """Keeps each pool's instances equal to its listed URLs plus what its DNS targets resolve to. ``targets``:
    pool -> (its listed URLs, its ``dns:///`` targets). ``refresh`` once, ``run`` until cancelled."""

    def __init__(self, targets: dict[InstancePool, tuple[tuple[str, ...], tuple[str, ...]]], *, period_s: float,
                 timeout_s: float, resolver: Resolver = resolve_addresses) -> None:
        self._targets, self._period_s, self._timeout_s = targets, period_s, timeout_s
        self._resolver = resolver
        self._last: dict[str, list[str]] = {}  # target -> its last answer (URLs)
        self.resolves = 0  # refreshes done (tests, logs)

    async def _urls(self, target: str) -> list[str]:
        host, port = split_target(target)
        try:
            async with asyncio.timeout(self._timeout_s):
                addresses = await self._resolver(host, port)
        except (OSError, TimeoutError) as error:
            kept = self._last.get(target, [])
            logger.warning("cannot resolve %s (%s); keeping its last %d instances", target,
                           error or f"no answer within {self._timeout_s:g} s", len(kept))
            return kept
        self._last[target] = urls = [f"http://{a}:{port}" for a in addresses]
        return urls

    async def refresh(self) -> None:
        """Resolve every target once and set each pool's instances."""
        for pool, (listed, dns) in self._targets.items():
            urls = list(listed)
            for target in dns:
                urls += [u for u in await self._urls(target) if u not in urls]
            added, removed = pool.set_urls(urls)
            for url in added:
                logger.info("%s instance %s joined", pool.role.value, url)
            for url in removed:
                logger.info("%s instance %s left; it finishes the requests it has", pool.role.value, url)
        self.resolves += 1

    async def run(self) -> None:
        """``refresh`` every ``period_s`` until cancelled (the first after one period: start-up resolved once)."""
        while True:
            await asyncio.sleep(self._period_s)
            await self.refresh()
