"""The Handshake under attack and under neglect, against a real prefill process (UCX on): junk UCX
worker addresses sent with a raw stub never take the process down and never touch a working decode
engine's state; a decode engine that died is forgotten, a live one is kept (its keep-alive) and a
forgotten one handshakes again; layout, model and UCX refusals are logged; a connection reset during
a pull is a warning, not an unexpected error; UCX starts without a warning about its options."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, TlsConfig, Transport
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.compat import model_differences
from kpool_pd.connector.prefill.decode_engines import FORGET_AFTER_FAILED_SEND_LEASES, FORGET_AFTER_LEASES
from kpool_pd.connector.shared.ucx import ucx_available
from kpool_pd.connector.shared.wire import layout_message
from kpool_pd.kvcache import BlockLayout, NodeCache
from tests.support import connector_procs as procs
from tests.support import handshake_procs as hp
from tests.support.connector_harness import InProcessPair, run_child
from tests.support.deadlines import patient
from tests.support.paths import REPO
from tests.support.polling import wait_for
from tests.support.pulls import pull_into

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
LEASE_S = 2.0
OTHER_LAYOUT = layout_message(BlockLayout(procs.make_config("kpool-2heads")))


@pytest.fixture
def nodes():
    """Every process a test starts, killed at teardown."""
    started = []
    yield started
    for node in started:
        node.kill()


def test_junk_worker_addresses_leave_the_prefill_serving(tmp_path, nodes):
    prefill = hp.LoggedPrefill(tmp_path / "prefill.log", lease_s=LEASE_S)
    nodes.append(prefill)
    real = hp.WaitingDecode(prefill.address, LEASE_S)
    nodes.append(real)
    junk = hp.junk_addresses(real.ucx_address, 51, seed=3)
    began = time.monotonic()
    answers = [(kind, *hp.handshake_as(prefill.address, f"attacker-{i}", address))
               for i, (kind, address) in enumerate(junk)]
    seconds = time.monotonic() - began
    assert prefill.proc.is_alive(), f"the prefill process died ({prefill.proc.exitcode}) after {answers}"
    for kind, code, details in answers:
        if kind in ("random", "truncated"):
            assert code == "INVALID_ARGUMENT" and "ucx_worker_address refused" in details, (kind, code, details)
        else:  # a changed byte may leave an address that still reaches the real worker
            assert code in ("OK", "INVALID_ARGUMENT", "UNAVAILABLE"), (kind, code, details)
    assert seconds < 60, f"51 refused handshakes took {seconds:.1f} s"
    # the node still serves the real decode node byte for byte, and a new one too
    out = real.go()
    assert out["errors"] == [] and out["differences"] == [] and out["ok"] == list(hp.PULL_LENGTHS), out
    fresh = hp.WaitingDecode(prefill.address, LEASE_S, engine_id="decode-fresh")
    nodes.append(fresh)
    out = fresh.go()
    assert out["errors"] == [] and out["differences"] == [] and out["ok"] == list(hp.PULL_LENGTHS), out
    assert prefill.ask("counts") == (prefill.free_blocks, prefill.free_rings, 0) or wait_for(
        lambda: prefill.ask("counts") == (prefill.free_blocks, prefill.free_rings, 0), 3 * LEASE_S)
    log = prefill.log()
    assert "handshake of engine 'attacker-0' refused (INVALID_ARGUMENT): ucx_worker_address refused" in log
    assert "Unexpected" not in log and "Traceback" not in log


def test_an_impersonating_handshake_is_refused_and_the_victim_keeps_pulling_byte_for_byte(tmp_path, nodes):
    """A peer-token holder who claims a working engine's id (with its own working UCX worker, or offering the
    gRPC stream only) is refused PERMISSION_DENIED, as are its Prefill, Pull, Release and Heartbeat under that
    id; the victim's record keeps its worker address and every pull of the victim lands in the victim."""
    prefill = hp.LoggedPrefill(tmp_path / "prefill.log", lease_s=LEASE_S)
    nodes.append(prefill)
    victim = hp.WaitingDecode(prefill.address, LEASE_S, engine_id="decode-victim")
    attacker = hp.WaitingDecode(prefill.address, LEASE_S, engine_id="decode-attacker")  # a real worker, reachable
    nodes += [victim, attacker]
    before = prefill.ask("peers")
    assert prefill.ask("address", victim.engine_id) == victim.ucx_address
    claims = {
        "the attacker's own worker": dict(ucx_worker_address=attacker.ucx_address),
        "gRPC stream only": dict(ucx_worker_address=b"", transports=(pb.TRANSPORT_GRPC_STREAM,)),
        "a guessed secret": dict(ucx_worker_address=attacker.ucx_address, engine_secret=os.urandom(32)),
    }
    for what, fields in claims.items():
        got, details = hp.handshake_as(prefill.address, victim.engine_id, **fields)
        assert got == "PERMISSION_DENIED" and "engine secret" in details, (what, got, details)
        assert prefill.ask("peers") == before, f"{what} changed the prefill node's peers"
        assert prefill.ask("address", victim.engine_id) == victim.ucx_address, f"{what} moved the victim's link"
    calls = {
        "Prefill": pb.PrefillRequest(request_id="stolen", prompt_token_ids=[1, 2, 3], engine_id=victim.engine_id),
        "Pull": pb.PullRequest(grant_id="g" * 32, engine_id=victim.engine_id, transport=pb.TRANSPORT_UCX, ucx_tag_base=5),
        "Release": pb.ReleaseRequest(grant_id="g" * 32, engine_id=victim.engine_id),
        "Heartbeat": pb.HeartbeatRequest(engine_id=victim.engine_id),
    }
    for method, request in calls.items():
        got, details = hp.call_as(prefill.address, method, request)
        assert got == "PERMISSION_DENIED" and "engine secret" in details, (method, got, details)
    assert prefill.ask("counts") == (prefill.free_blocks, prefill.free_rings, 0)  # no grant was made for the attacker
    out = victim.go()
    assert out["errors"] == [] and out["differences"] == [] and out["ok"] == list(hp.PULL_LENGTHS), out
    assert prefill.ask("address", victim.engine_id) == victim.ucx_address
    assert f"handshake of engine '{victim.engine_id}' refused (PERMISSION_DENIED)" in prefill.log()


