"""``kpool-pd`` commands that must refuse before starting anything, run by the command's entry point in the
test's own process (``kpool_pd.cli.main``, what ``python -m kpool_pd`` exits with): a refusal needs no interpreter
of its own to be seen, where each such run took 2-9 s to start one and import torch on the 2-core machine."""

from __future__ import annotations

import pytest

from kpool_pd.cli import main


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``kpool-pd argv...`` in this process: its exit status and what it wrote to standard error."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    return code, capsys.readouterr().err
