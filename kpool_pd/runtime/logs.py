"""Structured logs for the daemons: one JSON object a line (time, level, role, logger, message,
and any ``extra=`` fields such as request_id), or plain text for a terminal."""

from __future__ import annotations

import enum
import json
import logging
import time
from typing import Any

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class LogFormat(enum.StrEnum):
    JSON = "json"  # one object a line
    TEXT = "text"  # time, level, role, logger: message


def log_level(text: Any) -> str:
    """Parser of ``--log-level``: DEBUG, INFO, WARNING or ERROR (any case); returns it in capitals."""
    value = str(text).strip().upper()
    if value not in LEVELS:
        raise ValueError(f"expected one of {', '.join(LEVELS)}, got {text!r}")
    return value


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "role", "logger", "msg", ...extra fields, "exc"?}`` on one line."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "role": self.role, "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(role: str, *, level: str, fmt: LogFormat | str) -> None:
    """Route every module logger to stderr in ``fmt``, at ``level`` and above; replaces the root
    logger's handlers. ``ValueError`` for an unknown format or level (nothing changed then)."""
    fmt, level = LogFormat(fmt), log_level(level)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if fmt is LogFormat.JSON else
                         logging.Formatter(f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
