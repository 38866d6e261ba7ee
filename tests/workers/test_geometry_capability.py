"""The kernel page rules at the daemons' level, with the GPU's compute capability faked.

Each case runs the real entry point (``python -m kpool_pd.decode_worker``, ``python -m kpool_pd.prefill_worker``,
``python -m kpool_pd up``) in a child process whose ``torch.cuda`` answers as a machine with one CUDA device of the
given compute capability (``_FAKE``); nothing is launched on it: a refusal exits with status 2 before anything is
built, and an accepted geometry is shown by the daemon going on to the next check, the port, which the test holds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

START_S = 90  # a refused daemon exits in a few seconds; this only bounds a broken one

# torch.cuda as one device of capability (major, minor); then the named module runs as __main__
_FAKE = """
import runpy, sys
import torch
major, minor, module = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: (major, minor)
torch.cuda.mem_get_info = lambda device=None: (64 << 30, 80 << 30)  # free, total: the memory preflight's answer
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _run(capability: tuple[int, int], module: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPOOLPD_")}
    return subprocess.run([sys.executable, "-c", _FAKE, *map(str, capability), module, *flags], env=env,
                          capture_output=True, text=True, timeout=START_S)


def _daemon_flags(port: int, *model: str) -> tuple[str, ...]:
    return ("--device", "cuda", "--port", str(port), "--metrics-port", "-1", "--health-port", "-1",
            "--log-format", "text", *model)


@pytest.fixture
def held_port():
    """A loopback port this test holds open, so an accepted daemon stops at its port check."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


@pytest.mark.parametrize("module,role,model", [
    pytest.param("kpool_pd.decode_worker", "decode", ("--kpool", "8"), id="decode-kpool8-one-page-of-32"),
    pytest.param("kpool_pd.prefill_worker", "prefill", ("--kpool", "2", "--kernel-page-states", "32"),
                 id="prefill-kpool2-four-pages-of-32"),
])
def test_a_daemon_on_sm120_refuses_pages_of_32_states_naming_the_capability(held_port, module, role, model):
    proc = _run((12, 0), module, *_daemon_flags(held_port, *model))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"kpool-pd {role}: error: kpool from flag --kpool"), proc.stderr
    assert "compute capability 12.0" in lines[0] and "64 states only" in lines[0], lines[0]


@pytest.mark.parametrize("capability,model", [
    pytest.param((9, 0), ("--kpool", "8"), id="sm90-page-of-32"),
    pytest.param((12, 0), ("--kpool", "2", "--block-size", "512"), id="sm120-four-pages-of-64"),
])
def test_a_daemon_takes_the_pages_its_gpu_reads_and_goes_on_to_its_port(held_port, capability, model):
    proc = _run(capability, "kpool_pd.decode_worker", *_daemon_flags(held_port, *model))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "kernel pages" not in lines[0] and "compute capability" not in lines[0], lines[0]
    assert f"port {held_port}" in lines[0] or str(held_port) in lines[0], lines[0]


def test_up_on_sm120_refuses_pages_of_32_states_before_starting_anything():
    proc = _run((12, 1), "kpool_pd", "up", "--device", "cuda", "--kpool", "8")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "compute capability 12.1" in lines[0] and "64 states only" in lines[0], proc.stderr
