"""The prefill and decode daemons' nodes in the test's own event loop, for the option matrices of the
end-to-end tests: each node is made from the same flags as its daemon (the daemon's own settings loader and
checks), built, warmed up, started and served behind the daemon's gRPC server on a loopback port of its
own, in the order ``kpool_pd.runtime.daemon.serve`` follows. What the process adds around that (its
signals, drain, ready file, metrics endpoint, logging set-up, parent-death signal) is not here: the
tests of ``tests/e2e`` and ``tests/workers`` that run the daemons as processes cover it, once per
transport and family.

``pd_nodes`` is the in-process counterpart of ``tests.e2e.test_e2e.pd_pair``: one prefill node and
one decode node per transport pulling from it; ``match_and_free`` that of its check.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.decode_worker.daemon import SPEC as DECODE_SPEC
from kpool_pd.model.colocated import GenerateRequest, RequestResult
from kpool_pd.prefill_worker.daemon import SPEC as PREFILL_SPEC
from kpool_pd.runtime.daemon import STOP_GRACE_S, daemon_options
from kpool_pd.runtime.device import resolve_device
from kpool_pd.runtime.grpc_server import GrpcServer
from kpool_pd.runtime.node import DaemonSpec, Node, NodeContext
from kpool_pd.runtime.service_options import check_credentials
from kpool_pd.runtime.settings import load_settings
from kpool_pd.runtime.tls import tls_config
from kpool_pd.runtime.transports import transports_of
from tests.support.polling import until

HOST = "127.0.0.1"
SETTLE_S = 20.0  # how long a finished request's blocks may take to be freed on every node


@dataclass
class ServedNode:
    """One daemon's node, served on ``port``."""

    name: str
    node: Node
    context: NodeContext
    server: GrpcServer

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def free_blocks(self) -> int:
        return self.node.cache.free_blocks

    @property
    def serving(self) -> bool:
        """What its grpc.health.v1 answers (a decode node: once a prefill node is usable)."""
        return self.context.health.serving

    async def close(self) -> None:
        await self.server.stop(STOP_GRACE_S)
        await self.node.close()


async def serve_node(spec: DaemonSpec, argv: Sequence[str], name: str, env: Mapping[str, str] | None = None
                     ) -> ServedNode:
    """The node of ``spec`` made from the daemon flags ``argv``, warmed up, started and served (port 0: any)."""
    settings = load_settings(spec.role, daemon_options(spec), ["--host", HOST, "--port", "0", *argv], env=env)
    check_credentials(spec.role, settings)
    if spec.check is not None:
        spec.check(settings)
    tls = tls_config(settings)
    context = NodeContext(role=spec.role, settings=settings, device=resolve_device(settings["device"]), tls=tls,
                          transports=transports_of(settings), registry=CollectorRegistry(),
                          engine_id=settings["engine_id"] or name)
    node = spec.build(context)
    server = None
    try:
        await asyncio.to_thread(node.warm_up)
        await node.start()
        connector_config = context.connector_config
        server = GrpcServer(client_token=settings["token"] or None, peer_token=connector_config.peer_token, tls=tls,
                            options=connector_config.grpc_options(), gate=context.health,
                            load=getattr(node, "load", None))
        server.add(node.servicer)
        await server.start(HOST, settings["port"])
        await context.health.open(server)
    except BaseException:
        if server is not None:
            await server.stop(STOP_GRACE_S)
        await node.close()
        raise
    return ServedNode(name, node, context, server)


@contextlib.asynccontextmanager
async def pd_nodes(model_flags: Sequence[str], transports: Sequence[str], *, decode_model: Sequence[str] | None = None,
                   prefill_extra: Sequence[str] = (), decode_extra: Sequence[str] = ()
                   ) -> AsyncIterator[tuple[ServedNode, dict[str, ServedNode]]]:
    """One prefill node offering every transport and one decode node per transport pulling from it (over
    that transport only), as ``start_prefill`` and ``start_decode`` flag the daemons. Yields
    ``(prefill, {transport: decode})``; every node is closed afterwards."""
    nodes: list[ServedNode] = []
    try:
        prefill = await serve_node(PREFILL_SPEC, ["--transports", "auto", *model_flags, *prefill_extra], "prefill-t")
        nodes.append(prefill)
        decodes = {}
        for transport in transports:
            decodes[transport] = await serve_node(
                DECODE_SPEC, ["--prefill", prefill.address, "--transport", transport, "--transports", transport,
                              *(decode_model or model_flags), *decode_extra], f"decode-{transport}")
            nodes.append(decodes[transport])
        yield prefill, decodes
    finally:
        for node in reversed(nodes):
            await node.close()


def assert_match(results: Sequence[RequestResult | RequestFailed], reference: Sequence[RequestResult],
                 transport: str) -> None:
    """Every request succeeded over ``transport`` and equals its colocated run: tokens, output and state digests."""
    failed = [r for r in results if isinstance(r, RequestFailed)]
    assert not failed, f"{len(failed)} failed over {transport}: {failed[0]}"
    assert {r.transport for r in results} == {transport}
    by_id = {r.request_id: r for r in reference}
    assert len(results) == len(reference)
    for result in results:
        want = by_id[result.request_id]
        assert (result.tokens, result.output_digest, result.state_digest) == (
            want.tokens, want.output_digest, want.state_digest), f"{result.request_id} (prompt {result.prompt_len})"


async def match_and_free(prefill: ServedNode, decodes: Mapping[str, ServedNode],
                         batches: Mapping[str, Sequence[GenerateRequest]],
                         references: Mapping[str, Sequence[RequestResult]]) -> list[list[RequestResult]]:
    """Each transport's batch through its decode node (all at once) equals its colocated reference, and every
    node has all its blocks free again afterwards. Returns the results per decode node."""
    nodes = [prefill, *decodes.values()]
    start_free = [n.free_blocks for n in nodes]
    async def serving() -> bool:
        return all(d.serving for d in decodes.values())
    await until(serving, "every decode node serving", 30)
    outcomes = await asyncio.gather(*(generate_all(d.address, batches[t]) for t, d in decodes.items()))
    for transport, results in zip(decodes, outcomes):
        assert_match(results, references[transport], transport)

    async def all_free() -> bool:
        return [n.free_blocks for n in nodes] == start_free
    await until(all_free, f"every block free again (start {start_free})", SETTLE_S)
    return outcomes
