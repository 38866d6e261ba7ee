"""A decode request's kv_transfer_params as a hostile client sends them (``kpool_pd.transfer_params``,
``kpool_pd.vllm.guard``, ``kpool_pd.vllm.scheduler.ConsumerScheduler``), without engines: every field
checked and named, producers outside the allowlist refused without a lookup, the grant bound to its
prompt, a prefix hit loading only the blocks it lacks, and the grants a consumer will not pull handed back
(a rejected or aborted request, or one whose whole prompt this engine holds)."""

from __future__ import annotations

import asyncio
import json
import math
import os
from types import SimpleNamespace

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.vllm.groups import GroupKind, GroupRule  # noqa: E402
from kpool_pd.vllm.guard import KvTransferParamsGuard, params_error  # noqa: E402
from kpool_pd.vllm.metadata import Offer, producer_params, released_after_pull  # noqa: E402
from kpool_pd.transfer_params import (DecodeParams, ProducerAllowlist, bounded_request_id, grant_key,  # noqa: E402
                                  prompt_digest)
from kpool_pd.vllm.scheduler import ConsumerScheduler  # noqa: E402
from kpool_pd.vllm.settings import KpoolPdSettings  # noqa: E402

PROMPT = list(range(3, 40))
RULES = (GroupRule(group=0, kind=GroupKind.FULL, block_size=16),)


def good_params(prompt=PROMPT, address="127.0.0.1:7600") -> dict:
    blocks = ((1, 2, 3),)
    offer = Offer(request_id="r", grant_id="ab" * 16, block_ids=blocks, prompt_len=len(prompt),
                  prompt_digest=prompt_digest(prompt, [3]))
    return producer_params(offer, address=address, engine_id="vllm-p", lease_s=30)


def test_good_params_parse():
    params = DecodeParams.parse(good_params())
    assert (params.address, params.num_tokens, params.block_ids, params.lease_s) == ("127.0.0.1:7600", 37,
                                                                                     ((1, 2, 3),), 30.0)
    assert params.key == grant_key("ab" * 16, prompt_digest(PROMPT, [3]))


@pytest.mark.parametrize("field,value", [
    ("remote_num_tokens", "abc"), ("remote_num_tokens", None), ("remote_num_tokens", math.inf),
    ("remote_num_tokens", [1]), ("remote_num_tokens", True), ("remote_num_tokens", 0), ("remote_num_tokens", 1 << 40),
    ("remote_block_ids", "1,2"), ("remote_block_ids", [[1, "2"]]), ("remote_block_ids", [[-1]]),
    ("remote_block_ids", [[1 << 40]]), ("remote_block_ids", []), ("remote_block_ids", [1, 2]),
    ("remote_address", "unix:/tmp/socket"), ("remote_address", "10.0.0.1"), ("remote_address", 7),
    ("remote_address", "h:0"), ("remote_address", "h:99999"), ("remote_address", "a" * 400 + ":1"),
    ("remote_grant_id", "../../etc"), ("remote_grant_id", 5), ("remote_prompt_digest", "0" * 63),
    ("remote_lease_ms", -5), ("remote_lease_ms", "30"), ("remote_engine_id", ["x"]), ("remote_request_id", "r" * 300),
], ids=lambda v: str(v)[:20])
def test_a_bad_field_is_named(field, value):
    params = good_params() | {field: value}
    with pytest.raises(ValueError, match=field):
        DecodeParams.parse(params)


@pytest.mark.parametrize("field", ["remote_num_tokens", "remote_grant_id", "remote_address", "remote_block_ids",
                                   "remote_prompt_digest"])
def test_a_missing_field_is_named(field):
    params = good_params()
    del params[field]
    with pytest.raises(ValueError, match=f"{field}.*missing"):
        DecodeParams.parse(params)


def test_json_values_no_python_type_can_pass_as_a_count():
    """What JSON can carry (a float, Infinity, null, a string of digits) never becomes a token count."""
    for raw in ('"37"', "37.0", "Infinity", "null", "[37]", "true", "1e3"):
        params = good_params() | {"remote_num_tokens": json.loads(raw)}
        with pytest.raises(ValueError, match="remote_num_tokens"):
            DecodeParams.parse(params)


