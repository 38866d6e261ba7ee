"""Structured logs for the daemons: one JSON object a line (time, level, logger, message, and
any ``extra=`` fields such as request_id), or plain text for a terminal."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
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


def configure_logging(role: str, *, level: str, fmt: str) -> None:
    """Route every module logger to stderr as JSON lines (``fmt == "json"``) or text."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be json or text, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else
                         logging.Formatter(f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
