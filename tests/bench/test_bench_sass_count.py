"""``kpool_pd.bench.sass_count`` compiles the kpool compression for sm_90 on this (GPU-less) machine and counts
its SASS; the issue floor is the warp instructions over the H200's issue rate. The tests run the
command as a subprocess: the test process interprets the kernels (``TRITON_INTERPRET``), and then
nothing compiles."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kpool_pd.bench.sass_count import SassCount
from kpool_pd.kernels.dispatch import INTERPRET_ENV


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != INTERPRET_ENV}
    if interpret:
        env[INTERPRET_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "kpool_pd.bench.sass_count", *args], capture_output=True, text=True,
                          env=env, timeout=240)


def test_the_issue_floor_is_the_launchs_warp_instructions_over_the_issue_rate():
    result = SassCount(block_p=8, warps=4, registers=0, per_thread=1000, opcodes=())
    # 262,144 pools / 8 = 32,768 programs x 4 warps x 1,000 instructions over 132 SMs x 4 a cycle x 1.98 GHz
    assert result.issue_floor_us(262_144) == pytest.approx(131_072_000 / (132 * 4 * 1.98e9) * 1e6)
    assert result.issue_floor_us(262_145) > result.issue_floor_us(262_144)  # a partial program still issues


def test_a_program_of_twice_the_pools_issues_about_twice_the_instructions_a_thread():
    proc = _run("--block-p", "8,16", "--warps", "4")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [("8", "4"), ("16", "4")]
    (small_regs, small), (large_regs, large) = ((int(r[2]), int(r[3])) for r in rows)
    assert 0 < small_regs <= 255 and 0 < large_regs <= 255
    assert 1.6 * small < large < 2.4 * small
    assert "FADD" in proc.stdout  # the sums of the softmax and the butterflies are among the most frequent


def test_an_interpreting_process_is_told_that_nothing_compiles():
    proc = _run(interpret=True)
    assert proc.returncode == 2 and f"{INTERPRET_ENV} is set" in proc.stderr