def test_the_allowlist_takes_listed_producers_only():
    resolved = []

    def resolve(name: str) -> set[str]:
        resolved.append(name)
        return {"10.1.0.7", "10.1.0.8"} if name == "prefill.pd.svc" else set()

    allow = ProducerAllowlist(["127.0.0.1:7600", "prefill.pd.svc:7600", "[::1]"], resolve=resolve)
    assert allow.allows("127.0.0.1:7600")
    assert not allow.allows("127.0.0.1:7601")  # another port of a listed host:port
    assert allow.allows("[::1]:9") and allow.allows("[::1]:7600")  # a host listed without a port: any port
    assert allow.allows("prefill.pd.svc:7600") and allow.allows("PREFILL.pd.svc:7600")
    assert allow.allows("10.1.0.8:7600")  # an address of the listed DNS name
    assert not allow.allows("10.1.0.8:7601") and not allow.allows("10.1.0.9:7600")
    assert not allow.allows("evil.example:7600") and not allow.allows("192.168.0.1:7600")
    assert set(resolved) == {"prefill.pd.svc"}, "only the configured names are resolved, never a client's"


def test_a_consumer_needs_its_producers():
    with pytest.raises(ValueError, match="producers"):
        KpoolPdSettings.from_extra_config({"transport": "grpc"}, producer=False)
    with pytest.raises(ValueError, match="producers"):
        KpoolPdSettings.from_extra_config({"transport": "grpc", "producers": "127.0.0.1:1"}, producer=False)
    settings = KpoolPdSettings.from_extra_config({"transport": "grpc", "producers": ["127.0.0.1:1"]}, producer=False)
    assert settings.producers.allows("127.0.0.1:1")


def test_ucx_progress_reaches_the_connector_config_and_a_bad_one_is_named():
    from kpool_pd.connector import UcxProgress
    from kpool_pd.vllm.loop import connector_config
    base = {"transport": "grpc", "producers": ["127.0.0.1:1"]}
    assert connector_config(KpoolPdSettings.from_extra_config(base, producer=False)).ucx_progress is UcxProgress.AUTO
    polling = KpoolPdSettings.from_extra_config({**base, "ucx_progress": "thread-polling"}, producer=False)
    assert connector_config(polling).ucx_progress is UcxProgress.THREAD_POLLING
    with pytest.raises(ValueError, match=r"\['ucx_progress'\] must be one of \['auto', 'thread', 'thread-polling'\], "
                                         r"got 'spin'"):
        KpoolPdSettings.from_extra_config({**base, "ucx_progress": "spin"}, producer=False)


def test_the_digest_binds_tokens_and_block_counts():
    assert prompt_digest(PROMPT, [3]) == prompt_digest(list(PROMPT), [3])
    assert prompt_digest(PROMPT, [3]) != prompt_digest(PROMPT[:-1] + [999], [3])
    assert prompt_digest(PROMPT, [3]) != prompt_digest(PROMPT, [4])
    assert prompt_digest(PROMPT, [3]) != prompt_digest(PROMPT, [3, 0])


def test_request_ids_of_any_length_fit_the_connector():
    assert bounded_request_id("short") == "short"
    long_a, long_b = "x" * 5000 + "a", "x" * 5000 + "b"
    assert len(bounded_request_id(long_a)) <= 256
    assert bounded_request_id(long_a) != bounded_request_id(long_b)


# the guard: HTTP 400 before the engine --------------------------------------------------------------
def call_guard(body: bytes) -> tuple[int | None, bytes, bytes]:
    """(status the guard answered or None, its body, the body the app behind it read)."""
    seen = {}

    async def app(scope, receive, send):
        chunks = b""
        while True:
            message = await receive()
            chunks += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = chunks

    sent = []

    async def send(message):
        sent.append(message)

    parts = [body[:10], body[10:]]

    async def receive():
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    asyncio.run(KvTransferParamsGuard(app)({"type": "http", "method": "POST", "path": "/v1/completions"},
                                           receive, send))
    status = sent[0]["status"] if sent else None
    return status, b"".join(m.get("body", b"") for m in sent[1:]), seen.get("body", b"")


def test_the_guard_answers_400_naming_the_field():
    body = json.dumps({"prompt": PROMPT, "kv_transfer_params": good_params() | {"remote_num_tokens": "abc"}}).encode()
    status, answer, passed = call_guard(body)
    assert status == 400 and passed == b""
    assert "remote_num_tokens" in json.loads(answer)["error"]["message"]


@pytest.mark.parametrize("request_body", [
    {"prompt": PROMPT, "kv_transfer_params": None},
    {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}},
    {"prompt": PROMPT},
], ids=["null", "producer-side", "none"])
def test_the_guard_passes_other_requests_whole(request_body):
    body = json.dumps(request_body).encode()
    status, _, passed = call_guard(body)
    assert status is None and passed == body


