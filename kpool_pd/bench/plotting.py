"""A bench's PNG is optional: matplotlib comes with the ``bench`` extra, and without it a bench writes
its JSON and table alone and says so."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrote(json_path: Path, drawn: bool) -> str:
    """The bench's last line: which files it wrote."""
    return f"wrote {json_path}" + (" and its .png" if drawn else " (no PNG: matplotlib is not installed)")
