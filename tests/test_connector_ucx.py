"""UCX options: an operator's UCX_* environment variables take precedence over the connector's
defaults (ConnectorConfig.ucx_options), and a transfer works under them. Each case runs in a
fresh process, since UCX reads its options once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _report(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TLS")}
    proc = subprocess.run([sys.executable, "-c", "from tests.connector_procs import ucx_env_report; ucx_env_report()"],
                          cwd=ROOT, env=clean | env, capture_output=True, text=True, timeout=90)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("UCX-REPORT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("UCX-REPORT "))


@pytest.mark.parametrize("env,tls,allowed", [
    ({}, "^posix,sysv,cma,xpmem,knem", {"tcp", "self"}),
    ({"UCX_TLS": "tcp,self"}, "tcp,self", {"tcp", "self"}),
], ids=["connector-default", "env-tcp-self"])
def test_environment_takes_precedence_over_the_connector_options(env, tls, allowed):
    report = _report(**env)
    assert report["tls"] == tls
    assert report["bytes_equal"] is True and report["freed"] is True
    assert set(report["transports"]) <= allowed and "tcp" in report["transports"], report
