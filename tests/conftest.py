"""Shared test setup.

On a machine without CUDA, Triton kernels can only run in Triton's interpreter, which must be
chosen before any kernel module is imported (``@triton.jit`` reads ``TRITON_INTERPRET`` when it
decorates). Setting it here, before the test modules import anything, is harmless for every other
test: the ops run their torch references on CPU tensors unless ``KPOOL_PD_FORCE_TRITON=1`` (the
``force_triton`` fixture) asks for the kernels. On a CUDA machine nothing is set.

``OMP_WAIT_POLICY=PASSIVE`` (unless set already) is set before torch loads, so that this process and every engine and
daemon the tests start inherit it: an OpenMP thread with no work then sleeps where it would spin. On the 2-core
machine the suite runs several vLLM engines at once, and the spinning threads of idle ones took the cores from the
busy ones: ``tests/vllm/test_vllm_ranks.py`` and ``tests/vllm/test_vllm_hostile.py`` side by side (``-n 2``) took
221 s and 106 user CPU-seconds without it, 185 s and 77 with it (2026-12-07, one run each).

``VLLM_RPC_BASE_PATH`` (unless set already) is a folder of this test process's own, removed when its session ends:
vLLM makes its engines' IPC sockets there, and a killed vLLM process leaves them behind (in the temporary folder
itself, about 70 a suite run: 276 in four runs, 2026-12-07). A short path: a socket's must fit in 108 bytes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
VLLM_SOCKETS = None if "VLLM_RPC_BASE_PATH" in os.environ else tempfile.mkdtemp(prefix="kpoolpd-vllm-")
if VLLM_SOCKETS is not None:
    os.environ["VLLM_RPC_BASE_PATH"] = VLLM_SOCKETS

import pytest  # noqa: E402
import torch  # noqa: E402

from kpool_pd.kernels.dispatch import FORCE_TRITON_ENV, INTERPRET_ENV

if not torch.cuda.is_available():
    os.environ.setdefault(INTERPRET_ENV, "1")


def _hold_grpc_aio() -> None:
    """Keep gRPC's asyncio layer initialised for the whole test process.

    grpc.aio counts its channels and servers; when the count falls to zero (the last one garbage
    collected) it shuts its completion queue down and joins the queue's poller thread, which waits
    for every operation still on the queue. A test's call left pending when its event loop closed
    then blocks that join, in whatever later test the collection happens to run: CI saw the main
    thread in ``Thread.join`` under a YAML parse for 4 minutes (faulthandler), and once for the rest of
    its 90 minutes. One count taken here and never given back means no shutdown, so no join; the
    poller is a daemon thread, which the interpreter leaves at exit. Each event loop still binds
    itself as it creates its own channels and servers (grpc.aio serves several loops)."""
    from grpc._cython import cygrpc

    async def hold() -> None:
        cygrpc.init_grpc_aio()
    asyncio.run(hold())


_hold_grpc_aio()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A kernel body's CPU rows run from tests/, its CUDA rows from tests/gpu/ (tests/support/kernel_backends.py):
    the other rows are deselected at collection, not skipped one by one. The slowest files go first
    (tests/support/suite_order.py), for the workers of the README's test command."""
    from tests.support.kernel_backends import in_its_suite
    from tests.support.suite_order import slowest_first

    elsewhere = [item for item in items if not in_its_suite(item)]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if in_its_suite(item)]
    slowest_first(items)
    allow_the_wait_for_memory(config, items)


def allow_the_wait_for_memory(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A vLLM test's setup may wait for another copy's engines to give the machine's memory back
    (``tests/support/memory_share.py``) before its own engines start: its pytest-timeout deadline is its own (the
    suite's ``timeout`` where it states none) plus the longest that wait may take. Seen when it was not: two copies
    side by side, one copy's TestNixl failed at 300 s waiting for the other's TestKpoolPd engines."""
    from tests.support.memory_share import SHARE_WAIT_S

    suite_s = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("vllm"):
            own = item.get_closest_marker("timeout")
            item.add_marker(pytest.mark.timeout((float(own.args[0]) if own else suite_s) + SHARE_WAIT_S))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small ops run faster on one thread than on two contending ones (the daemons do the same)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def force_triton(monkeypatch):
    """Run the ops' Triton kernels on CPU tensors (through the interpreter) for one test."""
    if os.environ.get(INTERPRET_ENV) != "1":
        pytest.skip(f"the Triton interpreter is off ({INTERPRET_ENV} != 1): on CUDA, tests/gpu runs the kernels")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")


def entries_within_rule(q: torch.Tensor, scale: torch.Tensor, q_ref: torch.Tensor, scale_ref: torch.Tensor) -> int:
    """The softmax comparison rule of the kpool kernels against their reference; returns the rows that differ.

    # q, q_ref: [P, 128] fp8; scale, scale_ref: [P] fp32 (any device)

    Bit-identical rows pass (poisoned, unwritten rows included). Elsewhere the one source of difference
    is exp (an ulp between implementations), which can move one element of the pooled x by one bf16
    ulp; the Hadamard spreads that over every y by at most 2**-8 of the row's amax. So: scales equal
    to within one binade (ue8m0) or 2**-6 (fp32 scales), and each dequantized value within one e4m3
    step of itself plus 2**-6 of the row's range (448 * scale).
    """
    q, scale, q_ref, scale_ref = q.cpu(), scale.cpu(), q_ref.cpu(), scale_ref.cpu()
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).all(dim=1) & (
        scale.view(torch.int32) == scale_ref.view(torch.int32))
    q, scale, q_ref, scale_ref = q[~same], scale[~same], q_ref[~same], scale_ref[~same]
    if q.shape[0] == 0:
        return 0
    ratio = scale / scale_ref
    binade = (ratio == 1) | (ratio == 2) | (ratio == 0.5) | ((ratio - 1).abs() <= 2**-6)
    assert bool(binade.all()), f"scales differ by more than the rule allows: {scale[~binade]} vs {scale_ref[~binade]}"
    deq, deq_ref = q.float() * scale[:, None], q_ref.float() * scale_ref[:, None]
    bound = torch.maximum(deq.abs(), deq_ref.abs()) / 8 + 448 * torch.maximum(scale, scale_ref)[:, None] / 64
    worst = float(((deq - deq_ref).abs() / bound).max())
    assert worst <= 1.0, f"dequantized values differ by {worst:.3f} of the rule's bound"
    return q.shape[0]


@pytest.fixture
def entry_rule():
    """The softmax comparison rule (``entries_within_rule``) for tests in any folder."""
    return entries_within_rule


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's vLLM socket folder goes, in the process that made it (pytest-xdist's workers inherit the
    controller's folder and leave it be; the controller ends after them, and their engines before them)."""
    if VLLM_SOCKETS is not None:
        shutil.rmtree(VLLM_SOCKETS, ignore_errors=True)
