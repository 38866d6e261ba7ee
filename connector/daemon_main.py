"""The common entry of both daemons: settings, TLS and device, logging, the event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from connector.config import TlsConfig
from connector.daemon_tls import tls_config
from model.logs import configure_logging
from model.settings import Option, SettingsError, load_settings, resolve_device

Serve = Callable[..., Awaitable[None]]  # serve(settings, *, device, tls)


def run_daemon(role: str, options: Sequence[Option], serve: Serve, argv: Sequence[str] | None, *,
               description: str) -> int:
    """Parse the settings (flags > env > YAML), then run ``serve`` until it returns.

    A bad setting prints one line naming it and returns 2. After ``serve`` the process exits at
    once (status 0), skipping interpreter teardown of the UCX worker, whose peers may be gone.
    """
    try:
        settings: Mapping[str, Any] = load_settings(role, options, argv, description=description)
        tls: TlsConfig | None = tls_config(settings)
        device = resolve_device(settings["device"])
    except SettingsError as exc:
        print(f"kpool-pd {role}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(role, level=settings["log_level"], fmt=settings["log_format"])
    torch.set_num_threads(settings["torch_threads"])
    asyncio.run(serve(settings, device=device, tls=tls))
    logging.shutdown()
    os._exit(0)
