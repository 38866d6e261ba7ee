"""``kpool-pd bench transfer`` as a user runs it prints its table and nothing from gRPC's or UCX's own logging
on stderr: a node that stops while its peer's connection is still open made gRPC log a "Got goaway" line.
Where ucxx imports, the raw ucxx tag sends stand beside the connector's rows (the "x ucxx" column: over a
listener's connection; a second row over the connector's kind of endpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kpool_pd.connector import ucx_available


def test_bench_transfer_leaves_no_grpc_log_lines_on_stderr(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "bench", "transfer", "--tokens", "256", "--reps", "1",
                           "--layers", "1", "--no-nixl", "--machine", "quiet", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "goaway" not in proc.stderr.lower(), proc.stderr
    assert "chttp2" not in proc.stderr, proc.stderr
    assert "UCX  WARN" not in proc.stderr, proc.stderr
    (result,) = tmp_path.glob("transfer-*-quiet-cpu.json")
    rows = json.loads(result.read_text())["rows"]
    assert any(row["path"].startswith("connector grpc") for row in rows), rows
    if ucx_available():
        for path in ("raw ucxx tag", "raw ucxx worker ep"):  # over a listener, and the connector's kind of endpoint
            [raw] = [row for row in rows if row["path"] == path]
            assert raw["bytes"] > 0 and raw["gbps"] > 0, raw
        assert "x ucxx" in proc.stdout, proc.stdout
