"""One daemon option: its flag name, its parser, its default and its help; and the value parsers
the option tables share.

A parser takes the raw value (a flag's or an environment variable's text, or what the YAML file
holds) and returns the setting, or raises ``ValueError`` saying what it expected; the settings
loader turns that into a ``SettingsError`` naming the option and where the value came from.
"""

from __future__ import annotations

import enum
import math
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


SCALARS = (str, int, float, bool)  # what one setting's raw value may be (YAML gives the native types)
MAX_SECONDS = 7 * 24 * 3600.0  # the longest duration an option takes: a week


def scalar(text: Any) -> Any:
    """``text`` when it is one value (a string, number or boolean); ValueError naming its kind when
    it is a list, a mapping or anything else (no option takes more than one value)."""
    if text is None or not isinstance(text, SCALARS):
        kind = {list: "a list", dict: "a mapping", type(None): "nothing"}.get(type(text), type(text).__name__)
        raise ValueError(f"expected a single value, got {kind}")
    return text


def text_value(text: Any) -> str:
    """A text option's value: one scalar, as text."""
    return str(scalar(text))


def parse_bool(text: Any) -> bool:
    if isinstance(scalar(text), bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def integer(text: Any) -> int:
    """An integer from its text or from an int; a boolean, a float (``1.7``, ``2.0``) or anything
    else is refused, never rounded."""
    if isinstance(scalar(text), bool) or isinstance(text, float):
        raise ValueError(f"expected an integer, got {text!r}")
    if isinstance(text, int):
        return text
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def number(text: Any) -> float:
    """A finite number from its text, an int or a float; booleans, ``inf`` and ``nan`` are refused."""
    if isinstance(scalar(text), bool):
        raise ValueError(f"expected a number, got {text!r}")
    try:
        value = float(text.strip() if isinstance(text, str) else text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[Any], int]:
    """A parser of integers in ``[low, high]`` (``high`` None: no upper bound)."""
    def parse(text: Any) -> int:
        value = integer(text)
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"expected an integer {bound}, got {text!r}")
        return value
    parse.__name__ = f"int_in_{low}_{high}"
    return parse


def positive_int(text: Any) -> int:
    value = integer(text)
    if value <= 0:
        raise ValueError(f"expected an integer > 0, got {text!r}")
    return value


def nonnegative_int(text: Any) -> int:
    value = integer(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: Any) -> float:
    value = number(text)
    if not value > 0:
        raise ValueError(f"expected a number > 0, got {text!r}")
    return value


def memory_fraction(text: Any) -> float:
    """A share of a device's memory: a number in [0, 1] (0: not sized from the device)."""
    value = number(text)
    if not 0 <= value <= 1:
        raise ValueError(f"expected a number in [0, 1], got {text!r}")
    return value


def seconds(text: Any) -> float:
    """A duration in seconds: finite, > 0 and at most ``MAX_SECONDS`` (a week), so that every
    deadline built from it can pass."""
    value = positive_float(text)
    if value > MAX_SECONDS:
        raise ValueError(f"expected seconds in (0, {MAX_SECONDS:.0f}], got {text!r}")
    return value


def seconds_or_off(text: Any) -> float:
    """A duration in seconds as ``seconds`` takes it, or 0: no bound of its own."""
    return 0.0 if number(text) == 0 else seconds(text)


def parse_port(text: Any) -> int:
    """A TCP port: 0 asks for any free port, -1 turns the listener off."""
    value = integer(text)
    if not -1 <= value <= 65535:
        raise ValueError(f"a port must be in [0, 65535] (or -1: off), got {value}")
    return value


def one_of(enum_type: type[enum.Enum]) -> Callable[[Any], Any]:
    """A parser that accepts the values of ``enum_type`` (case and surrounding space ignored) and
    returns the member."""
    names = [member.value for member in enum_type]

    def parse(text: Any) -> Any:
        value = str(scalar(text)).strip().lower()
        for member in enum_type:
            if member.value == value:
                return member
        raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
    return parse
