"""The checked-in generated gRPC code is exactly what proto/generate.py makes from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path):
    written = _generator().generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in written}
    package = ROOT / "connector" / "_generated"
    committed = {p.relative_to(ROOT): p.read_bytes() for p in package.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run python proto/generate.py"
    stale = [str(k) for k in fresh if fresh[k] != committed[k]]
    assert not stale, f"stale generated files {stale}: run python proto/generate.py"


def test_service_and_enums_match_the_connector():
    from connector._generated.kpoolpd.v1 import prefill_pb2 as pb
    from connector.plan import PoolKind
    from connector.wire import Transport

    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["PrefillService"].methods]
    assert methods == ["Handshake", "Prefill", "Pull", "Release", "Heartbeat"]
    assert {k.name: k.value for k in PoolKind} == {"BLOCKS": pb.POOL_KIND_BLOCKS, "RINGS": pb.POOL_KIND_RINGS}
    assert {t.value for t in Transport} == {pb.TRANSPORT_UCX, pb.TRANSPORT_GRPC_STREAM}
