"""``kpool-pd bench decode`` on the CPU: eager rows for each family and batch, their JSON, the graphed rows' ratios to
their family's eager rows, and refused flags."""

from __future__ import annotations

import json

import pytest

from kpool_pd.bench import decode_step


def test_cpu_run_writes_a_row_per_family_and_batch(tmp_path, capsys):
    assert decode_step.main(["--device", "cpu", "--layers", "2", "--batches", "1,3", "--steps", "2",
                             "--warmup", "1", "--profile-steps", "1", "--prompt-len", "40", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_step.json").read_text())
    assert [(r["family"], r["mode"], r["batch"]) for r in rows] == [
        ("kpool", "eager", 1), ("kpool", "eager", 3), ("qsa", "eager", 1), ("qsa", "eager", 3)]
    for row in rows:
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["launches"] == 0 and row["syncs"] <= 0  # no CUDA on the CPU
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:4] == ["family", "mode", "batch", "step"]
    assert [line.split()[:3] for line in table.splitlines()[1:]] == [
        ["kpool", "eager", "1"], ["kpool", "eager", "3"], ["qsa", "eager", "1"], ["qsa", "eager", "3"]]


def test_families_narrow_the_rows(tmp_path):
    assert decode_step.main(["--device", "cpu", "--layers", "1", "--batches", "2", "--steps", "1", "--warmup", "1",
                             "--profile-steps", "1", "--prompt-len", "9", "--families", "qsa", "--out",
                             str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_step.json").read_text())
    assert [(r["family"], r["batch"]) for r in rows] == [("qsa", 2)]


def test_graphed_rows_compare_with_their_familys_eager_row():
    profile = decode_step.StepProfile(host_ms=1.0, gpu_ms=1.0, launches=1, syncs=1, kernels=())

    def row(family, mode, step_ms):
        return decode_step.Row(family=family, mode=mode, batch=4, step_ms=step_ms, tokens_per_s=1.0, tokens=(),
                               profile=profile)

    lines = decode_step.table([row("kpool", "eager", 2.0), row("kpool", "graphed", 1.0), row("qsa", "eager", 8.0),
                               row("qsa", "graphed", 2.0)]).splitlines()
    assert [line.split()[-1] for line in lines[2::2]] == ["0.500", "0.250"]


@pytest.mark.parametrize("flags, message", [(["--num-spec", "-1"], "--num-spec must be >= 0, got -1"),
                                            (["--batches", "0"], "must be >= 1, got 0"),
                                            (["--families", "kpool,mla"], "expected families of ['kpool', 'qsa']")])
def test_bad_flags_exit_2_naming_the_value(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        decode_step.main(["--device", "cpu", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