def test_an_engine_handshakes_again_with_its_secret_and_a_second_claimant_cannot():
    """The router's way back after a failed pull: the same engine handshakes on a new channel, presenting its
    secret, and pulls; another connector under the same engine id (another process guessing it) is refused
    and the engine keeps its secret, its record and its pulls. A secret the node hands out again after it
    forgot the engine replaces the old one on the decode side."""
    async def main():
        async with InProcessPair(transports=(Transport.GRPC_STREAM,)) as pair:
            first = await pair.decode.connect(pair.address)
            secret = pair.decode.secrets.get(pair.address)
            assert len(secret) == 32 and pair.prefill.engines.get("decode-t").secret == secret
            await pair.decode.disconnect(first)
            again = await pair.decode.connect(pair.address)  # a new channel, the same engine
            assert pair.decode.secrets.get(pair.address) == secret
            impostor = await DecodeConnector(pair.decode.pool, engine_id="decode-t", config=pair.decode.config,
                                             registry=CollectorRegistry(), transports=(Transport.GRPC_STREAM,)).start()
            with pytest.raises(StatusError) as err:
                await impostor.connect(pair.address)
            assert err.value.code is grpc.StatusCode.PERMISSION_DENIED and "engine secret" in err.value.message
            await impostor.close()
            grant = await again.prefill("mine", [2] * 100)
            with await pull_into(pair.d_cache, again, grant, transport=Transport.GRPC_STREAM) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "mine", 100)[0]
            pair.prefill.engines.forget("decode-t", "test")
            await again.keep_alive.beat()  # told it is unknown: handshakes again, presenting its own secret
            assert pair.prefill.engines.get("decode-t").secret == pair.decode.secrets.get(pair.address) == secret
            grant = await again.prefill("after", [3] * 70)
            with await pull_into(pair.d_cache, again, grant, transport=Transport.GRPC_STREAM) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "after", 70)[0]
    asyncio.run(asyncio.wait_for(main(), 60))