def test_the_guard_passes_good_params_and_leaves_unparsable_bodies_to_vllm():
    body = json.dumps({"prompt": PROMPT, "kv_transfer_params": good_params()}).encode()
    assert call_guard(body)[0] is None and call_guard(body)[2] == body
    deep = b"[" * 100_000 + b"]" * 100_000 + b'"kv_transfer_params"'
    assert params_error(deep) is None and call_guard(deep)[2] == deep


# the consumer's decisions -------------------------------------------------------------------------------
def consumer() -> ConsumerScheduler:
    settings = KpoolPdSettings.from_extra_config({"transport": "grpc", "producers": ["127.0.0.1"]}, producer=False)
    return ConsumerScheduler(settings, RULES)


def request(params, prompt=PROMPT, request_id="d1", status="WAITING"):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(prompt),
                           num_prompt_tokens=len(prompt), status=SimpleNamespace(name=status))


def blocks(*ids, cached=0):
    """A request's ``KVCacheBlocks`` of one group: its first ``cached`` blocks from the prefix cache (hashed)."""
    group = [SimpleNamespace(block_id=b, block_hash=f"h{b}" if i < cached else None, is_null=False)
             for i, b in enumerate(ids)]
    return SimpleNamespace(get_block_ids=lambda: ([*ids],), blocks=(group,))


def step(scheduler):
    return scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1))


@pytest.mark.parametrize("bad", ["abc", None, math.inf, [1]], ids=str)
def test_bad_params_compute_here_and_release_the_grant(bad):
    scheduler = consumer()
    params = good_params() | {"remote_num_tokens": bad}
    assert scheduler.get_num_new_matched_tokens(request(params), 0) == (0, False)
    meta = step(scheduler)
    assert meta.loads == [] and [r.key for r in meta.releases] == [DecodeParams.parse(good_params()).key]
    assert scheduler.get_num_new_matched_tokens(request(params), 0) == (0, False)  # decided once
    assert step(scheduler).releases == []


def test_a_prefix_hit_loads_only_the_blocks_it_lacks():
    """Two of the prompt's three blocks (32 of 37 tokens) in this engine's prefix cache: 5 tokens load, the
    load holds the whole prompt's blocks and names the two held (not pulled), and the grant is the pull's."""
    scheduler = consumer()
    req = request(good_params())
    assert scheduler.get_num_new_matched_tokens(req, 32) == (5, True)
    scheduler.update_state_after_alloc(req, blocks(5, 6, 7, cached=2), 5)
    meta = step(scheduler)
    [load] = meta.loads
    assert load.error == "" and load.block_ids == ((5, 6, 7),) and load.held == (0, 1) and meta.releases == []


def test_a_prefix_hit_of_the_whole_prompt_releases_the_grant_at_once():
    scheduler = consumer()
    assert scheduler.get_num_new_matched_tokens(request(good_params()), 37) == (0, False)
    assert [r.key for r in step(scheduler).releases] == [DecodeParams.parse(good_params()).key]


def test_the_ring_is_never_held():
    from kpool_pd.vllm.groups import held_indices
    rules = (RULES[0], GroupRule(group=1, kind=GroupKind.RING, block_size=8))
    assert held_indices(rules, ((5, 6, 7), (9,)), (frozenset({5, 6}), frozenset({9}))) == (0, 1)


def test_a_request_that_never_loaded_releases_its_grant_when_it_ends():
    """vLLM's notify_kv_transfer_request_rejected sends a pre-aborted request (prompt [0]) with the params."""
    scheduler = consumer()
    assert scheduler.request_finished(request(good_params(), prompt=[0], status="FINISHED_ABORTED"), ([],)) == (
        False, None)
    [release] = step(scheduler).releases
    assert release.key == DecodeParams.parse(good_params()).key and "FINISHED_ABORTED" in release.why


def test_a_loading_request_leaves_its_grant_to_the_pull():
    scheduler = consumer()
    params = good_params()
    req = request(params)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (37, True)
    scheduler.update_state_after_alloc(req, blocks(5, 6, 7), 37)
    meta = step(scheduler)
    [load] = meta.loads
    assert load.error == "" and load.block_ids == ((5, 6, 7),) and meta.releases == []
    scheduler.request_finished(req, ([5, 6, 7],))
    assert step(scheduler).releases == []


def test_another_prompt_under_the_params_is_refused_before_any_byte():
    """The params of one prompt sent with another (a router reusing a batch's first params): the digests
    differ, the load fails, and the key pulled with is never the other prompt's."""
    scheduler = consumer()
    other = PROMPT[:-1] + [999]
    req = request(good_params(), prompt=other)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (37, True)
    scheduler.update_state_after_alloc(req, blocks(5, 6, 7), 37)
    [load] = step(scheduler).loads
    assert "digest" in load.error
    assert load.digest == prompt_digest(other, [3]) != load.params.prompt_digest


