"""`kpool-pd router` over a fleet: prompts' block-aligned prefix hashes, the bounded prefix table, the choice
by outstanding tokens (prefill) and requests (decode), prefix affinity and its margin, instances found
through a DNS name that is re-resolved while the router runs, and each instance's /metrics."""

from __future__ import annotations

import asyncio
import collections
import contextlib

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from aiohttp.test_utils import TestServer  # noqa: E402

from kpool_pd.router.app import build_app, serving as router_serving  # noqa: E402
from kpool_pd.router.instances import InstancePool, Role  # noqa: E402
from kpool_pd.router.prefix import CHARS_PER_TOKEN, PrefixTable, PromptShape, prompt_shape  # noqa: E402
from kpool_pd.router.settings import RouterSettings  # noqa: E402
from tests.support.polling import until  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.router_fakes import FakeInstance, ReleaseRecorder, as_json, metric_lines, post, routed  # noqa: E402

DEADLINE_S = 60.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def ids_prompt(head: int, tail: int, length: int) -> dict:
    """A prompt of ``length`` token ids: a shared head of ``head`` ids (seeded by ``head``'s value), then ``tail``."""
    return {"model": "m", "prompt": [head * 1000 + i for i in range(length - 8)] + [tail] * 8, "max_tokens": 4}


def test_prefix_hashes_chain_whole_blocks_so_shared_heads_share_hashes():
    a = prompt_shape(ids_prompt(1, 7, 70), block_tokens=16)
    b = prompt_shape(ids_prompt(1, 9, 70), block_tokens=16)
    other = prompt_shape(ids_prompt(2, 7, 70), block_tokens=16)
    assert (a.prompt_tokens, a.output_tokens, a.total_tokens) == (70, 4, 74)
    assert len(a.prefix_hashes) == 4  # 70 // 16 whole blocks
    assert a.prefix_hashes[:3] == b.prefix_hashes[:3] and a.prefix_hashes[3] != b.prefix_hashes[3]  # tails differ
    assert not set(a.prefix_hashes) & set(other.prefix_hashes)
    text = prompt_shape({"prompt": "x" * (CHARS_PER_TOKEN * 16 * 2 + 3)}, block_tokens=16)
    assert len(text.prefix_hashes) == 2 and text.prompt_tokens == 16 * 2 + 1
    chat = prompt_shape({"messages": [{"role": "user", "content": "y" * 500}], "max_completion_tokens": 9}, 16)
    assert chat.output_tokens == 9 and len(chat.prefix_hashes) == len('[{"content":"' + "y" * 500) // 64
    assert prompt_shape({"prompt": [1, 2, 3]}, 16).prefix_hashes == ()  # no whole block
    with pytest.raises(ValueError, match="block_tokens"):
        prompt_shape({"prompt": [1]}, 0)


def test_the_prefix_table_finds_the_longest_prefix_and_forgets_the_least_recently_used():
    table = PrefixTable(capacity=5)
    short, long = prompt_shape(ids_prompt(1, 0, 40), 16).prefix_hashes, prompt_shape(ids_prompt(1, 5, 72), 16).prefix_hashes
    table.record(short, "http://a")  # 2 blocks
    table.record(long, "http://b")  # 4 blocks, the first 2 shared: b now serves them too
    assert table.match(long) == ("http://b", 4) and table.match(short) == ("http://b", 2)
    assert table.match(prompt_shape(ids_prompt(3, 0, 40), 16).prefix_hashes) == (None, 0)
    table.record(prompt_shape(ids_prompt(4, 0, 40), 16).prefix_hashes, "http://c")
    assert len(table) == 5  # 4 + 2 = 6 hashes: the least recently used one went
    with pytest.raises(ValueError, match="capacity"):
        PrefixTable(0)


