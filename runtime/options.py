"""One daemon option: its flag name, its parser, its default and its help; and the value parsers
the option tables share.

A parser takes the raw value (a flag's or an environment variable's text, or what the YAML file
holds) and returns the setting, or raises ``ValueError`` saying what it expected; the settings
loader turns that into a ``SettingsError`` naming the option and where the value came from.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

ENV_PREFIX = "KPOOLPD_"


class Role(enum.StrEnum):
    """Which daemon: its section of the YAML file, its log lines, its default engine id."""

    PREFILL = "prefill"
    DECODE = "decode"


class SettingsError(ValueError):
    """A configuration value that cannot be used; the message names the option and its source."""


@dataclass(frozen=True)
class Option:
    """One option, as ``--name`` (flag), ``KPOOLPD_NAME`` (environment) and ``name`` (YAML).

    ``parse`` turns a raw value into the setting or raises ``ValueError``; ``choices``, when
    given, are the only values (the parser checks them; the command line lists them)."""

    name: str  # flag name without dashes, e.g. "metrics-port"
    parse: Callable[[Any], Any]
    default: Any
    help: str
    _: KW_ONLY
    choices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("-") or "_" in self.name:
            raise ValueError(f"an option name is dashed words without leading dashes, got {self.name!r}")

    @property
    def key(self) -> str:
        """The settings key: ``metrics-port`` -> ``metrics_port``."""
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        """The environment variable: ``metrics-port`` -> ``KPOOLPD_METRICS_PORT``."""
        return ENV_PREFIX + self.key.upper()


def parse_bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def positive_int(text: Any) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected an integer > 0, got {text!r}")
    return value


def nonnegative_int(text: Any) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a number > 0, got {text!r}")
    return value


def parse_port(text: Any) -> int:
    """A TCP port: 0 asks for any free port, -1 turns the listener off."""
    value = int(text)
    if not -1 <= value <= 65535:
        raise ValueError(f"a port must be in [0, 65535] (or -1: off), got {value}")
    return value


def one_of(enum_type: type[enum.Enum]) -> Callable[[Any], Any]:
    """A parser that accepts the values of ``enum_type`` (case and surrounding space ignored) and
    returns the member."""
    names = [member.value for member in enum_type]

    def parse(text: Any) -> Any:
        value = str(text).strip().lower()
        for member in enum_type:
            if member.value == value:
                return member
        raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
    return parse