def test_a_queued_request_is_renewed_until_its_load():
    scheduler = consumer()
    req = request(good_params())
    scheduler.on_new_request(req)
    [renew] = step(scheduler).renewals
    assert (renew.request_id, renew.key) == ("d1", DecodeParams.parse(good_params()).key)
    scheduler.on_new_request(request(good_params() | {"remote_num_tokens": "abc"}, request_id="d2"))
    scheduler.on_new_request(request({"do_remote_decode": True}, request_id="d3"))
    assert step(scheduler).renewals == []  # refused params and producer-side requests: nothing to renew


def test_kv_both_needs_what_each_of_its_roles_needs():
    with pytest.raises(ValueError, match="producers"):
        KpoolPdSettings.from_extra_config({"listen": "127.0.0.1:7600"}, producer=True, consumer=True)
    with pytest.raises(ValueError, match="listen"):
        KpoolPdSettings.from_extra_config({"producers": ["127.0.0.1"]}, producer=True, consumer=True)
    both = KpoolPdSettings.from_extra_config({"listen": "127.0.0.1:7600", "producers": ["127.0.0.1"]},
                                             producer=True, consumer=True)
    assert both.listen == ("127.0.0.1", 7600) and both.producers.allows("127.0.0.1:7601")


def test_the_settings_defaults_are_the_connectors_and_the_table_states_them():
    """Each default has one owner (ConnectorConfig); the settings' table says what the code uses."""
    import re

    from kpool_pd.connector import ConnectorConfig
    from kpool_pd.vllm import settings as module
    config = ConnectorConfig()
    settings = KpoolPdSettings.from_extra_config({"transport": "grpc", "producers": ["127.0.0.1"]}, producer=False)
    assert (settings.lease_s, settings.pull_timeout_s, settings.rpc_timeout_s) == (
        config.lease_s, config.transfer_timeout_s, 3 * config.rpc_timeout_s)
    for key, value in module.DEFAULTS.items():
        row = re.search(rf"^\| ``{key}`` \| (\d+) ", module.__doc__, flags=re.M)
        assert row and float(row.group(1)) == value, key


@pytest.mark.parametrize("extra,model_mla,expected", [
    ({}, False, "LBHNC"), ({}, True, None), ({"kv_layout": "per_layer"}, False, "LBHNC"),
    ({"kv_layout": "cross_layer"}, False, "BLHNC"), ({"kv_layout": "cross_layer"}, True, "BLHNC"),
], ids=["default", "default-mla", "per-layer", "cross-layer", "cross-layer-mla"])
def test_the_connector_asks_vllm_for_the_layout_its_settings_name(extra, model_mla, expected):
    """``kv_layout`` "cross_layer" asks vLLM for BLHNC: a block holds every layer, so a pull is one region per
    run of blocks (the planning is covered by tests/vllm/test_vllm_hma_specs.py::test_a_transfer_is_a_few_regions)."""
    from kpool_pd.vllm import KpoolPdConnector
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                             model_config=SimpleNamespace(use_mla=model_mla))
    assert KpoolPdConnector.get_required_kvcache_layout(config) == expected


def test_an_unknown_layout_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"kv_layout.*\['per_layer', 'cross_layer'\].*'blocks'"):
        KpoolPdSettings.from_extra_config({"transport": "grpc", "producers": ["127.0.0.1"], "kv_layout": "blocks"},
                                          producer=False)


def test_a_producer_releases_after_the_pull_by_default_and_its_params_say_so():
    """``release_after_pull``: on unless set false; the params state it only when on, and nothing else in
    them says it (a consumer reads the flag, never guesses)."""
    on = KpoolPdSettings.from_extra_config({"listen": "127.0.0.1:1"}, producer=True)
    off = KpoolPdSettings.from_extra_config({"listen": "127.0.0.1:1", "release_after_pull": False}, producer=True)
    assert (on.release_after_pull, off.release_after_pull) == (True, False)
    offer = Offer(request_id="r", grant_id="a" * 32, block_ids=((1, 2),), prompt_len=20, prompt_digest="d" * 64)
    said = [released_after_pull(producer_params(offer, address="127.0.0.1:1", engine_id="e", lease_s=30.0,
                                                released_after_pull=flag)) for flag in (True, False)]
    assert said == [True, False]
    assert not released_after_pull(None) and not released_after_pull({"remote_released_after_pull": "yes"})
    with pytest.raises(ValueError, match=r"release_after_pull.*true or false.*'no'"):
        KpoolPdSettings.from_extra_config({"listen": "127.0.0.1:1", "release_after_pull": "no"}, producer=True)
