"""The instances one request tries in a role, and what went wrong on each: each instance once, fewest
least loaded first, or where the prompt's prefix went before (``InstancePool.choose``); a role's only instance once more after
``retry_pause_s`` unless it timed out. An instance that fails is marked failed in its pool (tried last for
the pool's cooldown), counted in the router's metrics and logged; when none is left the client's 502
names each with what went wrong. Used by the PD path (``pd``) and the passthrough (``passthrough``)."""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

import aiohttp

from kpool_pd.router.bodies import RouterError
from kpool_pd.router.instances import Instance, InstancePool
from kpool_pd.router.metrics import RouterMetrics
from kpool_pd.router.prefix import PromptShape

logger = logging.getLogger(__name__)

FAILED = (aiohttp.ClientError, TimeoutError)  # an instance that could not be reached or did not answer in time


def describe(error: BaseException, timeout_s: float) -> str:
    """What went wrong, for a log line and the client's 502: ``no answer within N s`` or the error's name."""
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def quoted(raw: bytes) -> str:
    """The first 200 characters of an instance's answer, as text."""
    return raw[:200].decode(errors="replace")


class Attempts:
    """One request's tries in ``pool``. ``next`` gives the instance to try (None: none left; it may pause
    ``retry_pause_s`` before a role's only instance's second try); ``failed`` records a failure;
    ``exhausted`` is the 502 naming each. ``shape``: the request's prompt, for the choice by load and
    prefix; ``first``: the instance to try first, chosen before (then the others by choice). One event loop; one
    request."""

    def __init__(self, pool: InstancePool, metrics: RouterMetrics, retry_pause_s: float,
                 shape: PromptShape | None = None, first: Instance | None = None) -> None:
        self.pool, self.failures, self.shape, self._first = pool, [], shape, first
        self.timed_out = False
        self._metrics = metrics
        self._tried: set[str] = set()
        self._pause_s, self._again = retry_pause_s, len(pool.instances) == 1

    async def next(self) -> Instance | None:
        if self._first is not None:  # chosen already (a decode planned before its prefill)
            instance, self._first = self._first, None
            self._tried.add(instance.url)
            return instance
        if (instance := self.pool.choose(self._tried, self.shape)) is not None:
            self._tried.add(instance.url)
            return instance
        if self._again and self.failures and not self.timed_out and self.pool.instances:
            self._again = False
            await asyncio.sleep(self._pause_s)
            return self.pool.instances[0]
        return None

    def failed(self, instance: Instance, error: BaseException | str, timeout_s: float, request_id: str) -> None:
        """``instance`` failed this request: ``error`` is what was raised (described) or a reason."""
        why = error if isinstance(error, str) else describe(error, timeout_s)
        self.timed_out = isinstance(error, TimeoutError)
        self.pool.failed(instance, why)
        self._metrics.instance_failures.labels(self.pool.role.value, instance.url).inc()
        self.failures.append(f"{instance.url} ({why})")
        logger.warning("request %s: %s instance %s failed: %s", request_id, self.pool.role.value, instance.url, why)

    def exhausted(self, what: str | None = None) -> RouterError:
        """The client's 502: ``every <role> instance failed: URL (why); ...``, or ``what`` in place of
        ``every <role> instance failed``."""
        lead = what or f"every {self.pool.role.value} instance failed"
        if not self.failures and not self.pool.instances:
            return RouterError(HTTPStatus.BAD_GATEWAY, f"{what + ': ' if what else ''}no {self.pool.role.value} "
                                                       "instance is known (none listed, or its DNS name resolved to "
                                                       "no address yet)")
        return RouterError(HTTPStatus.BAD_GATEWAY, f"{lead}: " + "; ".join(self.failures))
