"""Every bench refuses a bad count or a cache it cannot build with the value in the message, before
any measurement or process starts (argparse's exit status 2)."""

from __future__ import annotations

import argparse

import pytest

from kpool_pd.bench import control_latency, dcp, heterogeneous_sweep, kernels, pipeline, sass_count, transfer
from kpool_pd.bench.arguments import count, counts


def test_counts_parse_lists_and_name_what_is_wrong():
    assert counts("256,1024, 4096") == [256, 1024, 4096]
    assert count("3") == 3
    for text, message in [("0", "must be >= 1, got 0"), ("-4", "must be >= 1, got -4"),
                          ("x", "expected an integer >= 1, got 'x'")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            count(text)
    for text in ("256,,3", "", "1,"):
        with pytest.raises(argparse.ArgumentTypeError, match="separated by commas"):
            counts(text)


@pytest.mark.parametrize("main, argv, message", [
    (transfer.main, ["--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    (transfer.main, ["--reps", "0"], "argument --reps: must be >= 1, got 0"),
    (transfer.main, ["--kpool", "3", "--block-size", "100"], "block_size 100 is not a multiple of kpool 3"),
    (transfer.main, ["--prefill-block-size", "100"], "does not divide block_size 100"),
    (dcp.main, ["--ranks", "1,0"], "argument --ranks: must be >= 1, got 0"),
    (dcp.main, ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (dcp.main, ["--num-spec", "-2"], "num_spec must be an integer >= 0, got -2"),
    (pipeline.main, ["--runs", "0"], "argument --runs: must be >= 1, got 0"),
    (kernels.main, ["--only", "no such case"], "--only 'no such case' names no case"),
    (kernels.main, ["--reps", "0"], "argument --reps: must be >= 1, got 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_argument_is_refused_before_anything_runs(capsys, tmp_path, main, argv, message):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("bench", [transfer, dcp, pipeline, control_latency, kernels, heterogeneous_sweep, sass_count],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_bench_help_is_whole_sentences_and_every_flag_says_what_it_does(bench):
    parser = bench.build_parser()
    assert parser.description and parser.description.rstrip().endswith("."), parser.description
    silent = [action.option_strings[0] for action in parser._actions if not (action.help or "").strip()]
    assert not silent, f"flags without help: {silent}"
