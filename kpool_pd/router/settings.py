"""The router's settings: where its prefill and decode instances are, where it listens, its timeouts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORT = 8000
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_PREFILL_TIMEOUT_S = 300.0
DEFAULT_DECODE_TIMEOUT_S = 600.0
DEFAULT_COOLDOWN_S = 10.0


def instance_url(text: str) -> str:
    """``text`` as a base URL (``http://host:port``, no trailing slash); ValueError naming it otherwise."""
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"instance URL {text!r} is not http(s)://HOST[:PORT]")
    if parts.path not in ("", "/v1"):
        raise ValueError(f"instance URL {text!r} has a path {parts.path!r}: give the server's root, e.g. http://host:8100")
    return url.removesuffix("/v1")


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    """``prefill`` and ``decode``: the base URLs of the ``vllm serve`` instances (kv_producer and
    kv_consumer). ``connect_timeout_s`` bounds opening a connection to an instance;
    ``prefill_timeout_s`` a whole prefill request; ``decode_timeout_s`` each wait for the decode
    instance's next bytes (its whole answer when the client does not stream). An instance that failed
    is tried last for ``cooldown_s``."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    decode_timeout_s: float = DEFAULT_DECODE_TIMEOUT_S
    cooldown_s: float = DEFAULT_COOLDOWN_S

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            urls = getattr(self, role)
            if not urls:
                raise ValueError(f"the router needs at least one {role} instance (--{role} URL)")
            normal = tuple(instance_url(u) for u in urls)
            if len(set(normal)) != len(normal):
                raise ValueError(f"{role} instances are listed twice: {list(urls)}")
            object.__setattr__(self, role, normal)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not in 0..65535")
        for name in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must not be negative, got {self.cooldown_s}")


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of the prefill vllm serve instances (kv_producer), e.g. http://10.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URLs of the decode vllm serve instances (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument("--connect-timeout-s", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                        help=f"longest wait to connect to an instance (default {DEFAULT_CONNECT_TIMEOUT_S:g})")
    parser.add_argument("--prefill-timeout-s", type=float, default=DEFAULT_PREFILL_TIMEOUT_S,
                        help=f"longest prefill request (default {DEFAULT_PREFILL_TIMEOUT_S:g})")
    parser.add_argument("--decode-timeout-s", type=float, default=DEFAULT_DECODE_TIMEOUT_S,
                        help="longest wait for the decode instance's next bytes; its whole answer when the client "
                             f"does not stream (default {DEFAULT_DECODE_TIMEOUT_S:g})")
    parser.add_argument("--cooldown-s", type=float, default=DEFAULT_COOLDOWN_S,
                        help=f"an instance that failed is tried last for this long (default {DEFAULT_COOLDOWN_S:g})")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(prefill=tuple(args.prefill), decode=tuple(args.decode), host=args.host, port=args.port,
                          connect_timeout_s=args.connect_timeout_s, prefill_timeout_s=args.prefill_timeout_s,
                          decode_timeout_s=args.decode_timeout_s, cooldown_s=args.cooldown_s)