def test_prefill_is_chosen_by_outstanding_tokens_and_decode_by_outstanding_requests():
    prefill = InstancePool(Role.PREFILL, ("http://a", "http://b"), cooldown_s=10)
    a, b = prefill.instances
    with prefill.outstanding(a, 4000), prefill.outstanding(b, 100), prefill.outstanding(b, 100):
        assert prefill.choose(shape=PromptShape(50)) is b  # more requests, fewer tokens
    decode = InstancePool(Role.DECODE, ("http://a", "http://b"), cooldown_s=10)
    a, b = decode.instances
    with decode.outstanding(a, 4000), decode.outstanding(b, 100), decode.outstanding(b, 100):
        assert decode.choose(shape=PromptShape(50)) is a  # fewer requests
    with decode.outstanding(a, 4000), decode.outstanding(b, 100):
        assert decode.choose(shape=PromptShape(50)) is b  # as many requests, fewer tokens


def test_a_prompt_goes_where_its_prefix_went_unless_that_instance_is_loaded_past_the_margin():
    pool = InstancePool(Role.PREFILL, ("http://a", "http://b", "http://c"), cooldown_s=10,
                        prefix=PrefixTable(1000), affinity_margin_tokens=1000)
    first = pool.choose(shape=prompt_shape(ids_prompt(1, 0, 200), 16))
    with pool.outstanding(first, 600):  # within the margin: the same prefix still goes there
        assert pool.choose(shape=prompt_shape(ids_prompt(1, 1, 200), 16)) is first
        assert pool.choose(shape=prompt_shape(ids_prompt(2, 1, 200), 16)) is not first  # another prefix: by load
    with pool.outstanding(first, 1500):  # past it: the least loaded, which now holds the prefix
        moved = pool.choose(shape=prompt_shape(ids_prompt(1, 2, 200), 16))
        assert moved is not first
    assert pool.choose(shape=prompt_shape(ids_prompt(1, 3, 200), 16)) is moved
    assert first.affinity_picks == 1 and moved.affinity_picks == 1
    pool.failed(moved, "HTTP 500")  # not UP: by load
    assert pool.choose(shape=prompt_shape(ids_prompt(1, 4, 200), 16)) is not moved