def test_failed_handshakes_under_a_working_engine_id_change_nothing(tmp_path, nodes):
    prefill = hp.LoggedPrefill(tmp_path / "prefill.log", lease_s=LEASE_S)
    nodes.append(prefill)
    gone = hp.WaitingDecode(prefill.address, LEASE_S, engine_id="decode-gone")
    nodes.append(gone)
    gone.kill()  # its worker address is well formed, and nothing answers there any more
    real = hp.WaitingDecode(prefill.address, LEASE_S)
    nodes.append(real)
    before = prefill.ask("peers")
    assert real.engine_id in before[0] and real.engine_id in before[1]
    attacks = {  # under a held id without its secret, each is refused before it is looked at
        "address of a dead worker": (dict(ucx_worker_address=gone.ucx_address), "PERMISSION_DENIED"),
        "truncated address": (dict(ucx_worker_address=real.ucx_address[:30]), "PERMISSION_DENIED"),
        "no address": (dict(ucx_worker_address=b""), "PERMISSION_DENIED"),
        "other layout": (dict(ucx_worker_address=gone.ucx_address, layout=OTHER_LAYOUT), "PERMISSION_DENIED"),
        "other model": (dict(ucx_worker_address=gone.ucx_address, model_identity='{"seed":9}'), "PERMISSION_DENIED"),
        "random bytes": (dict(ucx_worker_address=os.urandom(1024)), "PERMISSION_DENIED"),
    }
    for what, (fields, code) in attacks.items():
        got, details = hp.handshake_as(prefill.address, real.engine_id, **fields)
        assert got == code, (what, got, details)
        assert prefill.ask("peers") == before, f"{what} changed the prefill node's peers"
    out = real.go()
    assert out["errors"] == [] and out["differences"] == [] and out["ok"] == list(hp.PULL_LENGTHS), out
    assert f"handshake of engine '{real.engine_id}' refused (PERMISSION_DENIED)" in prefill.log()


def test_a_dead_decode_engine_is_forgotten_and_a_live_one_kept(tmp_path, nodes):
    lease_s = 0.5
    prefill = hp.LoggedPrefill(tmp_path / "prefill.log", lease_s=lease_s)
    nodes.append(prefill)
    live = hp.WaitingDecode(prefill.address, lease_s, engine_id="decode-live")
    dead = hp.WaitingDecode(prefill.address, lease_s, engine_id="decode-dead")
    nodes += [live, dead]
    assert prefill.ask("peers") == (["decode-dead", "decode-live"], ["decode-dead", "decode-live"])
    dead.kill()
    assert wait_for(lambda: "decode-dead" not in prefill.ask("peers")[0], FORGET_AFTER_LEASES * lease_s + 10)
    # forgotten for its silence since its last call, which a loaded machine may have delayed before the kill
    forgotten = re.search(r"forgetting decode engine decode-dead \(not heard from for ([0-9.]+) s", prefill.log())
    assert forgotten and float(forgotten.group(1)) >= FORGET_AFTER_LEASES * lease_s, prefill.log()[-2000:]
    time.sleep(FORGET_AFTER_LEASES * lease_s + 1)  # a whole silence horizon: the live one heartbeats
    assert prefill.ask("peers") == (["decode-live"], ["decode-live"])
    out = live.go()
    assert out["errors"] == [] and out["differences"] == [] and out["ok"] == list(hp.PULL_LENGTHS), out


def test_a_forgotten_engine_handshakes_again_and_pulls():
    lease_s = 0.5

    async def main():
        config = ConnectorConfig(peer_token=procs.TOKEN, lease_s=lease_s, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))
        async with InProcessPair(config=config, transports=(Transport.UCX,)) as pair:
            peer = await pair.decode.connect(pair.address)
            engine, node = pair.decode.engine_id, pair.prefill
            now = time.monotonic()
            assert node.engines.forget_silent(now + (FORGET_AFTER_LEASES - 1) * lease_s) == []
            assert node.engines.forget_silent(now + FORGET_AFTER_LEASES * lease_s + 0.1) == [engine]
            assert engine not in node.engines
            deadline = time.monotonic() + patient(5 * lease_s)
            while engine not in node.engines:  # the keep-alive finds out and handshakes again
                assert time.monotonic() < deadline, "the decode engine did not handshake again"
                await asyncio.sleep(0.05)
            grant = await peer.prefill("again", [3] * 150)
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.UCX) as landed:
                layout = pair.decode.pool.layout
                assert all(torch.equal(pair.decode.pool.blocks[b], procs.expected_block(layout, "again", j))
                           for j, b in enumerate(landed.block_ids))
            # after a failed send, a shorter silence is enough
            node.engines.get(engine).link.send_failed_at = time.monotonic()
            now = time.monotonic()
            assert node.engines.forget_silent(now + (FORGET_AFTER_FAILED_SEND_LEASES - 1) * lease_s) == []
            assert node.engines.forget_silent(now + FORGET_AFTER_FAILED_SEND_LEASES * lease_s + 0.1) == [engine]
    asyncio.run(main())


