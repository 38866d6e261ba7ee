"""Reading the log records a test captured."""

from __future__ import annotations

import logging


def _is_a_closed_loops_grpc_event(record: logging.LogRecord) -> bool:
    """grpc.aio's report of an event that belongs to an event loop already closed.

    Every event loop of a process that used grpc.aio listens to the one completion queue's socket,
    and whichever loop reads an event hands it to the loop its call was made on
    (``call_soon_threadsafe``). A call an earlier test left pending when its loop closed (each test
    runs its own ``asyncio.run``) can complete while a later test's loop runs; handing it on then
    raises ``RuntimeError('Event loop is closed')``, which that later loop logs at ERROR. A daemon runs
    one loop for its life, so this is an artefact of many loops in one test process."""
    if record.name != "asyncio" or record.exc_info is None:
        return False
    error = record.exc_info[1]
    return (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            and "PollerCompletionQueue._handle_events" in record.getMessage())


def own_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """``records`` without grpc.aio's reports of events that belong to loops already closed."""
    return [r for r in records if not _is_a_closed_loops_grpc_event(r)]


def errors_logged(records: list[logging.LogRecord]) -> list[str]:
    """The messages of ``own_records(records)`` at ERROR or above."""
    return [r.getMessage() for r in own_records(records) if r.levelno >= logging.ERROR]
