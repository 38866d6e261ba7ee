"""A producer request that vLLM ends with no answer to its client after it was offered (aborted between the
step that computed its prompt's last token and that step's output, as asynchronous scheduling allows) frees
its blocks at once: the scheduler side returns no delay and withdraws the request in the next step's
metadata, and each producer worker ends its grants before that step's forward, never reporting the request
in ``finished_sending`` (vLLM asserts on a request it no longer knows). A request that finished with its
answer keeps its blocks for its consumer, as before."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector import prefill_api as pb  # noqa: E402
from kpool_pd.vllm.groups import GroupKind, GroupRule  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata  # noqa: E402
from kpool_pd.vllm.scheduler import ProducerScheduler  # noqa: E402
from kpool_pd.vllm.settings import KpoolPdSettings  # noqa: E402
from tests.vllm.test_vllm_producer_frees import UNITS, offers, producer, release_whole  # noqa: E402,F401

pytestmark = pytest.mark.vllm  # vLLM's config objects, a port of its own

RULES = (GroupRule(group=0, kind=GroupKind.FULL, block_size=16),)
PROMPT = list(range(37))  # three blocks of 16


def offered(scheduler: ProducerScheduler, request_id: str) -> SimpleNamespace:
    """A do_remote_decode request whose whole prompt the step computes, offered in that step's metadata."""
    request = SimpleNamespace(request_id=request_id, kv_transfer_params={"do_remote_decode": True},
                              prompt_token_ids=PROMPT, num_prompt_tokens=len(PROMPT), num_computed_tokens=0,
                              status=SimpleNamespace(name="RUNNING"))
    scheduler.update_state_after_alloc(request, None, 0)
    meta = scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={request_id: len(PROMPT)},
                                                          total_num_scheduled_tokens=len(PROMPT)))
    assert [offer.request_id for offer in meta.offers] == [request_id]
    return request


@pytest.mark.parametrize("status", ["FINISHED_ABORTED", "FINISHED_ERROR", "FINISHED_IGNORED"])
def test_an_offered_request_ended_unanswered_frees_at_once_and_is_withdrawn_next_step(status):
    settings = KpoolPdSettings.from_extra_config({"listen": "127.0.0.1:7600"}, producer=True)
    scheduler = ProducerScheduler(settings, RULES, engine_id="withdraw-p")
    scheduler.kv_cache_manager = SimpleNamespace(get_block_ids=lambda request_id: ([1, 2, 3],))
    answered, dropped = offered(scheduler, "answered"), offered(scheduler, "dropped")
    answered.status.name = "FINISHED_LENGTH_CAPPED"
    delay, params = scheduler.request_finished(answered, ([1, 2, 3],))
    assert delay and params["remote_request_id"] == "answered"  # its consumer pulls it: the blocks stay
    dropped.status.name = status
    assert scheduler.request_finished(dropped, ([1, 2, 3],)) == (False, None)
    idle = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    assert scheduler.build_connector_meta(idle).withdrawals == ["dropped"]
    assert scheduler.build_connector_meta(idle).withdrawals == []  # withdrawn once


def test_a_withdrawn_request_frees_its_grants_and_is_never_reported(producer):
    step = offers()
    producer.offer(KpoolPdMetadata(offers=step))
    gone, kept, *_ = step
    producer.before_forward(KpoolPdMetadata(withdrawals=[gone.request_id]))
    assert producer.cache.allocations_held == (len(step) - 1) * (1 + UNITS)  # its whole and slot grants ended

    async def release_again():
        return producer.node.grants.release(pb.ReleaseRequest(grant_id=gone.key)).released
    assert producer.loop.call(release_again) is False  # no grant left under its key: nothing can pull it
    assert producer.finished_sending({gone.request_id, kept.request_id}) == set()  # vLLM freed it already
    release_whole(producer, kept)
    assert producer.finished_sending(set()) == {kept.request_id}  # the others go on as before
    assert producer.take_stats().data["grants_withdrawn"] == 1
    producer.before_forward(KpoolPdMetadata(withdrawals=["never-offered"]))  # nothing held here: a no-op
    assert producer.finished_sending({"never-offered"}) == set()


def test_the_worker_withdraws_when_vllm_binds_the_steps_metadata_before_the_forward():
    """vLLM binds a step's metadata before its forward and calls start_load_kv after it (unless the step loads
    synchronously): the withdrawals go with the binding, never after the forward that may reuse the blocks."""
    from kpool_pd.vllm.connector import KpoolPdConnector
    calls = []
    connector = object.__new__(KpoolPdConnector)  # its worker side only: no vLLM config needed
    connector.producer_worker = SimpleNamespace(before_forward=lambda meta: calls.append(("withdraw", meta)))
    connector.consumer_worker = SimpleNamespace(load=lambda meta: calls.append(("load", meta)))
    meta = KpoolPdMetadata(withdrawals=["gone"])
    connector.bind_connector_metadata(meta)
    assert calls == [("withdraw", meta)], "the binding did not withdraw"
    connector.start_load_kv(None)
    assert calls == [("withdraw", meta), ("load", meta)], "start_load_kv withdrew again or did not load"
