"""The daemons' logs: one JSON object a line with the role and any ``extra=`` fields, or text."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from kpool_pd.runtime import JsonFormatter, LogFormat, configure_logging


def _record(msg: str, *args, extra: dict | None = None, exc_info=None) -> logging.LogRecord:
    return logging.getLogger("kpoolpd.test").makeRecord("kpoolpd.test", logging.WARNING, __file__, 1, msg, args,
                                                         exc_info, extra=extra)


def test_a_json_line_holds_the_role_the_message_and_the_extra_fields():
    line = JsonFormatter("decode").format(_record("request %s done", "r1", extra={"request_id": "r1", "tokens": 3}))
    entry = json.loads(line)
    assert "\n" not in line
    assert {k: entry[k] for k in ("level", "role", "logger", "msg", "request_id", "tokens")} == {
        "level": "warning", "role": "decode", "logger": "kpoolpd.test", "msg": "request r1 done",
        "request_id": "r1", "tokens": 3}
    assert entry["ts"].endswith("Z") and len(entry["ts"]) == len("2025-01-01T00:00:00.000Z")
    assert set(entry) == {"ts", "level", "role", "logger", "msg", "request_id", "tokens"}


def test_an_exception_goes_into_the_line():
    try:
        raise KeyError("lost")
    except KeyError:
        record = _record("failed", exc_info=sys.exc_info())
    entry = json.loads(JsonFormatter("prefill").format(record))
    assert "KeyError: 'lost'" in entry["exc"]


@pytest.mark.parametrize("fmt", list(LogFormat), ids=lambda f: f.value)
def test_configure_logging_routes_every_logger_to_one_handler(fmt, capsys):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("prefill", level="warning", fmt=fmt.value)
        logging.getLogger("kpoolpd.a").info("hidden")
        logging.getLogger("kpoolpd.b").warning("shown %d", 1)
        err = capsys.readouterr().err.strip().splitlines()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert len(err) == 1
    if fmt is LogFormat.JSON:
        assert json.loads(err[0])["msg"] == "shown 1"
    else:
        assert err[0].endswith("WARNING prefill kpoolpd.b: shown 1")


def test_configure_logging_refuses_an_unknown_format_or_level_and_changes_nothing():
    root = logging.getLogger()
    handlers = root.handlers[:]
    with pytest.raises(ValueError):
        configure_logging("prefill", level="INFO", fmt="xml")
    with pytest.raises(ValueError, match="expected one of DEBUG"):
        configure_logging("prefill", level="LOUD", fmt="text")
    assert root.handlers == handlers
