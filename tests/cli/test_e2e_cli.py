"""`kpool-pd up` end to end, as a user runs it: daemons as subprocesses, JSON out, colocated check; what it refuses
before starting anything, through its entry point in the test's own process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kpool_pd.connector import ucx_available
from tests.support.cli_refusals import refused

FIELDS = {"request_id", "prompt_len", "tokens", "output_digest", "state_digest", "transfer_bytes", "transfer_ms",
          "ttft_ms", "prefill_ms", "exposed_transfer_ms"}


def _up(*flags: str) -> tuple[int, list[dict], str]:
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "up", "--json", *flags], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


def test_up_prints_one_object_per_request_then_the_summary_and_matches_colocated():
    flags = ("--requests", "3", "--prompt-len", "45", "--max-tokens", "9", "--family", "qsa", "--num-spec", "3")
    code, rows, stderr = _up(*flags)
    assert code == 0, stderr
    *requests, last = rows
    assert [r["request_id"] for r in requests] == ["req-0", "req-1", "req-2"]
    assert all(FIELDS <= set(r) and len(r["tokens"]) == 9 and r["transfer_bytes"] > 0 for r in requests)
    summary = last["summary"]
    assert summary["ok"] == summary["colocated_match"] == 3
    assert summary["transport"] == ("ucx" if ucx_available() else "grpc")
    assert "prefill ready on 127.0.0.1:" in stderr and "[3/3]" in stderr

    code, colocated, _ = _up(*flags, "--colocated")
    assert code == 0
    assert [(r["output_digest"], r["state_digest"]) for r in colocated[:-1]] == [
        (r["output_digest"], r["state_digest"]) for r in requests]
    assert colocated[-1]["summary"]["mode"] == "colocated"


def test_up_over_tls_matches_colocated():
    code, rows, stderr = _up("--tls", "--requests", "2", "--prompt-len", "33", "--max-tokens", "6")
    assert code == 0, stderr
    summary = rows[-1]["summary"]
    assert summary["tls"] is True and summary["ok"] == summary["colocated_match"] == 2
    assert "throwaway CA" in stderr


def test_up_kpool2_with_256_token_blocks_matches_colocated():
    """kpool 2 in 256-token blocks: 128 states a block, two kernel pages; prompts cross a page (128 tokens) and a
    block (256 tokens), and up's own colocated run matches every request byte for byte."""
    code, rows, stderr = _up("--kpool", "2", "--block-size", "256", "--requests", "2", "--prompt-len", "300",
                             "--max-tokens", "6")
    assert code == 0, stderr
    summary = rows[-1]["summary"]
    assert summary["ok"] == summary["colocated_match"] == 2, summary
    assert (summary["model"]["kpool"], summary["model"]["block_size"]) == (2, 256)


def test_up_refuses_a_bad_configuration_before_starting_anything(capsys):
    code, stderr = refused(capsys, "up", "--kpool", "2", "--block-size", "192")
    assert code == 2
    assert "192 / 2 = 96 exceeds the kernel page of 64" in stderr and "starting" not in stderr


@pytest.mark.parametrize("flags,rule", [
    (("--block-size", "64"), "a block of 64 tokens is refused: the attention block is a multiple of 128 tokens"),
    (("--prefill-block-size", "192"), "a block of 192 tokens is refused"),
    (("--kpool", "8", "--block-size", "128", "--colocated"), "kpool 8 in 128-token blocks makes kernel pages of 16 "
                                                              "states"),
    (("--kpool", "8", "--block-size", "384"), "kpool 8 in 384-token blocks makes kernel pages of 48 states: the "
                                              "paged-MQA indexer kernel takes pages of 32 or 64 states and no other"),
], ids=["block-64", "prefill-block-192", "kpool8-pages-of-16-colocated", "kpool8-384-pages-of-48"])
def test_up_refuses_the_geometry_the_daemons_refuse_naming_the_rule(capsys, flags, rule):
    code, stderr = refused(capsys, "up", *flags)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and rule in lines[0], stderr


def test_up_places_the_daemons_by_device(monkeypatch):
    from kpool_pd.up import placement

    assert placement("cpu") == ("cpu", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        placement("cuda")
    except ValueError as exc:
        assert "no CUDA device" in str(exc)
    else:
        raise AssertionError("cuda without a CUDA device must be refused")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, decode in ((1, "cuda:0"), (2, "cuda:1"), (8, "cuda:1")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert placement("cuda") == ("cuda:0", decode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs `up --device cuda` in tests/gpu")
def test_up_with_cuda_on_a_machine_without_one_says_so_before_starting_anything(capsys):
    code, stderr = refused(capsys, "up", "--device", "cuda")
    assert code == 2
    assert "no CUDA device" in stderr and "starting" not in stderr
