"""The checked-in generated gRPC code is exactly what proto/generate.py makes from proto/, each
file's code in the package that uses it, and the wire facades (connector.prefill_api,
decode_worker.api) match the services and the connector's enums."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.deadlines import patient
from tests.support.paths import REPO

GENERATED = ("kpool_pd/connector/_generated", "kpool_pd/decode_worker/_generated")


def _generator():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated(out: Path) -> list[Path]:
    """The files ``python proto/generate.py --out OUT`` writes, as a user runs it: in a process of its own. protoc
    runs in the process that calls it, and in a test worker that had run a fifth of the suite it ended the worker with
    no message (2026-12-07, the README's test command, "worker 'gw0' crashed while running" this test, at 22%; an
    earlier crash came at the same point and went unnamed). It did not come back in a fresh process."""
    done = subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(out)], capture_output=True,
                          text=True, timeout=patient(120))
    assert done.returncode == 0, f"proto/generate.py exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return [Path(line) for line in done.stdout.splitlines()]


def test_generated_code_is_fresh(tmp_path):
    written = _generated(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in written}
    committed = {p.relative_to(REPO): p.read_bytes() for package in GENERATED for p in (REPO / package).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run python proto/generate.py"
    stale = [str(k) for k in fresh if fresh[k] != committed[k]]
    assert not stale, f"stale generated files {stale}: run python proto/generate.py"


def test_each_proto_file_goes_to_the_package_that_uses_it(tmp_path):
    written = {p.relative_to(tmp_path).as_posix() for p in _generated(tmp_path)}
    assert "kpool_pd/connector/_generated/kpoolpd/v1/prefill_pb2_grpc.py" in written
    assert "kpool_pd/decode_worker/_generated/kpoolpd/v1/generate_pb2_grpc.py" in written
    assert not any("generate_pb2" in p for p in written if p.startswith("kpool_pd/connector/"))
    assert not any("prefill_pb2" in p for p in written if p.startswith("kpool_pd/decode_worker/"))


def test_a_proto_file_without_a_package_is_refused(tmp_path, monkeypatch):
    generator = _generator()
    monkeypatch.setattr(generator, "PROTO_DIR", tmp_path)
    (tmp_path / "kpoolpd" / "v1").mkdir(parents=True)
    (tmp_path / "kpoolpd" / "v1" / "stray.proto").write_text('syntax = "proto3";\n')
    with pytest.raises(ValueError, match="stray.proto"):
        generator.proto_files()


def test_prefill_service_and_enums_match_the_connector():
    from kpool_pd.connector import PrefillConnector, Transport
    from kpool_pd.connector import prefill_api as pb
    from kpool_pd.connector.shared.plan import PoolKind

    assert [m.name for m in pb.SERVICE_DESCRIPTOR.methods] == ["Handshake", "Prefill", "Pull", "PullSession",
                                                               "PrefillPush", "PackedPull", "AwaitOffers", "Release",
                                                               "Heartbeat"]
    assert PrefillConnector.service_name == pb.SERVICE_NAME == "kpoolpd.v1.PrefillService"
    assert {k.name: k.value for k in PoolKind} == {"BLOCKS": pb.POOL_KIND_BLOCKS, "RINGS": pb.POOL_KIND_RINGS}
    assert {t.value for t in Transport} == {pb.TRANSPORT_UCX, pb.TRANSPORT_GRPC_STREAM}


def test_prefill_request_carries_the_prompt_the_asking_engine_pipelining_and_its_dcp_ranks_only():
    from kpool_pd.connector import prefill_api as pb

    fields = pb.PrefillRequest.DESCRIPTOR.fields_by_name
    assert sorted(fields) == ["dcp_engine_ids", "dcp_interleave", "engine_id", "engine_secret", "mrope_positions",
                              "pipelined", "prompt_token_ids", "request_id"]
    assert 3 not in pb.PrefillRequest.DESCRIPTOR.fields_by_number
    assert fields["pipelined"].number == 5  # new fields take new numbers; older peers ignore them
    assert (fields["dcp_engine_ids"].number, fields["dcp_interleave"].number) == (6, 7)
    assert fields["mrope_positions"].number == 9  # the prompt's MRoPE positions, 3 int64 a token (empty: text)
    assert pb.PullResponse.DESCRIPTOR.fields_by_name["prefilled"].number == 4
    # every call naming a decode engine presents its secret, which the Handshake returns
    for message in (pb.HandshakeRequest, pb.HandshakeResponse, pb.PrefillRequest, pb.PullRequest, pb.ReleaseRequest,
                    pb.HeartbeatRequest):
        assert message.DESCRIPTOR.fields_by_name["engine_secret"].type == message.DESCRIPTOR.fields_by_name[
            "engine_secret"].TYPE_BYTES, message


def test_generate_service_is_the_decode_workers():
    from kpool_pd.decode_worker import api
    from kpool_pd.decode_worker.service import GenerateService

    assert [m.name for m in api.SERVICE_DESCRIPTOR.methods] == ["Generate", "ModelInfo"]
    assert GenerateService.service_name == api.SERVICE_NAME == "kpoolpd.v1.GenerateService"
    assert issubclass(GenerateService, api.GenerateServiceServicer)
