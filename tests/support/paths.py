"""Where the repository is, for tests that read its files or start processes from it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/paths.py -> the repository root
