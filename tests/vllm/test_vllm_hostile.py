"""Hostile clients against a vLLM PD deployment: a producer and a consumer ``vllm serve`` (KpoolPdConnector over
the gRPC stream, the model with a sliding-window layer and a full-attention one: two KV cache groups, prefix caching on
as vLLM's default has it, the consumer with ``--middleware kpool_pd.vllm.KvTransferParamsGuard`` and
``kv_load_failure_policy`` "recompute") and ``kpool-pd router`` in front, the clients reaching the router and
the consumer's own OpenAI endpoint. Each attack once, then all of them again mixed with good requests:

- bad ``remote_num_tokens`` (a string, null, Infinity, a list) get HTTP 400 naming the field; the engine lives;
- params naming a producer the consumer does not list are never dialed (a listener there sees no connection);
- one prompt's params sent with another prompt are refused before any byte lands (the prompt digests
  differ): the request is recomputed, and a later victim whose prompt starts with it gets its own answer;
- a grant the producer does not hold fails the load without killing the two-group engine;
- a grant the consumer will not pull (a request vLLM rejects before the engine) frees the producer's blocks at
  once, long before the lease; a prompt mostly in the consumer's prefix cache pulls only the blocks beyond the
  hit (both groups' and the ring), and frees them all on the producer;
- a request id of 300 characters, a 100,000-deep JSON body, a batch of prompts and beam search through the
  router: a good answer, or a 400 that marks no instance failed;
- a router whose decode instance cannot be reached releases the producer's grant at once.

Then 100 requests, 8 at a time, sharing heads (delta pulls) with every fifth abandoned mid-stream: the
producer holds no block afterwards.

Good requests equal the producer's own answer for the same prompt (the reference: it computes its prompts
itself), and afterwards both servers serve and the producer holds no block."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import secrets
import socket
import threading
import urllib.request

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from kpool_pd.bench import vllm_engines  # noqa: E402
from tests.support import vllm_servers  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.stopping import stop_servers  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

MAX_TOKENS = 8
LEASE_S = 600  # far longer than any wait below: a grant freed within RELEASED_S was released, not expired
RELEASED_S = 60  # a release reaching the producer and its next engine steps, on a loaded 2-core machine
WARM_UP_S = 600
GUARD = "kpool_pd.vllm.KvTransferParamsGuard"


class Listener:
    """A TCP listener that counts the connections made to it (a producer nobody should dial)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


class Deployment:
    def __init__(self, folder, model: str) -> None:
        token = {"KPOOLPD_PEER_TOKEN": secrets.token_hex(16)}
        listen = f"127.0.0.1:{free_port()}"
        connector = vllm_engines.kpool_transfer_config
        self.producer = vllm_servers.vllm_server("producer", model, free_port(), connector(
            "kv_producer", {"listen": listen, "lease_s": LEASE_S}), folder, prefix_caching=True, **token)
        self.consumer = vllm_servers.vllm_server("consumer", model, free_port(), connector(
            "kv_consumer", {"transport": "grpc", "producers": [listen]}, kv_load_failure_policy="recompute"),
            folder, prefix_caching=True, flags=("--middleware", GUARD), **token)
        self.router = vllm_servers.router_server(free_port(), [self.producer.url], [self.consumer.url], folder, **token)
        self.servers = [self.producer, self.consumer, self.router]
        self.folder, self.token = folder, token

    def start(self) -> None:
        for server in self.servers:
            server.wait_healthy()
        warm_up(self)

    def stop(self) -> None:
        stop_servers(self.servers)


# two servers and the router: 4.3 GiB at the file's peak with this process (2026-12-07)
vllm_memory = module_memory(3, "tests/vllm/test_vllm_hostile.py's servers")


