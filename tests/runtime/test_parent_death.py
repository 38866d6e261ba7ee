"""A child started with ``parent_death_env`` and armed with ``arm_parent_death_signal`` gets the
signal when its parent dies, even by SIGKILL, and even when the parent died before the child armed
it; the entry does not reach the child's own children; a malformed entry is refused by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kpool_pd.runtime.process import PARENT_DEATH_ENV, arm_parent_death_signal, parent_death_env
from tests.support.polling import process_alive, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
GONE_WITHIN_S = 20.0

# The child: arms, says it did on stdout (and what its own environment kept), then sleeps.
CHILD = textwrap.dedent("""
    import os, sys, time
    from kpool_pd.runtime.process import PARENT_DEATH_ENV, arm_parent_death_signal
    time.sleep(float(sys.argv[1]))
    armed = arm_parent_death_signal()
    print(os.getpid(), armed, PARENT_DEATH_ENV in os.environ, flush=True)
    time.sleep(120)
""")
# The parent: starts the child with the entry, prints its pid, then waits to be killed.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from kpool_pd.runtime.process import parent_death_env
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env={**os.environ, **parent_death_env()})
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _start_parent(child_delay_s: float) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(child_delay_s)], stdout=subprocess.PIPE,
                              text=True, env=env)
    return parent, int(parent.stdout.readline())


@pytest.mark.parametrize("child_delay_s", [0.0, 3.0], ids=["armed-before-the-parent-dies", "parent-gone-before-arming"])
def test_the_child_dies_with_its_parent_killed(child_delay_s):
    parent, child = _start_parent(child_delay_s)
    try:
        if child_delay_s == 0.0:  # wait until the child armed and reports it
            line = parent.stdout.readline().split()
            assert line == [str(child), "True", "False"], line
        parent.kill()
        parent.wait(10)
        assert wait_for(lambda: not process_alive(child), GONE_WITHIN_S + child_delay_s, 0.05), \
            "the child outlived its parent"
    finally:
        parent.kill()
        if process_alive(child):
            os.kill(child, signal.SIGKILL)


def test_without_the_entry_nothing_is_armed():
    environ = {"OTHER": "1"}
    assert arm_parent_death_signal(environ) is False
    assert environ == {"OTHER": "1"}


def test_the_entry_names_this_process_and_the_signal():
    assert parent_death_env(signal.SIGINT) == {PARENT_DEATH_ENV: f"{os.getpid()}:{int(signal.SIGINT)}"}


@pytest.mark.parametrize("value", ["12", "a:b", "1:2:3"])
def test_a_malformed_entry_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=f"{PARENT_DEATH_ENV}=.*{value}.*parent pid"):
        arm_parent_death_signal({PARENT_DEATH_ENV: value})