def test_requests_sharing_a_prefix_reach_one_prefill_instance_through_the_router():
    async def scenario():
        fakes = [FakeInstance(f"p{i}") for i in range(3)] + [FakeInstance("d0"), FakeInstance("d1")]
        async with contextlib.AsyncExitStack() as stack:
            for fake in fakes:
                server = await stack.enter_async_context(TestServer(fake.app(), host="127.0.0.1"))
                fake.url = str(server.make_url("")).rstrip("/")
            prefills, decodes = fakes[:3], fakes[3:]
            async with routed([f.url for f in prefills], [f.url for f in decodes]) as (client, base):
                for head in range(3):
                    for tail in range(4):
                        status, raw = await post(client, base + "/v1/completions", ids_prompt(head, tail, 100))
                        assert status == 200, raw
                lines = await metric_lines(client, base)
        served = collections.defaultdict(set)
        for fake in prefills:
            for sent in fake.sent:
                served[sent.body["prompt"][0] // 1000].add(fake.name)
        assert all(len(names) == 1 for names in served.values()), served  # each head on one instance
        picks = {f.url: sum(1 for line in lines if line.startswith("kpoolpd_router_instance_picks_total")
                            and f'instance="{f.url}"' in line and line.endswith(f" {float(len(f.sent))}"))
                 for f in fakes}
        assert all(count == 1 for count in picks.values()), (picks, lines)
        assert sum(len(f.sent) for f in prefills) == 12
        affinity = sum(float(line.split()[-1]) for line in lines
                       if line.startswith('kpoolpd_router_instance_affinity_picks_total{instance="http://127.0.0.1')
                       and 'role="prefill"' in line)
        assert affinity == 9  # every request but each head's first
        assert any(line.startswith("kpoolpd_router_outstanding_tokens{") for line in lines)
    run(scenario())


def test_instances_behind_a_dns_name_join_and_leave_while_the_router_runs():
    async def scenario():
        port = free_port()
        names = {"127.0.0.2": FakeInstance("p-a"), "127.0.0.3": FakeInstance("p-b")}
        answer = ["127.0.0.2"]

        async def resolver(host: str, wanted: int) -> list[str]:
            assert (host, wanted) == ("prefill.fleet.svc", port)
            return list(answer)

        async with contextlib.AsyncExitStack() as stack:
            for address, fake in names.items():
                await stack.enter_async_context(TestServer(fake.app(), host=address, port=port))
            decode = FakeInstance("d0")
            server = await stack.enter_async_context(TestServer(decode.app(), host="127.0.0.1"))
            decode.url = str(server.make_url("")).rstrip("/")
            settings = RouterSettings(prefill=(f"dns:///prefill.fleet.svc:{port}",), decode=(decode.url,), port=0,
                                      health_check_s=0, discovery_s=0.1)
            app = build_app(settings, release_grant=ReleaseRecorder(), resolver=resolver)
            async with router_serving(settings, app) as base, aiohttp.ClientSession() as client:
                for tail in range(3):
                    status, raw = await post(client, base + "/v1/completions", ids_prompt(tail, tail, 40))
                    assert status == 200, raw
                assert (len(names["127.0.0.2"].sent), len(names["127.0.0.3"].sent)) == (3, 0)

                answer.append("127.0.0.3")  # a pod joins the headless Service

                async def both_listed() -> bool:
                    async with client.get(base + "/health") as reply:
                        return len((await reply.json())["instances"]) == 3
                await until(both_listed, "the joining pod listed", 30)
                for tail in range(3, 9):
                    assert (await post(client, base + "/v1/completions", ids_prompt(tail, tail, 40)))[0] == 200
                assert len(names["127.0.0.3"].sent) > 0

                answer.remove("127.0.0.2")  # and the first one leaves

                async def one_listed() -> bool:
                    async with client.get(base + "/health") as reply:
                        return len((await reply.json())["instances"]) == 2
                await until(one_listed, "the leaving pod unlisted", 30)
                before = len(names["127.0.0.2"].sent)
                for tail in range(9, 13):
                    assert (await post(client, base + "/v1/completions", ids_prompt(tail, tail, 40)))[0] == 200
                assert len(names["127.0.0.2"].sent) == before
                lines = await metric_lines(client, base)
        assert not [line for line in lines if "127.0.0.2" in line]  # gone from /metrics with the pool
        assert any(line.startswith("kpoolpd_router_instance_picks_total") and "127.0.0.3" in line for line in lines)
    run(scenario())


def test_a_dns_name_with_no_address_yet_is_named_in_the_502():
    async def scenario():
        async def resolver(host: str, port: int) -> list[str]:
            raise OSError("Name or service not known")
        decode = FakeInstance("d0")
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(TestServer(decode.app(), host="127.0.0.1"))
            decode.url = str(server.make_url("")).rstrip("/")
            settings = RouterSettings(prefill=("dns:///nowhere.svc:8100",), decode=(decode.url,), port=0,
                                      health_check_s=0)
            app = build_app(settings, release_grant=ReleaseRecorder(), resolver=resolver)
            async with router_serving(settings, app) as base, aiohttp.ClientSession() as client:
                status, raw = await post(client, base + "/v1/completions", ids_prompt(1, 1, 20))
        assert status == 502 and "no prefill instance is known" in as_json(raw)["error"]["message"]
    run(scenario())


def test_settings_refuse_a_bad_dns_target_and_bad_choice_settings():
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        RouterSettings(prefill=("dns:///nameonly",), decode=("http://d",))
    for field, value in (("prefix_block_tokens", 0), ("prefix_table_size", 0), ("affinity_margin_tokens", -1),
                         ("discovery_s", 0)):
        with pytest.raises(ValueError, match=field):
            RouterSettings(prefill=("http://p",), decode=("http://d",), **{field: value})