@pytest.fixture(scope="module")
def deployment(vllm_memory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-hostile")
    model = str(vllm_engines.write_model(folder / "model", layers=vllm_engines.HYBRID_LAYERS))
    deployment = Deployment(folder, model)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def complete(server: vllm_servers.Server, tokens: list[int], params: dict | None = None, raw: bytes | None = None,
             headers: dict[str, str] | None = None, **extra) -> tuple[int, dict]:
    body = {"model": vllm_servers.SERVED_MODEL, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    status, answer = vllm_servers.post_raw(server.url + "/v1/completions", raw or json.dumps(body).encode(),
                                           headers=headers)
    try:
        return status, json.loads(answer)
    except ValueError:
        return status, {"raw": answer.decode(errors="replace")}


def tokens_of(answer: dict) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def reference(deployment: Deployment, tokens: list[int]) -> list[int]:
    """The producer's own answer: it computes the prompt itself."""
    status, answer = complete(deployment.producer, tokens)
    assert status == 200, answer
    return tokens_of(answer)


def prefill(deployment: Deployment, tokens: list[int], headers: dict[str, str] | None = None) -> dict:
    status, answer = complete(deployment.producer, tokens, {"do_remote_decode": True}, headers=headers, max_tokens=1)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(tokens), params
    return params


def pulled_tokens(consumer: vllm_servers.Server) -> float:
    return vllm_servers.prompt_tokens_by_source(consumer.metrics()).get("external_kv_transfer", 0.0)


def held_blocks(consumer: vllm_servers.Server) -> float:
    """Prompt blocks the consumer did not pull as its prefix cache held them (its KVConnectorStats)."""
    return vllm_servers.counter(consumer.metrics(), "vllm:kpool_pd_held_blocks_total")


def producer_holds_nothing(deployment: Deployment) -> bool:
    return vllm_servers.kv_cache_usage(deployment.producer.metrics()) == 0.0


def assert_freed(deployment: Deployment, what: str) -> None:
    assert wait_for(lambda: producer_holds_nothing(deployment), RELEASED_S, period_s=0.5), (
        f"the producer still holds blocks {RELEASED_S} s after {what} (its lease is {LEASE_S} s):\n"
        f"{deployment.producer.tail()}\n{deployment.consumer.tail()}")


def warm_up(deployment: Deployment) -> None:
    """Requests through the router until one was pulled (the consumer's first handshake done)."""
    def pulled() -> bool:
        before = pulled_tokens(deployment.consumer)
        status, _ = complete(deployment.router, prompt(1, 20))
        return status == 200 and pulled_tokens(deployment.consumer) > before
    assert wait_for(pulled, WARM_UP_S, period_s=1.0), f"no pull succeeded:\n{deployment.consumer.tail()}"


def good_request(deployment: Deployment, seed: int, length: int = 120) -> None:
    tokens = prompt(seed, length)
    status, answer = complete(deployment.router, tokens)
    assert status == 200, answer
    assert tokens_of(answer) == reference(deployment, tokens), f"{length}-token prompt {seed}"


# the attacks -----------------------------------------------------------------------------------------------
def bad_token_counts(deployment: Deployment, seed: int) -> None:
    tokens = prompt(seed, 40)
    params = prefill(deployment, tokens)
    body = json.dumps({"model": vllm_servers.SERVED_MODEL, "prompt": tokens, "max_tokens": MAX_TOKENS,
                       "kv_transfer_params": params | {"remote_num_tokens": "@BAD@"}})
    for bad in ('"abc"', "null", "Infinity", "[1]"):
        status, answer = complete(deployment.consumer, tokens, raw=body.replace('"@BAD@"', bad).encode())
        assert status == 400 and "remote_num_tokens" in json.dumps(answer), (bad, status, answer)
    assert deployment.consumer.healthy()
    status, answer = complete(deployment.consumer, tokens, params)  # the grant is still there: pulled now
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)


def unlisted_producer(deployment: Deployment, seed: int) -> None:
    tokens = prompt(seed, 60)
    params = prefill(deployment, tokens)
    fake = Listener()
    try:
        status, answer = complete(deployment.consumer, tokens, params | {"remote_address": fake.address})
        assert status == 200 and tokens_of(answer) == reference(deployment, tokens)  # recomputed
        status, answer = complete(deployment.consumer, tokens, params | {"remote_address": "unix:/tmp/kpoolpd.sock"})
        assert status == 400 and "remote_address" in json.dumps(answer)
        assert fake.accepted == 0, "the consumer dialed a producer it does not list"
    finally:
        fake.close()
    status, answer = complete(deployment.consumer, tokens, params)  # the real grant: pulled, so freed
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)


def another_prompts_params(deployment: Deployment, seed: int) -> None:
    first, second = prompt(seed, 150), prompt(seed + 1, 150)
    params = prefill(deployment, first)
    status, answer = complete(deployment.consumer, second, params)  # the second prompt under the first's KV
    assert status == 200 and tokens_of(answer) == reference(deployment, second)
    victim = second + prompt(seed + 2, 30)  # reads the second prompt's blocks from the consumer's cache
    status, answer = complete(deployment.router, victim)
    assert status == 200 and tokens_of(answer) == reference(deployment, victim)
    status, answer = complete(deployment.consumer, victim)
    assert status == 200 and tokens_of(answer) == reference(deployment, victim)
    status, answer = complete(deployment.router, [first, second])  # a batch through the router
    assert status == 400, answer


def unknown_grant(deployment: Deployment, seed: int) -> None:
    tokens = prompt(seed, 90)
    params = prefill(deployment, tokens)
    forged = params | {"remote_grant_id": secrets.token_hex(16)}
    status, answer = complete(deployment.consumer, tokens, forged)
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)
    assert deployment.consumer.healthy()
    status, answer = complete(deployment.consumer, tokens, params)
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)


def rejected_before_the_engine(deployment: Deployment, seed: int) -> None:
    tokens = prompt(seed, 300)
    params = prefill(deployment, tokens)
    assert not producer_holds_nothing(deployment)
    status, answer = complete(deployment.consumer, tokens, params, max_tokens=100_000)  # past the model: a 400
    assert status == 400, answer
    assert_freed(deployment, "a decode request vLLM rejected")


