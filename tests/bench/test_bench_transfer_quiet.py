"""``kpool-pd bench transfer`` as a user runs it prints its table and nothing from gRPC's or UCX's own logging
on stderr: a node that stops while its peer's connection is still open made gRPC log a "Got goaway" line.
Where ucxx imports, the raw ucxx tag sends stand beside the connector's rows (the "x ucxx" column: over a
listener's connection; a second row over the connector's kind of endpoint), with each row's messages a pull and the
raw send of the same bytes in as many messages (``x ucxxK``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kpool_pd.connector import ucx_available


def test_bench_transfer_leaves_no_grpc_log_lines_on_stderr(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "bench", "transfer", "--tokens", "256", "--reps", "1",
                           "--layers", "1", "--no-nixl", "--ucxx-messages", "3", "--machine", "quiet",
                           "--out", str(tmp_path)],
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
        # messages a pull: a UCX row's are its regions; the raw send of the same bytes in 3 messages stands beside
        # the one-message send, and the table gives each row's count and its rate over the raw send in as many
        [three] = [row for row in rows if row["path"] == "raw ucxx tag x3"]
        assert three["messages"] == 3 and three["bytes"] == raw["bytes"] and three["gbps"] > 0, three
        ucx_rows = [row for row in rows if row["path"].startswith("connector ucx")]
        assert ucx_rows and all(row["messages"] == row["regions"] >= 1 for row in ucx_rows), ucx_rows
        for k in {row["messages"] for row in ucx_rows}:  # each count a connector series used, measured raw
            assert any(row["path"].startswith("raw ucxx tag") and row["messages"] == k for row in rows), (k, rows)
        assert all(row["messages"] is None for row in rows if row["path"] == "connector grpc")
        header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("tokens"))
        assert "msgs" in header and "x ucxxK" in header, header


def _push_messages(tmp_path, *extra: str) -> int:
    """The messages a push of 4,096 tokens took in ``kpool-pd bench transfer`` (256-token blocks, one layer)."""
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "bench", "transfer", "--tokens", "4096", "--reps", "1",
                           "--layers", "1", "--no-nixl", "--machine", "pieces", "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    (result,) = tmp_path.glob("transfer-*-pieces-cpu.json")
    [push] = [row for row in json.loads(result.read_text())["rows"] if row["path"] == "connector ucx push"]
    return push["messages"]


def test_a_push_moves_in_pieces_of_the_prefills_chunk(tmp_path):
    """The bench's prefill node cuts a push as ``kpool-pd prefill-worker`` does, in pieces of a step's tokens: a
    prompt computed whole goes as one message (pieces of the default 2,048 tokens would make it two), a prompt
    computed in 1,024-token chunks as four."""
    if not ucx_available():
        pytest.skip("the push rows need ucxx")
    assert _push_messages(tmp_path / "whole") == 1
    assert _push_messages(tmp_path / "chunked", "--prefill-chunk", "1024") == 4
