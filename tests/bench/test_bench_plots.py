"""Without matplotlib (it comes with the ``bench`` extra only) every bench writes its JSON and says there is
no PNG, instead of failing after the measurement."""

from __future__ import annotations

import sys

import pytest

from kpool_pd.bench import kernel_report, pipeline, transfer
from kpool_pd.bench.plotting import pyplot, wrote


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as on a machine without the bench extra."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_pyplot_is_none_without_matplotlib(no_matplotlib):
    assert pyplot() is None


@pytest.mark.parametrize("draw, rows", [
    (transfer._plot, [{"path": "memcpy", "bytes": 2**20, "gbps": 1.0}]),
    (kernel_report.plot, [{"kernel": "k", "method": "graph32", "met": True, "time_us": 1.0, "fraction_of_copy": 0.5}]),
    (pipeline.plot, [{"steps_ms": [(0.0, 1.0)], "sends_ms": [(0, 0.5, 1.0)], "first_token_ms": 1.0}]),
], ids=["transfer", "kernels", "pipeline"])
def test_each_bench_draws_nothing_and_says_so(no_matplotlib, tmp_path, draw, rows):
    path = tmp_path / "figure.png"
    assert draw(rows, path, "title") is False
    assert not path.exists()


def test_the_last_line_names_what_was_written(tmp_path):
    assert wrote(tmp_path / "r.json", True) == f"wrote {tmp_path / 'r.json'} and its .png"
    assert wrote(tmp_path / "r.json", False) == f"wrote {tmp_path / 'r.json'} (no PNG: matplotlib is not installed)"
