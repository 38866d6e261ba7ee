"""Closing the UCX address probe's child (``kpool_pd.connector.prefill.ucx_probe.UcxProbe.close``): the child is
killed and gone, and ``close`` returns once asyncio reported its exit, or, where that report never comes (as in a
vLLM TP worker rank), soon after the child's standard error ended, saying so, instead of waiting forever."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

pytest.importorskip("ucxx", reason="the probe child runs ucxx (pip install 'kpool-pd[ucx]')")

from kpool_pd.connector.prefill.ucx_probe import EXIT_STATUS_S, KILLED_S, UcxProbe  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.polling import process_alive, wait_for  # noqa: E402

OPTIONS = {"TLS": "^posix,sysv,cma,xpmem,knem"}


def close_started_probe(lose_exit_report: bool) -> tuple[int, int | None, float]:
    """(the child's pid, the exit status asyncio reported, the seconds ``close`` took) for a started probe;
    ``lose_exit_report``: the child's ``wait`` never returns, as where asyncio never learns of the exit."""
    async def main():
        probe = UcxProbe(OPTIONS)
        await probe.ready()
        proc = probe._proc
        if lose_exit_report:
            never = asyncio.get_running_loop().create_future()
            proc.wait = lambda: never
        started = time.monotonic()
        await asyncio.wait_for(probe.close(), patient(KILLED_S + EXIT_STATUS_S + 10))
        return proc.pid, proc.returncode, time.monotonic() - started
    return asyncio.run(main())


def test_close_waits_for_the_reported_exit_of_the_killed_child():
    pid, status, _ = close_started_probe(lose_exit_report=False)
    assert status == -9, status  # SIGKILL, as reported before close returned
    assert not process_alive(pid)


def test_close_stops_waiting_when_the_exit_is_never_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="kpool_pd.connector.prefill.ucx_probe"):
        pid, _, took_s = close_started_probe(lose_exit_report=True)
    assert took_s < patient(EXIT_STATUS_S + 5), took_s  # its standard error ends at once: no KILLED_S wait
    assert wait_for(lambda: not process_alive(pid), 10), f"the probe child {pid} still runs"
    assert any(f"UCX probe process {pid} was killed and its exit was not reported" in r.getMessage()
               and "standard error ended" in r.getMessage() for r in caplog.records), caplog.text