def test_refusals_are_logged_naming_the_engine_and_why(caplog):
    async def main():
        async with InProcessPair(decode_config=procs.make_config("kpool-2heads")) as pair:
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
        async with InProcessPair() as pair:
            pair.prefill.model_identity, pair.decode.model_identity = '{"seed":1}', '{"seed":2}'
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "seed 1 vs 2" in err.value.message
    with caplog.at_level(logging.WARNING, logger="kpool_pd.connector.prefill"):
        asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if r.name.startswith("kpool_pd.connector.prefill.")]
    assert any(m.startswith("handshake of engine 'decode-t' refused (FAILED_PRECONDITION): cache layout differs")
               and "mla_num_heads" in m for m in refusals), refusals
    assert any("handshake of engine 'decode-t' refused (FAILED_PRECONDITION): model differs" in m
               and "seed 1 vs 2" in m for m in refusals), refusals


def test_the_decode_side_refuses_a_prefill_node_of_another_model(monkeypatch):
    from kpool_pd.connector.prefill import handshake

    monkeypatch.setattr(handshake, "model_differences", lambda ours, theirs: [])  # a prefill node that checks nothing

    async def main():
        async with InProcessPair() as pair:
            pair.prefill.model_identity, pair.decode.model_identity = '{"seed":1}', '{"seed":2}'
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            assert pair.decode.peers == ()
            return err.value
    err = asyncio.run(main())
    assert err.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "model differs (this engine vs prefill node prefill-t): seed 2 vs 1" in err.message, err.message


@pytest.mark.parametrize("ours,theirs,want", [
    ('{"a":1,"seed":1}', '{"a":1,"seed":1}', []),
    ('{"a":1,"seed":1}', '{"a":1,"seed":2}', ["seed 1 vs 2"]),
    ('{"seed":1}', '{"seed":1,"topk":8}', ["topk (none) vs 8"]),
    ("", "", []),
    ('{"seed":1}', "", ["identity '{\"seed\":1}' vs (none)"]),
    ("abc", "abd", ["identity 'abc' vs 'abd'"]),
], ids=["equal", "seed", "missing-field", "both-empty", "one-empty", "opaque"])
def test_model_differences(ours, theirs, want):
    assert model_differences(ours, theirs) == want


def test_model_identity_covers_every_field():
    import dataclasses

    from kpool_pd.kvcache import BlockOrder, CacheDtype, CacheFamily, PoolMode
    from kpool_pd.model import ModelConfig

    import inspect

    base = ModelConfig.build(num_spec=3)
    changed = {"family": CacheFamily.QSA, "num_layers": 3, "kpool": 2, "compress_ratio": 8, "num_spec": 1, "block_size": 128,
               "seed": 1, "vocab_size": 512, "index_heads": 2, "topk": 4, "mla_entry_bytes": 64,
               "pool_mode": next(m for m in PoolMode if m is not base.cache.pool_mode),
               "qsa_dtype": next(d for d in CacheDtype if d is not base.cache.qsa_dtype), "kernel_page_states": 32,
               "round_scale": False, "block_order": BlockOrder.BLHNC, "cache_rope_positions": True}
    assert set(changed) == set(inspect.signature(ModelConfig.build).parameters)
    assert {f.name for f in dataclasses.fields(ModelConfig)} - {"cache"} < set(changed)
    arranging = {"block_size", "kernel_page_states", "block_order"}  # arrange the cache's bytes only: peers may differ in them
    for name, value in changed.items():
        other = ModelConfig.build(**{"num_spec": 3, name: value})
        assert (other.identity() == base.identity()) is (name in arranging), name
        ours, theirs = json.loads(base.identity()), json.loads(other.identity())
        assert other.identity() == json.dumps(theirs, sort_keys=True, separators=(",", ":")), name  # canonical
        assert ours.keys() == theirs.keys(), name
        assert [k for k in ours if ours[k] != theirs[k]] == ([] if name in arranging else [k for k in ours if k in (
            name, name.removeprefix("num_"))]), name  # the one field changed, under its name in the identity
    assert model_differences(base.identity(), dataclasses.replace(base, seed=2).identity()) == ["seed 0 vs 2"]


