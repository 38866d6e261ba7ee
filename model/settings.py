"""Daemon configuration in layers: command-line flags win over environment variables, which win
over a YAML file, which wins over the defaults.

The YAML file (``--config PATH`` or ``KPOOLPD_CONFIG``) holds option names (dashes or
underscores) at the top level for both daemons, and optionally a ``prefill:`` and a ``decode:``
section for one of them, so one file (a Kubernetes ConfigMap) can serve both. Environment
variables are ``KPOOLPD_<NAME>`` (``--metrics-port`` -> ``KPOOLPD_METRICS_PORT``). Unknown names
in the file and unparsable values anywhere are errors that name the option and the source.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from kvcache import CacheFamily
from model.config import ModelConfig

ENV_PREFIX = "KPOOLPD_"
ROLES = ("prefill", "decode")


class SettingsError(ValueError):
    """A configuration value that cannot be used; the message names the option and its source."""


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


@dataclass(frozen=True)
class Option:
    name: str  # flag name without dashes, e.g. "metrics-port"
    parse: Callable[[Any], Any]
    default: Any
    help: str

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


def _family(text: str) -> str:
    return CacheFamily(text).value


MODEL_OPTIONS = (
    Option("family", _family, "kpool", "cache family: kpool or qsa"),
    Option("layers", int, 2, "model layers"),
    Option("kpool", int, 4, "tokens per kpool pool (kpool family)"),
    Option("ratio", int, 4, "QSA compress ratio (qsa family)"),
    Option("num-spec", int, 0, "draft tokens per decode step"),
    Option("block-size", int, 0, "tokens per block (0: the smallest with 16 pools that the ring divides)"),
    Option("seed", int, 0, "seed of the synthetic model's weights"),
)


def model_config(settings: Mapping[str, Any]) -> ModelConfig:
    return ModelConfig(
        family=CacheFamily(settings["family"]), num_layers=settings["layers"], kpool=settings["kpool"],
        compress_ratio=settings["ratio"], num_spec=settings["num_spec"],
        block_size=settings["block_size"] or None, seed=settings["seed"],
    )


def _read_yaml(path: str, role: str, known: set[str]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    merged: dict[str, Any] = {}
    for scope in (data, data.get(role) or {}):
        if not isinstance(scope, dict):
            raise SettingsError(f"config file {path}: section {role!r} must be a mapping")
        for raw_key, value in scope.items():
            key = str(raw_key).replace("-", "_")
            if scope is data and key in ROLES:
                continue
            if key not in known:
                raise SettingsError(f"config file {path}: unknown option {raw_key!r} (known: {sorted(known)})")
            merged[key] = value
    return merged


def load_settings(role: str, options: Sequence[Option], argv: Sequence[str] | None, *, description: str,
                  env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse ``argv`` for ``role``; returns option key -> value (plus ``config``: the YAML path)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=f"kpool-pd {role}", description=description)
    parser.add_argument("--config", default=None, help=f"YAML file of options (env {ENV_PREFIX}CONFIG)")
    for option in options:
        parser.add_argument(f"--{option.name}", dest=option.key, default=None,
                            help=f"{option.help} (default {option.default!r}; env {option.env})")
    args = parser.parse_args(argv)
    config_path = args.config or env.get(ENV_PREFIX + "CONFIG")
    from_file = _read_yaml(config_path, role, {o.key for o in options}) if config_path else {}
    settings: dict[str, Any] = {"config": config_path}
    for option in options:
        for source, value in (("flag --" + option.name, getattr(args, option.key)), (option.env, env.get(option.env)),
                              (f"config file {config_path}", from_file.get(option.key))):
            if value is not None:
                try:
                    settings[option.key] = option.parse(value)
                except ValueError as exc:
                    raise SettingsError(f"{option.name} from {source}: {exc}") from None
                break
        else:
            settings[option.key] = option.default
    return settings


def _port(text: Any) -> int:
    value = int(text)
    if not -1 <= value <= 65535:
        raise ValueError(f"a port must be in [0, 65535] (or -1: off), got {value}")
    return value


def _positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a number > 0, got {text!r}")
    return value


def _positive_int(text: Any) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected an integer > 0, got {text!r}")
    return value


def service_options(*, port: int, metrics_port: int) -> tuple[Option, ...]:
    """Options every daemon has: where it listens, auth, logs, threads, drain, readiness file."""
    return (
        Option("host", str, "0.0.0.0", "address to bind the gRPC server to"),
        Option("port", _port, port, "gRPC port (0: any free port)"),
        Option("metrics-host", str, "0.0.0.0", "address of the Prometheus /metrics endpoint"),
        Option("metrics-port", _port, metrics_port, "Prometheus /metrics port (0: any free port, -1: off)"),
        Option("token", str, "", "bearer token required on every RPC (empty: none)"),
        Option("engine-id", str, "", "this node's engine id (empty: hostname-pid)"),
        Option("log-level", str, "INFO", "DEBUG, INFO, WARNING or ERROR"),
        Option("log-format", str, "json", "json (one object a line) or text"),
        Option("torch-threads", _positive_int, 1, "torch intra-op threads"),
        Option("drain-s", _positive_float, 30.0, "on SIGTERM, how long in-flight requests may take to finish"),
        Option("ready-file", str, "", "write {grpc_port, metrics_port, pid} here as JSON once ready"),
        Option("lease-s", _positive_float, 30.0, "lease of a prefilled request's blocks"),
        Option("rpc-timeout-s", _positive_float, 10.0, "deadline of one control-plane RPC"),
        Option("transfer-timeout-s", _positive_float, 30.0, "deadline of one transfer"),
        Option("transports", str, "auto", "ucx, grpc, or both comma-separated (auto: ucx when installed, and grpc)"),
        Option("device", _device, "cpu", "where the cache pool and the model live: cpu, cuda or cuda:N"),
        Option("health-port", _port, -1, "a plaintext port serving only grpc.health.v1, for probes that "
                                         "cannot speak TLS (0: any free port, -1: off)"),
    )


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _device(text: Any) -> str:
    value = str(text).strip().lower()
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return value


def resolve_device(text: str) -> torch.device:
    """The torch device that ``--device`` names; SettingsError when it is CUDA and this process
    has no such CUDA device."""
    device = torch.device(text)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise SettingsError(f"device {text}: CUDA is not available here (torch {torch.__version__}, built for CUDA "
                            f"{torch.version.cuda or 'none'}); run with --device cpu or on a machine with a GPU")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise SettingsError(f"device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


positive_int = _positive_int
positive_float = _positive_float
