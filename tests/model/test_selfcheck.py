"""`kpool-pd selfcheck` prints the invariant table and fails when a digest differs."""

from __future__ import annotations

import dataclasses

from kpool_pd import selfcheck
from kpool_pd.cli import main


def test_selfcheck_prints_the_table_and_exits_zero(capsys):
    assert main(["selfcheck"]) == 0
    out = capsys.readouterr().out
    assert out.count("holds") == len(selfcheck.DEFAULT_CASES)
    assert f"{len(selfcheck.DEFAULT_CASES)} of {len(selfcheck.DEFAULT_CASES)} configurations hold" in out


def test_a_broken_digest_is_reported(monkeypatch, capsys):
    real = selfcheck.run_case

    def corrupt(case, seed):
        row = real(case, seed)
        return dataclasses.replace(row, pd_digest="0" * 64)

    monkeypatch.setattr(selfcheck, "run_case", corrupt)
    assert main(["selfcheck"]) == 1
    assert "BROKEN" in capsys.readouterr().out
