"""Daemon settings in layers: command-line flags win over environment variables, which win over a
YAML file, which wins over the defaults.

The YAML file (``--config PATH`` or ``KPOOLPD_CONFIG``) holds option names (dashes or
underscores) at the top level for both daemons, and optionally a ``prefill:`` and a ``decode:``
section for one of them, so one file (a Kubernetes ConfigMap) can serve both. Environment
variables are ``KPOOLPD_<NAME>`` (``--metrics-port`` -> ``KPOOLPD_METRICS_PORT``). Unknown names
in the file and unparsable values anywhere are errors that name the option and the source.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kpool_pd.runtime.options import ENV_PREFIX, Option, Role, SettingsError, scalar

CONFIG_ENV = ENV_PREFIX + "CONFIG"
SOURCES = "sources"  # the settings key of where each option's value came from (``source_of``)


def one_line(text: object) -> str:
    """``text`` on one line (a YAML parser's message spans several)."""
    return " ".join(str(text).split())


def _read_yaml(path: str, role: Role, known: set[str]) -> dict[str, Any]:
    """The file's top-level options overlaid with its ``role`` section; keys as settings keys."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise SettingsError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise SettingsError(f"config file {path}: nested too deeply (options are one mapping, with a "
                            f"prefill: and a decode: section)") from None
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"cannot read config file {path}: {one_line(exc)}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    sections = {r.value for r in Role}
    merged: dict[str, Any] = {}
    for scope in (data, data.get(role.value) or {}):
        if not isinstance(scope, dict):
            raise SettingsError(f"config file {path}: section {role.value!r} must be a mapping")
        for raw_key, value in scope.items():
            key = str(raw_key).replace("-", "_")
            if scope is data and key in sections:
                continue
            if key not in known:
                names = ", ".join(sorted(name.replace("_", "-") for name in known))
                raise SettingsError(f"config file {path}: unknown option {raw_key!r} (known: {names})")
            merged[key] = value
    return merged


def argument_parser(role: Role | str, options: Sequence[Option], *, description: str) -> argparse.ArgumentParser:
    """The daemon's command line (``kpool-pd <role> --help``): ``--config`` and one flag per
    option, each defaulting to None so that the loader can tell a flag from its absence."""
    role = Role(role)
    parser = argparse.ArgumentParser(prog=f"kpool-pd {role.value}", description=description)
    parser.add_argument("--config", default=None, help=f"YAML file of options (env {CONFIG_ENV})")
    for option in options:
        default = option.default.value if isinstance(option.default, enum.Enum) else option.default
        choices = f"; one of {', '.join(option.choices)}" if option.choices else ""
        parser.add_argument(f"--{option.name}", dest=option.key, default=None,
                            help=f"{option.help} (default {default!r}{choices}; env {option.env})")
    return parser


def load_settings(role: Role | str, options: Sequence[Option], argv: Sequence[str] | None, *,
                  description: str = "", env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse ``argv`` for ``role``; returns option key -> value, plus ``config`` (the YAML path or
    None) and ``sources`` (option key -> where its value came from, ``source_of``). ``env`` defaults to ``os.environ``. Raises ``SettingsError`` naming the option and the
    source of a bad value; ``--help`` and unknown flags exit through argparse (status 0 and 2)."""
    role = Role(role)
    env = os.environ if env is None else env
    args = argument_parser(role, options, description=description).parse_args(argv)
    config_path = args.config or env.get(CONFIG_ENV)
    from_file = _read_yaml(config_path, role, {o.key for o in options}) if config_path else {}
    settings: dict[str, Any] = {"config": config_path}
    sources: dict[str, str] = {}
    for option in options:
        for source, value in (("flag --" + option.name, getattr(args, option.key)), (option.env, env.get(option.env)),
                              (f"config file {config_path}", from_file.get(option.key))):
            if value is not None:
                try:
                    settings[option.key] = option.parse(scalar(value))
                except (ValueError, TypeError, OverflowError) as exc:
                    raise SettingsError(f"{option.name} from {source}: {one_line(exc)}") from None
                sources[option.key] = source
                break
        else:
            settings[option.key] = option.default
            sources[option.key] = "the default"
    settings[SOURCES] = sources
    return settings


def source_of(settings: Mapping[str, Any], key: str) -> str:
    """Where the setting ``key`` came from: ``flag --name``, ``KPOOLPD_NAME``, ``config file PATH`` or
    ``the default`` (settings that ``load_settings`` did not make: ``the settings``)."""
    return settings.get(SOURCES, {}).get(key, "the settings")
