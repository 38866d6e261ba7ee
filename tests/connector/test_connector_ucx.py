"""UCX options: an operator's UCX_* environment variables take precedence over the connector's
defaults (ConnectorConfig.ucx_options), and a transfer works under them. Each case runs in a
fresh process, since UCX reads its options once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kpool_pd.connector.shared.config import UCX_HOST_MEMORY, UCX_NO_SHARED_MEMORY, ucx_options_for

from tests.support.paths import REPO



def _report(progress: str = "", **env: str) -> dict:
    """ucx_env_report in a fresh process (ConnectorConfig.ucx_progress named ``progress``, else its default), with
    ``env`` over this process's environment less the UCX variables the cases set."""
    set_here = ("UCX_TLS", "UCX_RNDV_THRESH", "UCX_ZCOPY_THRESH", "UCXPY_PROGRESS_MODE")
    clean = {k: v for k, v in os.environ.items() if k not in set_here}
    code = f"from tests.support.connector_procs import ucx_env_report; ucx_env_report({progress!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean | env, capture_output=True, text=True,
                          timeout=90)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("UCX-REPORT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("UCX-REPORT "))


@pytest.mark.parametrize("env,tls,rndv,allowed", [
    ({}, "^posix,sysv,cma,xpmem,knem", "intra:4M,inter:4M", {"tcp", "self"}),
    ({"UCX_TLS": "tcp,self"}, "tcp,self", "intra:4M,inter:4M", {"tcp", "self"}),
    ({"UCX_RNDV_THRESH": "64K"}, "^posix,sysv,cma,xpmem,knem", "intra:64K,inter:64K", {"tcp", "self"}),
], ids=["connector-default", "env-tcp-self", "env-rndv-thresh"])
def test_environment_takes_precedence_over_the_connector_options(env, tls, rndv, allowed):
    """The pools are in host memory: the connector's UCX_HOST_MEMORY options apply over the default that
    ucxx sets at its import (UCX_RNDV_THRESH=8192), and an operator's variable over both."""
    report = _report(**env)
    assert report["tls"] == tls
    assert (report["rndv_thresh"], report["zcopy_thresh"]) == (rndv, "16K")
    assert report["bytes_equal"] is True and report["freed"] is True
    assert set(report["transports"]) <= allowed and "tcp" in report["transports"], report


def test_host_memory_options_only_for_pools_on_the_cpu():
    assert ucx_options_for(UCX_NO_SHARED_MEMORY, "cpu") == (*UCX_NO_SHARED_MEMORY, *UCX_HOST_MEMORY)
    assert ucx_options_for(UCX_NO_SHARED_MEMORY, "cuda") == UCX_NO_SHARED_MEMORY
    assert ucx_options_for((("RNDV_THRESH", "1M"),), "cpu") == (("RNDV_THRESH", "1M"), ("ZCOPY_THRESH", "16K"))


def test_ucxx_import_defaults_leave_the_environment_for_the_options():
    """ucxx puts its own UCX_* defaults into the environment when it is imported; the connector takes them
    out (child processes would read them as an operator's) and hands them to ucxx.init as options."""
    code = ("import os\n"
            "from kpool_pd.connector.shared.ucx import _import_ucxx, _ucxx_defaults\n"
            "_import_ucxx()\n"
            "print(sorted(k for k in os.environ if k.startswith('UCX_')), sorted(_ucxx_defaults))\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    left, defaults = proc.stdout.strip().splitlines()[-1].split("] [")
    assert left == "['UCX_MEMTYPE_CACHE'", left  # ours, set before the import on purpose
    assert "'RNDV_THRESH'" in defaults, defaults


@pytest.mark.parametrize("progress,env,expected", [
    ("", {}, "thread"),  # AUTO, a pool in host memory: the sleeping thread
    ("THREAD_POLLING", {}, "thread-polling"),  # the connector's setting
    ("THREAD_POLLING", {"UCXPY_PROGRESS_MODE": "thread"}, "thread"),  # the operator's variable wins
    ("", {"UCXPY_PROGRESS_MODE": "thread-polling"}, "thread-polling"),
], ids=["auto-host-pool", "config-polling", "env-over-config", "env-over-auto"])
def test_the_worker_is_progressed_as_configured_and_bytes_land(progress, env, expected):
    """ConnectorConfig.ucx_progress reaches ucxx (each case a fresh process: ucxx takes its mode once), an
    operator's UCXPY_PROGRESS_MODE wins over it, and a pull's bytes land the same under either mode."""
    report = _report(progress, **env)
    assert report["progress"] == expected, report
    assert report["bytes_equal"] is True and report["freed"] is True


def test_the_worker_says_how_it_is_progressed_at_start():
    """An operator reads the progress mode (and the transports) in the log when the worker comes up."""
    code = ("import asyncio, logging\n"
            "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
            "from kpool_pd.connector import UcxNode\n"
            "async def main():\n"
            "    UcxNode((), progress_mode='thread')\n"
            "asyncio.run(main())\n"
            "import os; os._exit(0)\n")
    clean = {k: v for k, v in os.environ.items() if k != "UCXPY_PROGRESS_MODE"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "UCX worker up: transports " in line]
    assert len(lines) == 1 and lines[0].endswith(", progress thread"), proc.stderr[-2000:]
