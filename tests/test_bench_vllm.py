"""``kpool-pd bench vllm`` (bench/vllm_pd.py): its flags, and one short run of a KpoolPdConnector pair
whose row says the consumer pulled every prompt token and gave one engine's tokens."""

from __future__ import annotations

import json
import os

import pytest

from bench import vllm_pd


@pytest.mark.parametrize("argv, message", [
    (["--connectors", "kpool-grpc,mooncake"], "--connectors: expected names among"),
    (["--tokens", "0"], "must be >= 1, got 0"),
    (["--reps", "x"], "expected an integer >= 1, got 'x'"),
])
def test_bad_flags_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        vllm_pd.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_package_is_named_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(vllm_pd.importlib.util, "find_spec", lambda name: None)
    assert vllm_pd.main(["--connectors", "kpool-grpc,nixl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs vllm (pip install -e '.[vllm]'" in err and "nixl (pip install nixl" in err


def test_the_table_gives_each_ttft_beside_nixls():
    rows = [vllm_pd.Row(connector=name, tokens=1024, reps=3, prefill_ms=10.0, decode_first_token_ms=first,
                        ttft_ms=10.0 + first, same_tokens=True, pulled_tokens=3072)
            for name, first in (("nixl", 30.0), ("kpool-grpc", 10.0))]
    lines = vllm_pd.table(rows).splitlines()
    kpool = next(line for line in lines if line.startswith("kpool-grpc"))
    assert "20.0" in kpool and "0.50x" in kpool  # (10 + 10) / (10 + 30)


@pytest.mark.vllm
def test_a_short_run_pulls_every_prompt_token_and_matches_one_engine(tmp_path):
    if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
    assert vllm_pd.main(["--tokens", "40", "--reps", "2", "--connectors", "kpool-grpc", "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "vllm_pd.json").read_text())
    assert row["connector"] == "kpool-grpc" and row["tokens"] == 40 and row["same_tokens"] is True
    assert row["pulled_tokens"] == 2 * 40  # both reps' prompts came over the connector
    assert 0 < row["prefill_ms"] < row["ttft_ms"]
