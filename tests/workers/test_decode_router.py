"""The decode node's prefill router against a real prefill connector on loopback, with a
resolver the test controls: a node gone from DNS leaves the rotation at once and its channel
closes only once its grants are pulled; a name that fails to resolve keeps its last answer."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, StatusError
from kpool_pd.decode_worker.router import PrefillRouter, resolve_host
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.pulls import pull_into


class FakeDns:
    """Answers ``answer`` for every name, or raises ``error`` when set."""

    def __init__(self, answer: list[str]) -> None:
        self.answer, self.error = answer, None
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return list(self.answer)


def test_a_node_gone_from_dns_is_disconnected_once_its_grant_is_pulled():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            dns = FakeDns([pair.address])
            router = PrefillRouter(pair.decode, ("dns:///prefill.example:1",), health_interval_s=60, rpc_timeout_s=patient(5),
                                   resolver=dns)
            await router.start()
            try:
                assert router.healthy() == [pair.address]
                peer = await router.pick()
                grant = await peer.prefill("in-flight", [5] * 100)

                dns.answer = []  # the pod left the headless Service
                await router.refresh()
                assert router.healthy() == []
                assert peer.busy and not peer.closed and pair.decode.peers == (peer,)  # its grant is still to pull
                with pytest.raises(StatusError) as err:
                    await router.pick()
                assert err.value.code is grpc.StatusCode.UNAVAILABLE

                with await pull_into(pair.d_cache, peer, grant) as landed:
                    assert landed.nbytes > 0
                assert not peer.busy
                await router.refresh()
                assert peer.closed and pair.decode.peers == ()
                assert pair.free() == start

                dns.answer = [pair.address]  # it comes back: a new handshake, a new peer
                await router.refresh()
                again = await router.pick()
                assert again is not peer and not again.closed

                dns.error = OSError("temporary failure in name resolution")
                calls = dns.calls
                await router.refresh()
                assert dns.calls == calls + 1
                assert router.healthy() == [pair.address] and not again.closed  # the last answer holds
            finally:
                await router.close()
    asyncio.run(main())


def test_an_unreleased_grant_keeps_a_retired_peer_only_until_its_lease_ends():
    async def main():
        config = ConnectorConfig(peer_token=procs.TOKEN, lease_s=0.5, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))
        async with InProcessPair(config=config) as pair:
            dns = FakeDns([pair.address])
            router = PrefillRouter(pair.decode, ("dns:///prefill.example:1",), health_interval_s=60, rpc_timeout_s=patient(5),
                                   resolver=dns)
            await router.start()
            try:
                peer = await router.pick()
                grant = await peer.prefill("abandoned", [5] * 10)
                dns.answer = []
                await router.refresh()
                assert not peer.closed and peer.busy
                await asyncio.sleep(grant.lease_s + 0.1)  # never pulled nor released: its lease runs out
                await router.refresh()
                assert peer.closed
            finally:
                await router.close()
    asyncio.run(main())


def test_resolve_host_gives_host_port_pairs():
    async def main():
        addresses = await resolve_host("localhost", 8500)
        assert addresses and all(a.endswith(":8500") for a in addresses)
        assert "127.0.0.1:8500" in addresses or "[::1]:8500" in addresses
        with pytest.raises(OSError):
            await resolve_host("no-such-host.invalid", 1)
    asyncio.run(main())


def test_a_node_that_failed_a_call_gets_a_new_peer_and_the_old_one_finishes_its_pull():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            router = PrefillRouter(pair.decode, (pair.address,), health_interval_s=60, rpc_timeout_s=patient(5))
            await router.start()
            try:
                old = await router.pick()
                grant = await old.prefill("in-flight", [5] * 100)
                router.mark_failed(old, "a pull failed")
                assert router.healthy() == []
                await router.refresh()  # healthy again: a new handshake on a new channel
                new = await router.pick()
                assert new is not old and not old.closed and pair.decode.peers == (old, new)
                with await pull_into(pair.d_cache, old, grant) as landed:  # the old channel still serves its grant
                    assert landed.nbytes > 0
                await router.refresh()
                assert old.closed and not new.closed and pair.decode.peers == (new,)
                assert pair.free() == start
            finally:
                await router.close()
    asyncio.run(main())


class SlowHealth:
    """The router's health stub, made to fail the next checks with ``code`` (as a node that answers too late, or not
    at all, would) while ``code`` is set; the real stub otherwise."""

    def __init__(self, real) -> None:
        self.real, self.code = real, None

    def HealthStub(self, channel):  # noqa: N802 (the generated module's name)
        stub = self.real.HealthStub(channel)
        if self.code is None:
            return stub
        code = self.code

        class Failing:
            def Check(self, request, **kwargs):  # noqa: N802
                async def fail():
                    raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)
                return fail()
        return Failing()


def test_a_healthy_node_whose_checks_run_late_stays_in_rotation_until_three_in_a_row(monkeypatch):
    from kpool_pd.decode_worker import router as router_module

    health = SlowHealth(router_module.health_pb2_grpc)
    monkeypatch.setattr(router_module, "health_pb2_grpc", health)

    async def main():
        async with InProcessPair() as pair:
            router = PrefillRouter(pair.decode, (pair.address,), health_interval_s=60, rpc_timeout_s=patient(5),
                                   no_node_wait_s=0.1)
            await router.start()
            try:
                peer = await router.pick()
                health.code = grpc.StatusCode.DEADLINE_EXCEEDED
                for _ in range(router_module.SLOW_CHECKS_TOLERATED):
                    await router.refresh()
                    assert router.healthy() == [pair.address] and await router.pick() is peer
                await router.refresh()  # one more late check in a row: out of the rotation
                assert router.healthy() == []
                with pytest.raises(StatusError) as err:
                    await router.pick()
                assert err.value.code is grpc.StatusCode.UNAVAILABLE

                health.code = None
                await router.refresh()
                assert router.healthy() == [pair.address]
                health.code = grpc.StatusCode.DEADLINE_EXCEEDED
                await router.refresh()  # the count started again with the answered check
                assert router.healthy() == [pair.address]

                health.code = grpc.StatusCode.UNAVAILABLE  # unreachable: out at once
                await router.refresh()
                assert router.healthy() == []
            finally:
                await router.close()
    asyncio.run(main())
