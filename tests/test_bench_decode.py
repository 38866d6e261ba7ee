"""``kpool-pd bench decode`` on the CPU: eager rows for each batch, their JSON, and refused flags."""

from __future__ import annotations

import json

import pytest

from kpool_pd.bench import decode_step


def test_cpu_run_writes_a_row_per_batch(tmp_path, capsys):
    assert decode_step.main(["--device", "cpu", "--layers", "2", "--batches", "1,3", "--steps", "2",
                             "--warmup", "1", "--profile-steps", "1", "--prompt-len", "40", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_step.json").read_text())
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 3)]
    for row in rows:
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["launches"] == 0 and row["syncs"] <= 0  # no CUDA on the CPU
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["mode", "batch", "step"]
    assert len(table.splitlines()) == 3


@pytest.mark.parametrize("flags, message", [(["--num-spec", "-1"], "--num-spec must be >= 0, got -1"),
                                            (["--batches", "0"], "must be >= 1, got 0")])
def test_bad_flags_exit_2_naming_the_value(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        decode_step.main(["--device", "cpu", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
