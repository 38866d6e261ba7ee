"""The start-up check of the data plane's fabric (``kpool_pd.runtime.fabric_check``): UCX's resources read
from its context description, the rule per profile (RDMA transports, locked memory, CUDA
transports), this machine's UCX as the check sees it, the health gate's hold, and a daemon in the
rdma profile on a machine without RDMA: it starts, stays NOT_SERVING and says why."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kpool_pd.connector import open_channel, ucx_available
from kpool_pd.runtime.launch import start_prefill
from kpool_pd.runtime import LIVENESS_SERVICE, model_flags
from kpool_pd.runtime.fabric_check import (MIN_RDMA_MEMLOCK, Fabric, Resource, check_fabric, loaded_library, memlock_limit,
                                  parse_resources)
from kpool_pd.runtime.health_gate import HealthGate
from tests.support.polling import until

# What ucp_context_print_info prints on an RDMA node with GPUs (UCX 1.22 format).
RDMA_NODE_INFO = """#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  ib
#     component 3  :  cuda_cpy
#
#            md 0  :  component 0  self
#            md 1  :  component 1  tcp
#            md 2  :  component 2  mlx5_0
#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 2  dev 2  flags -- rc_mlx5/mlx5_0:1
#      resource 3  :  md 2  dev 2  flags -- dc_mlx5/mlx5_0:1
#      resource 4  :  md 2  dev 2  flags -- ud_verbs/mlx5_0:1
#      resource 5  :  md 3  dev 3  flags -- cuda_copy/cuda
#      resource 6  :  md 4  dev 4  flags -- cuda_ipc/cuda
#
"""
TCP_ONLY = (Resource("self", "memory"), Resource("tcp", "eth0"), Resource("tcp", "lo"))
RDMA_GPU = parse_resources(RDMA_NODE_INFO)
GPU_NO_RDMA = (*TCP_ONLY, Resource("cuda_copy", "cuda"), Resource("cuda_ipc", "cuda"))
MIB = 1 << 20


def test_resources_are_read_from_ucx_context_description():
    assert RDMA_GPU == (Resource("self", "memory"), Resource("tcp", "eth0"), Resource("rc_mlx5", "mlx5_0:1"),
                        Resource("dc_mlx5", "mlx5_0:1"), Resource("ud_verbs", "mlx5_0:1"),
                        Resource("cuda_copy", "cuda"), Resource("cuda_ipc", "cuda"))
    assert [r.rdma for r in RDMA_GPU] == [False, False, True, True, True, False, False]
    assert parse_resources("# UCP context\n#\n") == ()
    assert str(RDMA_GPU[2]) == "rc_mlx5/mlx5_0:1"


# (fabric, ucx, resources, device, memlock) -> the start of each problem, the start of each warning
CASES = {
    "any-tcp-only": (Fabric.ANY, True, TCP_ONLY, "cpu", 64 * 1024, [], []),
    "any-without-ucx": (Fabric.ANY, False, (), "cuda", 0, [], []),
    "rdma-ok-unlimited": (Fabric.RDMA, True, RDMA_GPU, "cuda", None, [], []),
    "rdma-ok-at-the-floor": (Fabric.RDMA, True, RDMA_GPU, "cuda", MIN_RDMA_MEMLOCK, [], []),
    "rdma-without-rdma-transport": (Fabric.RDMA, True, GPU_NO_RDMA, "cuda", None,
                                    ["fabric rdma: UCX has no RDMA transport"], []),
    "rdma-memlock-one-byte-short": (Fabric.RDMA, True, RDMA_GPU, "cuda", MIN_RDMA_MEMLOCK - 1,
                                    ["fabric rdma: the locked-memory limit"], []),
    "rdma-docker-default-memlock-and-tcp": (Fabric.RDMA, True, TCP_ONLY, "cpu", 64 * 1024,
                                            ["fabric rdma: UCX has no RDMA", "fabric rdma: the locked-memory"],
                                            ["fabric rdma with device cpu"]),
    "rdma-without-ucx": (Fabric.RDMA, False, (), "cuda", None, ["fabric rdma needs the UCX transport"],
                         ["fabric rdma: UCX is not offered"]),
    "rdma-without-cuda-copy": (Fabric.RDMA, True, RDMA_GPU[:5], "cuda", None, ["fabric rdma: UCX has no cuda_copy"],
                               ["fabric rdma: UCX has no cuda_ipc"]),
    "gpu-ok": (Fabric.GPU, True, GPU_NO_RDMA, "cuda", 64 * 1024, [], []),
    "gpu-without-cuda-ipc": (Fabric.GPU, True, (*TCP_ONLY, Resource("cuda_copy", "cuda")), "cuda", None, [],
                             ["fabric gpu: UCX has no cuda_ipc"]),
    "gpu-wheel-without-cuda": (Fabric.GPU, True, TCP_ONLY, "cuda", None, ["fabric gpu: UCX has no cuda_copy"],
                               ["fabric gpu: UCX has no cuda_ipc"]),
    "gpu-on-a-cpu-device": (Fabric.GPU, True, TCP_ONLY, "cpu", None, [], ["fabric gpu with device cpu"]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_rule_per_profile(case):
    fabric, ucx, resources, device, memlock, problems, warnings = CASES[case]
    report = check_fabric(fabric, ucx=ucx, resources=resources, device_type=device, memlock=memlock)
    assert len(report.problems) == len(problems) and all(p.startswith(w) for p, w in zip(report.problems, problems)), \
        report.problems
    assert len(report.warnings) == len(warnings) and all(p.startswith(w) for p, w in zip(report.warnings, warnings)), \
        report.warnings
    assert report.ok is (not problems)


def test_a_problem_says_what_was_found_and_what_to_do():
    report = check_fabric(Fabric.RDMA, ucx=True, resources=TCP_ONLY, device_type="cuda", memlock=8 * MIB,
                          ucx_library="/opt/kpool-pd/lib/python3.12/site-packages/libucx/lib/libucp.so.0")
    no_rdma, memlock = report.problems[:2]
    assert "self/memory, tcp/eth0, tcp/lo" in no_rdma and "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" in no_rdma
    assert "site-packages/libucx/lib/libucp.so.0" in no_rdma and "rdma/ib" in no_rdma
    assert "8388608 bytes (8.0 MiB)" in memlock and "ulimit -l" in memlock
    fields = report.log_fields()
    assert fields["ucx_transports"] == ["self", "tcp"] and fields["ucx_devices"] == ["eth0", "lo", "memory"]
    assert fields["memlock"] == 8 * MIB and check_fabric(Fabric.ANY, ucx=False, resources=(), device_type="cpu",
                                                         memlock=None).log_fields()["memlock"] == "unlimited"


@pytest.mark.parametrize("bad", [dict(fabric="infiniband"), dict(memlock=-1), dict(memlock=1.5)],
                         ids=["unknown-fabric", "negative-memlock", "fractional-memlock"])
def test_bad_input_is_refused(bad):
    args = dict(fabric=Fabric.RDMA, memlock=None) | bad
    with pytest.raises(ValueError):
        check_fabric(args.pop("fabric"), ucx=True, resources=RDMA_GPU, device_type="cuda", **args)


def test_the_memlock_limit_and_the_loaded_library_are_this_process(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert memlock_limit() == (None if soft == resource.RLIM_INFINITY else soft)
    lowered = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (lowered, hard))  # a soft limit may go back up to the hard one
    try:
        assert memlock_limit() == lowered
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 08:01 42 /usr/lib/libc.so.6\n"
                    "7f01-7f02 rw-p 00000000 00:00 0\n"
                    "7f02-7f03 r-xp 00000000 08:01 43 /opt/ucx/lib/libucp.so.0.0.0\n")
    assert loaded_library("libucp.so", maps) == "/opt/ucx/lib/libucp.so.0.0.0"
    assert loaded_library("libuct_ib.so", maps) is None
    assert loaded_library("libucp.so", tmp_path / "absent") is None


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_this_machines_ucx_as_the_check_reads_it():
    """The PyPI UCX here, read from a real UCX context: tcp, and no RDMA transport (its wheel is built
    without verbs), which the rdma profile refuses; the library is the wheel's."""
    probe = ("import json, ucxx; ucxx.init(options={}, env_takes_precedence=True); "
             "from kpool_pd.runtime.fabric_check import fabric_report; "
             "r = fabric_report('rdma', ucx=True, device_type='cpu'); "
             "print(json.dumps({'resources': [str(x) for x in r.resources], 'problems': r.problems, "
             "'library': r.ucx_library}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert any(r.startswith("tcp/") for r in found["resources"]), found
    assert not any(Resource(*r.split("/", 1)).rdma for r in found["resources"]), found
    assert any(p.startswith("fabric rdma: UCX has no RDMA transport") for p in found["problems"]), found
    assert found["library"] and "libucp.so" in found["library"], found


def test_a_held_gate_never_serves():
    class Reporter:
        def __init__(self) -> None:
            self.reports: list[bool] = []

        async def set_serving(self, serving: bool) -> None:
            self.reports.append(serving)

    async def main():
        gate, server = HealthGate(), Reporter()
        gate.hold("fabric rdma: no RDMA transport")
        await gate.open(server)
        gate.set_able(False, "busy")
        gate.set_able(True)
        await asyncio.sleep(0.01)
        assert server.reports and not any(server.reports) and not gate.serving
        assert gate.held == ("fabric rdma: no RDMA transport",)
        with pytest.raises(RuntimeError, match="before open"):
            gate.hold("late")
        with pytest.raises(ValueError):
            HealthGate().hold(" ")
    asyncio.run(main())


async def _status(port: int, service: str = "") -> int:
    async with open_channel(f"127.0.0.1:{port}", None) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=5)
    return reply.status


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_a_daemon_in_the_rdma_profile_without_rdma_is_never_ready_and_says_why(tmp_path):
    model = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=4)
    prefill = start_prefill(tmp_path, model_flags(model), transports="auto",
                            extra=["--fabric", "rdma", "--health-port", "0", "--log-format", "text"],
                            env={"UCX_WARN_UNUSED_ENV_VARS": "n"})
    try:
        info = prefill.wait_ready(90)  # up (the launcher and the liveness probe see it) ...
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

        async def check():
            await asyncio.sleep(0.3)  # what a readiness probe sees a moment later is the same
            return [await _status(info["health_port"]), await _status(info["health_port"], LIVENESS_SERVICE),
                    await _status(prefill.port)]
        assert asyncio.run(check()) == [not_serving, serving, not_serving]
        log = prefill.log_tail(200)
        assert "data plane: UCX " in log and "tcp/" in log
        assert "will not turn ready: fabric rdma: UCX has no RDMA transport" in log, log

        async def ready_line():
            return "prefill node ready" in prefill.log_tail(200)
        asyncio.run(until(ready_line, "the ready line", 10))
    finally:
        prefill.stop()