def test_a_connection_reset_during_a_pull_is_a_warning(tmp_path, nodes, monkeypatch):
    # Sends that wait on a receiver that posted nothing and died: the rendezvous (a large region's
    # protocol). The connector sends host-memory regions up to 4 MiB eagerly (UCX_HOST_MEMORY), which
    # complete without the receiver; the operator's variable (inherited by the processes) restores it.
    monkeypatch.setenv("UCX_RNDV_THRESH", "8K")
    prefill = hp.LoggedPrefill(tmp_path / "prefill.log", lease_s=LEASE_S)
    nodes.append(prefill)
    messages, code = run_child(procs.decode_main, address=prefill.address, transport="ucx", scenario="decode_dies",
                               lease_s=LEASE_S)
    assert messages == [{"dying": True}] and code == 17
    assert wait_for(lambda: "pull of grant" in prefill.log() and "ended before its last byte" in prefill.log(), 20)
    log = prefill.log()
    assert "Unexpected" not in log and "Traceback" not in log, log[-3000:]
    assert "engine decode-decode_dies" in log or "to decode-decode_dies" in log, log[-3000:]
    assert prefill.proc.is_alive()


def test_ucx_starts_without_a_warning_about_its_options():
    code = ("import asyncio, os\n"
            "from kpool_pd.connector.shared.ucx import UcxNode\n"
            "async def main():\n"
            "    node = UcxNode((('TLS', '^posix,sysv,cma,xpmem,knem'),))\n"
            "    print('TRANSPORTS', sorted(node.active_transports()), os.environ['UCX_MEMTYPE_CACHE'], flush=True)\n"
            "asyncio.run(main()); os._exit(0)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.run([sys.executable, "-c", code], env=clean, cwd=REPO, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert "TRANSPORTS" in output and "n" == output.split("TRANSPORTS")[1].split()[-1], output
    assert "WARN" not in output and "unused environment variable" not in output, output


def test_tls_with_ucx_warns_that_the_cache_bytes_are_not_encrypted(caplog):
    async def main():
        cache = NodeCache(procs.CONFIG, num_blocks=4, num_rings=2)
        node = PrefillConnector(cache.pool, procs.SeededFillEngine(cache), engine_id="tls-ucx",
                                config=ConnectorConfig(tls=TlsConfig(cert_chain=b"pem", private_key=b"pem")),
                                registry=CollectorRegistry(), transports=(Transport.UCX,))
        await node.start()
        await node.stop()
    with caplog.at_level(logging.WARNING, logger="kpool_pd.connector.prefill"):
        asyncio.run(main())
    assert any("NOT encrypted" in r.getMessage() and "UCX" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("tls,transport,want", [(True, "ucx", False), (True, "grpc", True), (False, "ucx", False)],
                         ids=["tls-ucx", "tls-grpc", "plaintext-ucx"])
def test_the_summary_says_whether_the_cache_bytes_were_encrypted(tls, transport, want):
    from kpool_pd.report import summary, summary_text

    model = {"family": "kpool", "kpool": 4, "compress_ratio": 4, "num_spec": 3, "layers": 2, "block_size": 64}
    report = summary([], mode="pd", wall_s=1.0, model=model, transport=transport, tls=tls,
                     data_plane_encrypted=tls and transport == "grpc")
    assert report["tls"] is tls and report["data_plane_encrypted"] is want
    assert ("NOT encrypted" in summary_text(report)) is (tls and not want)


def test_the_probe_child_takes_the_crash_and_is_replaced():
    from kpool_pd.connector.prefill.ucx_probe import ProbeOutcome, UcxProbe

    async def main():
        probe = UcxProbe({"TLS": "^posix,sysv,cma,xpmem,knem"})
        try:
            crash = await probe.probe(b"\x04" + bytes(range(200)), 60)  # a version nibble UCX asserts on
            after = await probe.probe(b"\x20" + bytes(8) + b"\x00\x80", 60)  # v1, one empty device: no transport
            return crash, after, probe.starts
        finally:
            await probe.close()
    crash, after, starts = asyncio.run(main())
    assert crash.outcome is ProbeOutcome.CRASHED and "SIGABRT" in crash.detail, crash
    assert after.outcome is ProbeOutcome.UNREACHABLE and starts == 2, (after, starts)