def consumer_prefix_hit(deployment: Deployment, seed: int) -> None:
    tokens = prompt(seed, 260)
    status, answer = complete(deployment.router, tokens)  # pulled: the consumer caches its blocks
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)
    assert_freed(deployment, "a pull")
    params = prefill(deployment, tokens)
    before, held_before = pulled_tokens(deployment.consumer), held_blocks(deployment.consumer)
    status, answer = complete(deployment.consumer, tokens, params)
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)
    pulled = pulled_tokens(deployment.consumer) - before
    assert 0 < pulled < len(tokens) / 2, f"{pulled} of the {len(tokens)} tokens pulled: the cached prefix again?"
    assert wait_for(lambda: held_blocks(deployment.consumer) > held_before, RELEASED_S, period_s=0.5), \
        "the consumer's stats count no held block"
    assert_freed(deployment, "a decode request that found most of its prompt in the consumer's prefix cache")


def router_edges(deployment: Deployment, seed: int) -> None:
    tokens = prompt(seed, 50)
    status, answer = complete(deployment.router, tokens, headers={"X-Request-Id": "r" * 300})
    assert status == 200 and tokens_of(answer) == reference(deployment, tokens)
    status, _ = complete(deployment.router, tokens, raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400
    status, _ = complete(deployment.router, tokens, use_beam_search=True)
    assert status == 400
    with urllib.request.urlopen(deployment.router.url + "/health", timeout=30) as answer:
        assert answer.status == 200


def unreachable_decode(deployment: Deployment, seed: int) -> None:
    """A router whose decode instance cannot be reached releases the producer's grant at once."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = vllm_servers.router_server(free_port(), [deployment.producer.url], [dead], deployment.folder,
                                        "--health-check-s", "0", name=f"router-dead-decode-{seed}", **deployment.token)
    try:
        router.wait_healthy()
        status, answer = complete(router, prompt(seed, 200))
        assert status == 502, answer
        assert_freed(deployment, "a prefill whose decode instance could not be reached")
    finally:
        router.stop()


ATTACKS = [bad_token_counts, unlisted_producer, another_prompts_params, unknown_grant, rejected_before_the_engine,
           consumer_prefix_hit, router_edges, unreachable_decode]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_each_attack(deployment, attack):
    attack(deployment, seed=1000 + ATTACKS.index(attack) * 10)
    assert deployment.consumer.healthy() and deployment.producer.healthy()


def test_a_mixed_run_leaves_both_serving_right_and_the_producer_holding_nothing(deployment):
    for index, attack in enumerate(ATTACKS):
        seed = 5000 + index * 10
        good_request(deployment, seed + 5, length=30 + index * 40)
        attack(deployment, seed)
    good_request(deployment, 9000)
    assert deployment.consumer.healthy() and deployment.producer.healthy()
    assert_freed(deployment, "the mixed run")


HUNDRED = 100
ABORT_EVERY = 5  # every fifth request's client goes away after the stream's first chunk
PREFIXES = 8  # shared prompt heads: most requests find blocks of theirs in the consumer's prefix cache


def abandoned_stream(deployment: Deployment, tokens: list[int]) -> None:
    """A streamed completion through the router whose client reads one chunk and hangs up."""
    host, port = deployment.router.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": vllm_servers.SERVED_MODEL, "prompt": tokens, "max_tokens": 64, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        response.readline()
    finally:
        connection.close()


def test_a_hundred_requests_with_prefix_hits_and_aborts_leave_the_producer_as_it_was(deployment):
    """100 requests through the router, 8 at a time: heads shared among them (prefix hits on the consumer:
    delta pulls), every fifth abandoned by its client mid-stream. Every answer read equals the producer's own,
    the consumer counts held blocks, and afterwards the producer holds no block (its usage as before: 0)."""
    assert_freed(deployment, "the earlier tests")
    rng = random.Random(77)
    heads = [prompt(7000 + i, rng.randrange(100, 220)) for i in range(PREFIXES)]
    prompts = [heads[i % PREFIXES] + prompt(8000 + i, rng.randrange(5, 40)) for i in range(HUNDRED)]
    held_before = held_blocks(deployment.consumer)

    def one(index: int) -> tuple[int, list[int] | None]:
        if index % ABORT_EVERY == ABORT_EVERY - 1:
            abandoned_stream(deployment, prompts[index])
            return index, None
        status, answer = complete(deployment.router, prompts[index])
        assert status == 200, answer
        return index, tokens_of(answer)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = dict(pool.map(one, range(HUNDRED)))
    checked = [i for i, tokens in answers.items() if tokens is not None][::4]  # a quarter against the producer
    for index in checked:
        assert answers[index] == reference(deployment, prompts[index]), index
    assert wait_for(lambda: held_blocks(deployment.consumer) > held_before, RELEASED_S, period_s=0.5), \
        "no request pulled less than its prompt: no prefix hit was used"
    assert_freed(deployment, "a hundred requests with prefix hits and aborts")
    assert deployment.consumer.healthy() and deployment.producer.healthy()
