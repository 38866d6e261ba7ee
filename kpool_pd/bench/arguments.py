"""Argument types that the benches share, so that a bad count is refused with its value before any
measurement starts (argparse prints the message and exits 2)."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """A comma-separated list of integers >= 1, at least one."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, got {text!r}")
    return [count(part) for part in parts]


def bench_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A bench's command line, described by its module docstring's first paragraph (whole sentences:
    argparse reflows it), so that ``--help`` never stops mid-sentence."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(prog=prog, description=" ".join(paragraph.split()))
