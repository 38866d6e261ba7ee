"""The router's health probes: each instance's ``GET /health`` every ``period_s``, each probe given
``timeout_s``, on a fresh connection (so that a probe also shows a connection can be opened). An instance
that does not answer 200 in time is marked DOWN with the reason, so that ``/health`` shows a dead URL
before a request fails on it; one that answers 200 is marked UP (its request failures forgiven: the probe
is the freshest word on it). Changes of state are logged, steady probes are not."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kpool_pd.router.instances import Instance, InstancePool, InstanceState

logger = logging.getLogger(__name__)


class HealthProber:
    """Created by the app at start-up; ``run`` until cancelled at clean-up. Never raises from a probe."""

    def __init__(self, pools: tuple[InstancePool, ...], session: aiohttp.ClientSession, *, period_s: float,
                 timeout_s: float) -> None:
        self._pools, self._session = pools, session
        self._period_s, self._timeout_s = period_s, timeout_s

    async def _failure(self, instance: Instance) -> str | None:
        """Why its probe failed, or None when it answered 200 in time."""
        try:
            async with asyncio.timeout(self._timeout_s), self._session.get(instance.url + "/health") as answer:
                if answer.status == 200:
                    return None
                return f"GET /health: HTTP {answer.status}"
        except TimeoutError:
            return f"GET /health: no answer within {self._timeout_s:g} s"
        except aiohttp.ClientError as error:
            return f"GET /health: {type(error).__name__}: {error}"

    async def _probe(self, pool: InstancePool, instance: Instance) -> None:
        failure = await self._failure(instance)
        before = pool.state(instance)
        if failure is None:
            pool.succeeded(instance)
            if before is not InstanceState.UP:
                logger.info("%s instance %s answers its health probe: up", pool.role.value, instance.url)
        else:
            pool.down(instance, failure)
            if before is not InstanceState.DOWN:
                logger.warning("%s instance %s is down: %s", pool.role.value, instance.url, failure)

    async def probe_all(self) -> None:
        """One probe of every instance, at once."""
        await asyncio.gather(*(self._probe(pool, i) for pool in self._pools for i in pool.instances))

    async def run(self) -> None:
        """Probes every ``period_s`` (the first at once) until cancelled."""
        while True:
            await self.probe_all()
            await asyncio.sleep(self._period_s)
