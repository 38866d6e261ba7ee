"""The router's settings: where its prefill and decode instances are, where it listens, its timeouts and
limits, and its credentials (secrets never appear in a repr, a log line or ``/health``)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

DEFAULT_PORT = 8000
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_PREFILL_TIMEOUT_S = 300.0
DEFAULT_DECODE_TIMEOUT_S = 600.0
DEFAULT_COOLDOWN_S = 10.0
DEFAULT_BACKEND_KEEPALIVE_S = 4.0  # under vLLM's 5 s (uvicorn's keep-alive): the backend never closes one first
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 120.0  # 64 MiB at about 5 MB/s
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_BODY_MB = 64.0  # long prompts as token ids
DEFAULT_HEALTH_CHECK_S = 5.0
DEFAULT_HEALTH_TIMEOUT_S = 3.0
DEFAULT_RETRY_PAUSE_S = 0.5
DEFAULT_PREFIX_BLOCK_TOKENS = 16  # vLLM's default block size: its prefix cache keeps whole blocks
DEFAULT_PREFIX_TABLE_SIZE = 100_000  # prefix hashes kept (8 bytes each, with the URL it went to)
DEFAULT_AFFINITY_MARGIN_TOKENS = 8192
DEFAULT_DISCOVERY_S = 5.0
MAX_ENGINE_ID_CHARS = 250  # a decode engine_id a request may name (the connector's limit, less its prefix)
DNS_PREFIX = "dns:///"
API_KEY_ENV = "KPOOLPD_ROUTER_API_KEY"
BACKEND_API_KEY_ENV = "KPOOLPD_BACKEND_API_KEY"
PEER_TOKEN_ENV = "KPOOLPD_PEER_TOKEN"


def instance_url(text: str) -> str:
    """``text`` as a base URL (``http://host:port``, no trailing slash), or a DNS target
    (``dns:///name:port``, every address the name resolves to, over http); ValueError naming it otherwise."""
    url = text.strip().rstrip("/")
    if url.startswith(DNS_PREFIX):
        host, sep, port = url.removeprefix(DNS_PREFIX).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"instance {text!r}: a DNS target is {DNS_PREFIX}NAME:PORT")
        return url
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
    instance's next bytes (its whole answer when the client does not stream, and to a request passed
    through: /v1/models, /version, /tokenize, /detokenize). An instance that failed
    is tried last for ``cooldown_s``; a role with one instance tries it once more after ``retry_pause_s``.

    Toward the instances: an idle pooled connection is closed after ``backend_keepalive_s`` (keep it
    under the instances' own idle timeout, vLLM's 5 s); each instance's ``GET /health`` is probed every
    ``health_check_s`` (0: never), each probe given ``health_timeout_s``.

    Toward clients: a request's headers must arrive within ``header_timeout_s`` of its first byte (or of
    its connection's opening), its body within ``body_timeout_s`` of its headers; a body over
    ``max_body_mb`` MiB is refused (413); at most ``max_connections`` client connections are held.

    ``api_key``: when set, /v1/* requires ``Authorization: Bearer <api_key>`` and the client's
    Authorization is not forwarded; ``backend_api_key`` is then what the instances get (when set).
    ``peer_token``: the fleet's peer token, which the grant releaser proves to a producer to release a grant.

    Choice (``instances``): prompts are hashed in blocks of ``prefix_block_tokens`` tokens (text: 4 bytes a
    token), at most ``prefix_table_size`` hashes are kept per role, and a prompt goes where its longest known
    prefix went unless that instance's outstanding tokens exceed the least loaded one's by more than
    ``affinity_margin_tokens``. An instance given as ``dns:///NAME:PORT`` stands for every address NAME
    resolves to, re-resolved every ``discovery_s`` (a Kubernetes headless Service)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    decode_timeout_s: float = DEFAULT_DECODE_TIMEOUT_S
    cooldown_s: float = DEFAULT_COOLDOWN_S
    retry_pause_s: float = DEFAULT_RETRY_PAUSE_S
    backend_keepalive_s: float = DEFAULT_BACKEND_KEEPALIVE_S
    health_check_s: float = DEFAULT_HEALTH_CHECK_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    api_key: str | None = field(default=None, repr=False)
    backend_api_key: str | None = field(default=None, repr=False)
    peer_token: str | None = field(default=None, repr=False)
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS
    prefix_table_size: int = DEFAULT_PREFIX_TABLE_SIZE
    affinity_margin_tokens: int = DEFAULT_AFFINITY_MARGIN_TOKENS
    discovery_s: float = DEFAULT_DISCOVERY_S
    decode_engine_ids: tuple[tuple[str, str], ...] = ()  # (decode URL, its vLLM engine_id): named to the producer

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
        for name in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s", "backend_keepalive_s",
                     "health_timeout_s", "header_timeout_s", "body_timeout_s", "max_body_mb"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        for name in ("cooldown_s", "retry_pause_s", "health_check_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must not be negative, got {value}")
        for name in ("prefix_block_tokens", "prefix_table_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.affinity_margin_tokens < 0:
            raise ValueError(f"affinity_margin_tokens must not be negative, got {self.affinity_margin_tokens}")
        if not (self.discovery_s > 0 and math.isfinite(self.discovery_s)):
            raise ValueError(f"discovery_s must be positive and finite, got {self.discovery_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        for name in ("api_key", "backend_api_key", "peer_token"):
            value = getattr(self, name)
            if value is not None and (not value or not value.isascii() or not value.isprintable()):
                raise ValueError(f"{name} must be a non-empty printable ASCII string (its value is not shown)")
        named = tuple((instance_url(url), engine_id) for url, engine_id in self.decode_engine_ids)
        for url, engine_id in named:
            if url not in self.listed("decode"):
                raise ValueError(f"--decode-engine-id names {url}, which is not a decode instance given by URL "
                                 f"(--decode: {list(self.listed('decode'))})")
            if not 0 < len(engine_id) <= MAX_ENGINE_ID_CHARS or not engine_id.isascii() or not engine_id.isprintable():
                raise ValueError(f"--decode-engine-id for {url}: the engine_id must be 1 to {MAX_ENGINE_ID_CHARS} "
                                 f"printable ASCII characters, got {engine_id[:64]!r}")
        if len({url for url, _ in named}) != len(named):
            raise ValueError(f"--decode-engine-id names a decode instance twice: {[url for url, _ in named]}")
        object.__setattr__(self, "decode_engine_ids", named)

    def engine_id_of(self, url: str) -> str | None:
        """The vLLM engine_id ``--decode-engine-id`` gives the decode instance at ``url``, else None."""
        return next((engine_id for known, engine_id in self.decode_engine_ids if known == url), None)

    def listed(self, role: str) -> tuple[str, ...]:
        """The URLs of ``role`` ("prefill" or "decode") given as URLs."""
        return tuple(u for u in getattr(self, role) if not u.startswith(DNS_PREFIX))

    def discovered(self, role: str) -> tuple[str, ...]:
        """The DNS targets of ``role`` (``dns:///NAME:PORT``)."""
        return tuple(u for u in getattr(self, role) if u.startswith(DNS_PREFIX))

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of the prefill vllm serve instances (kv_producer), e.g. http://10.0.0.1:8100, "
                             f"or {DNS_PREFIX}NAME:PORT for every address NAME resolves to (a headless Service)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help=f"base URLs of the decode vllm serve instances (kv_consumer), or {DNS_PREFIX}NAME:PORT")
    parser.add_argument("--decode-engine-id", action="append", default=[], metavar="URL=ENGINE_ID",
                        help="the vLLM engine_id of a decode instance given by URL (its --kv-transfer-config's "
                             "engine_id); a request whose decode instance has one is planned to it before its "
                             "prefill, which names it (kv_transfer_params prefetch_by) so that the producer announces "
                             "the prompt's KV to it and it pulls the KV before the decode request arrives; repeat "
                             "for each instance (default: none, each KV pulled when its decode request comes)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    backends = parser.add_argument_group("toward the instances")
    backends.add_argument("--connect-timeout-s", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                          help=f"longest wait to connect to an instance (default {DEFAULT_CONNECT_TIMEOUT_S:g})")
    backends.add_argument("--prefill-timeout-s", type=float, default=DEFAULT_PREFILL_TIMEOUT_S,
                          help=f"longest prefill request (default {DEFAULT_PREFILL_TIMEOUT_S:g})")
    backends.add_argument("--decode-timeout-s", type=float, default=DEFAULT_DECODE_TIMEOUT_S,
                          help="longest wait for the decode instance's next bytes; its whole answer when the client "
                               "does not stream and to a request passed through (/v1/models, /version, /tokenize, "
                               f"/detokenize) (default {DEFAULT_DECODE_TIMEOUT_S:g})")
    backends.add_argument("--cooldown-s", type=float, default=DEFAULT_COOLDOWN_S,
                          help=f"an instance that failed is tried last for this long (default {DEFAULT_COOLDOWN_S:g})")
    backends.add_argument("--retry-pause-s", type=float, default=DEFAULT_RETRY_PAUSE_S,
                          help="when a role's only instance failed (not by a timeout), it is tried once more after "
                               f"this pause (default {DEFAULT_RETRY_PAUSE_S:g})")
    backends.add_argument("--backend-keepalive-s", type=float, default=DEFAULT_BACKEND_KEEPALIVE_S,
                          help="an idle connection to an instance is closed after this long; keep it under the "
                               "instances' own idle timeout, 5 s for vllm serve "
                               f"(default {DEFAULT_BACKEND_KEEPALIVE_S:g})")
    backends.add_argument("--health-check-s", type=float, default=DEFAULT_HEALTH_CHECK_S,
                          help="each instance's GET /health is probed this often; one that does not answer 200 is "
                               "marked down, one that does is marked up; 0: never "
                               f"(default {DEFAULT_HEALTH_CHECK_S:g})")
    backends.add_argument("--health-timeout-s", type=float, default=DEFAULT_HEALTH_TIMEOUT_S,
                          help=f"longest wait for a probe's answer (default {DEFAULT_HEALTH_TIMEOUT_S:g})")
    choice = parser.add_argument_group("choosing instances (by load and by prefix)")
    choice.add_argument("--discovery-s", type=float, default=DEFAULT_DISCOVERY_S,
                        help=f"{DNS_PREFIX}NAME:PORT instances are re-resolved this often (default "
                             f"{DEFAULT_DISCOVERY_S:g})")
    choice.add_argument("--prefix-block-tokens", type=int, default=DEFAULT_PREFIX_BLOCK_TOKENS,
                        help="prompts are hashed in prefixes of whole blocks of this many tokens (text: 4 bytes a "
                             f"token) (default {DEFAULT_PREFIX_BLOCK_TOKENS})")
    choice.add_argument("--prefix-table-size", type=int, default=DEFAULT_PREFIX_TABLE_SIZE,
                        help="prefix hashes remembered per role, the least recently used forgotten first "
                             f"(default {DEFAULT_PREFIX_TABLE_SIZE})")
    choice.add_argument("--affinity-margin-tokens", type=int, default=DEFAULT_AFFINITY_MARGIN_TOKENS,
                        help="a prompt goes where its prefix went before unless that instance has more than this "
                             "many outstanding tokens over the least loaded one "
                             f"(default {DEFAULT_AFFINITY_MARGIN_TOKENS})")
    clients = parser.add_argument_group("toward clients")
    clients.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                         help="a request's headers must arrive within this long of its first byte (or of its "
                              "connection's opening), else 408 and the connection is closed "
                              f"(default {DEFAULT_HEADER_TIMEOUT_S:g})")
    clients.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                         help="a request's body must arrive within this long of its headers, else 408 "
                              f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    clients.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                         help=f"a larger request body is refused with 413 (MiB, default {DEFAULT_MAX_BODY_MB:g})")
    clients.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                         help="client connections held at most; past it the oldest one without a complete request is "
                              f"closed (default {DEFAULT_MAX_CONNECTIONS})")
    keys = parser.add_argument_group("credentials (read from the environment when the flag is not given)")
    keys.add_argument("--api-key", default=None,
                      help="clients must send 'Authorization: Bearer KEY' on /v1/*; their Authorization is then not "
                           f"forwarded (default: ${API_KEY_ENV}; unset: no check, the client's header is forwarded)")
    keys.add_argument("--backend-api-key", default=None,
                      help="sent to the instances as 'Authorization: Bearer KEY' in place of the client's "
                           f"(default: ${BACKEND_API_KEY_ENV})")
    keys.add_argument("--peer-token", default=None,
                      help="the fleet's peer token, proved to a producer (never sent) to release a grant no decode "
                           f"will pull (default: ${PEER_TOKEN_ENV})")


def _from_env(value: str | None, name: str) -> str | None:
    return value if value is not None else (os.environ.get(name) or None)


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(prefill=tuple(args.prefill), decode=tuple(args.decode), host=args.host, port=args.port,
                          connect_timeout_s=args.connect_timeout_s, prefill_timeout_s=args.prefill_timeout_s,
                          decode_timeout_s=args.decode_timeout_s, cooldown_s=args.cooldown_s,
                          retry_pause_s=args.retry_pause_s, backend_keepalive_s=args.backend_keepalive_s,
                          health_check_s=args.health_check_s, health_timeout_s=args.health_timeout_s,
                          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                          max_body_mb=args.max_body_mb, max_connections=args.max_connections,
                          api_key=_from_env(args.api_key, API_KEY_ENV),
                          backend_api_key=_from_env(args.backend_api_key, BACKEND_API_KEY_ENV),
                          peer_token=_from_env(args.peer_token, PEER_TOKEN_ENV),
                          discovery_s=args.discovery_s, prefix_block_tokens=args.prefix_block_tokens,
                          prefix_table_size=args.prefix_table_size, affinity_margin_tokens=args.affinity_margin_tokens,
                          decode_engine_ids=tuple(engine_pair(text) for text in args.decode_engine_id))


def engine_pair(text: str) -> tuple[str, str]:
    """``--decode-engine-id URL=ENGINE_ID`` as (URL, ENGINE_ID); ValueError naming the value otherwise."""
    url, sep, engine_id = text.rpartition("=")
    if not sep or not url or not engine_id:
        raise ValueError(f"--decode-engine-id takes URL=ENGINE_ID, got {text!r}")
    return url, engine_id
