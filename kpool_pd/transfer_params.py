"""A decode request's ``kv_transfer_params`` (what a client or a router sends a consumer), checked field by
field before anything uses them, and the binding of a producer's grant to its prompt.

The params come from the HTTP client: every field the consumer reads is checked for type and range here,
and a bad one is a ValueError naming the field (``kpool_pd.vllm.guard`` answers it HTTP 400 before the
request reaches the engine; inside the engine such a request computes its prompt itself and the engine
lives on). The producer's address must be one the consumer's configuration allows (``ProducerAllowlist``):
a client cannot make the consumer dial a host of its choosing.

**The grant is bound to its prompt.** The producer holds a request's blocks under the key
``grant_key(grant_id, digest)``, where ``digest = prompt_digest(tokens, block counts)`` covers the prompt's
token ids and its block count in every KV cache group; the params carry the grant id and the producer's
digest. The consumer works the digest out again from *its* request's tokens and blocks: a mismatch is
refused before any byte lands (a failed load), and the key it pulls with is made from its own digest, so
params that claim another prompt's digest name no grant on the producer either. So no client-supplied
params can put one prompt's KV under another prompt's tokens.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MAX_ADDRESS_CHARS = 300
MAX_ID_CHARS = 256
MAX_GROUPS = 64
MAX_BLOCKS = 1 << 20  # blocks a grant may name, all groups together
MAX_BLOCK_ID = (1 << 31) - 1
MAX_TOKENS = 1 << 24
MAX_LEASE_MS = 24 * 3600 * 1000
DEFAULT_LEASE_MS = 30_000
GRANT_ID = re.compile(r"[0-9a-f]{32}")  # the producer draws secrets.token_hex(16)
DIGEST = re.compile(r"[0-9a-f]{64}")
RESOLVE_TTL_S = 30.0  # how long the addresses of an allowed DNS name are kept


def prompt_digest(token_ids: Sequence[int], block_counts: Sequence[int]) -> str:
    """sha256 (hex) of a prompt's token ids and its block count per KV cache group (both sides' own)."""
    # token_ids: [n] ints < 2**63; block_counts: [groups] ints
    head = struct.pack(f"<Q{len(block_counts)}Q", len(block_counts), *block_counts)
    return hashlib.sha256(head + struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def grant_key(grant_id: str, digest: str) -> str:
    """The id the producer holds a grant under: its random id and the digest of the prompt it holds."""
    return f"{grant_id}.{digest}"


def bounded_request_id(request_id: str) -> str:
    """``request_id`` when it fits the connector's ids (at most MAX_ID_CHARS characters), else its head and
    a hash of the whole (the id only names the grant in logs; vLLM's own id of any length stays vLLM's)."""
    if len(request_id) <= MAX_ID_CHARS:
        return request_id
    return f"{request_id[:MAX_ID_CHARS - 66]}..{hashlib.sha256(request_id.encode()).hexdigest()}"


def _field(params: Mapping, key: str, kind: type, *, required: bool = True, default=None):
    if key not in params:
        if required:
            raise ValueError(f"kv_transfer_params[{key!r}] is missing")
        return default
    value = params[key]
    if kind is int and (type(value) is not int):  # bool is an int to Python: not here
        raise ValueError(f"kv_transfer_params[{key!r}] must be an integer, got {_shown(value)}")
    if kind is not int and not isinstance(value, kind):
        raise ValueError(f"kv_transfer_params[{key!r}] must be a {kind.__name__}, got {_shown(value)}")
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def split_host_port(value: str, key: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 in brackets) as (host, port); ValueError naming ``key`` otherwise."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in "/@ \t[]"):
        raise ValueError(f"{key} must be 'host:port' with a port in 1..65535, got {_shown(value)}")
    return host.lower(), int(port)


@dataclass(frozen=True, kw_only=True)
class DecodeParams:
    """The checked ``kv_transfer_params`` of a decode request whose prompt a producer holds."""

    address: str  # "host:port" of the producer's PrefillService
    engine_id: str
    request_id: str
    grant_id: str  # 32 hex characters
    prompt_digest: str  # the producer's digest of the prompt it holds (64 hex characters)
    block_ids: tuple[tuple[int, ...], ...]  # the producer's blocks, one tuple per KV cache group
    num_tokens: int
    lease_s: float

    @property
    def key(self) -> str:
        """The key the producer holds the grant under (its own digest): for a Release."""
        return grant_key(self.grant_id, self.prompt_digest)

    @classmethod
    def parse(cls, params: Mapping) -> "DecodeParams":
        """The params of a ``do_remote_prefill`` request; ValueError naming the first bad field."""
        if not isinstance(params, Mapping):
            raise ValueError(f"kv_transfer_params must be a JSON object, got {_shown(params)}")
        if _field(params, "do_remote_prefill", bool) is not True:
            raise ValueError("kv_transfer_params['do_remote_prefill'] must be true for a decode request")
        address = _field(params, "remote_address", str)
        if len(address) > MAX_ADDRESS_CHARS:
            raise ValueError(f"kv_transfer_params['remote_address'] has {len(address)} characters "
                             f"(limit {MAX_ADDRESS_CHARS})")
        split_host_port(address, "kv_transfer_params['remote_address']")
        ids = {}
        for key in ("remote_engine_id", "remote_request_id"):
            ids[key] = _field(params, key, str, required=False, default="")
            if len(ids[key]) > MAX_ID_CHARS:
                raise ValueError(f"kv_transfer_params[{key!r}] has {len(ids[key])} characters (limit {MAX_ID_CHARS})")
        grant_id = _field(params, "remote_grant_id", str)
        if not GRANT_ID.fullmatch(grant_id):
            raise ValueError(f"kv_transfer_params['remote_grant_id'] must be 32 lowercase hex characters, "
                             f"got {_shown(grant_id)}")
        digest = _field(params, "remote_prompt_digest", str)
        if not DIGEST.fullmatch(digest):
            raise ValueError(f"kv_transfer_params['remote_prompt_digest'] must be 64 lowercase hex characters, "
                             f"got {_shown(digest)}")
        num_tokens = _field(params, "remote_num_tokens", int)
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise ValueError(f"kv_transfer_params['remote_num_tokens'] must be 1 to {MAX_TOKENS}, got {num_tokens}")
        lease_ms = _field(params, "remote_lease_ms", int, required=False, default=DEFAULT_LEASE_MS)
        if not 1 <= lease_ms <= MAX_LEASE_MS:
            raise ValueError(f"kv_transfer_params['remote_lease_ms'] must be 1 to {MAX_LEASE_MS}, got {lease_ms}")
        return cls(address=address, engine_id=ids["remote_engine_id"], request_id=ids["remote_request_id"],
                   grant_id=grant_id, prompt_digest=digest, block_ids=_block_ids(params), num_tokens=num_tokens,
                   lease_s=lease_ms / 1000)


def release_target(params: Mapping) -> tuple[str, str] | None:
    """(address, grant key) of params whose other fields may be bad, when those three fields are good: what
    a Release of the grant needs. None otherwise."""
    try:
        address = _field(params, "remote_address", str)
        split_host_port(address, "kv_transfer_params['remote_address']")
        grant_id, digest = _field(params, "remote_grant_id", str), _field(params, "remote_prompt_digest", str)
    except ValueError:
        return None
    if len(address) > MAX_ADDRESS_CHARS or not GRANT_ID.fullmatch(grant_id) or not DIGEST.fullmatch(digest):
        return None
    return address, grant_key(grant_id, digest)


def _block_ids(params: Mapping) -> tuple[tuple[int, ...], ...]:
    groups = _field(params, "remote_block_ids", list)
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise ValueError(f"kv_transfer_params['remote_block_ids'] must hold 1 to {MAX_GROUPS} lists (one per "
                         f"KV cache group), got {len(groups)}")
    total = 0
    for index, group in enumerate(groups):
        if not isinstance(group, list):
            raise ValueError(f"kv_transfer_params['remote_block_ids'][{index}] must be a list of block ids, "
                             f"got {_shown(group)}")
        total += len(group)
        if total > MAX_BLOCKS:
            raise ValueError(f"kv_transfer_params['remote_block_ids'] names over {MAX_BLOCKS} blocks")
        for block in group:
            if type(block) is not int or not 0 <= block <= MAX_BLOCK_ID:
                raise ValueError(f"kv_transfer_params['remote_block_ids'][{index}] must hold block ids 0 to "
                                 f"{MAX_BLOCK_ID}, got {_shown(block)}")
    return tuple(tuple(group) for group in groups)


class ProducerAllowlist:
    """The producers a consumer may dial (``kv_connector_extra_config['producers']``): entries
    ``"host:port"`` or ``"host"`` (any port), a host being an IP address or a DNS name. A named address
    is allowed when its host is an entry's (the same name or IP) and the port matches, or when its host is
    an IP address that an entry's DNS name resolves to (a Kubernetes headless Service; names resolved again
    after RESOLVE_TTL_S). A name the client gives is never resolved: only the configured ones are."""

    def __init__(self, entries: Sequence[str], *,
                 resolve: Callable[[str], set[str]] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(entries, str) or not entries:
            raise ValueError("kv_connector_extra_config['producers'] must be a non-empty list of 'host:port' or "
                             f"'host' entries (the producers this consumer may pull from), got {_shown(entries)}")
        self.entries: list[tuple[str, int | None]] = []
        for entry in entries:
            if not isinstance(entry, str) or not entry.strip():
                raise ValueError(f"kv_connector_extra_config['producers'] entries are 'host:port' or 'host', "
                                 f"got {_shown(entry)}")
            text = entry.strip()
            if text.rpartition(":")[2].isdigit() and (":" in text and (text.count(":") == 1 or text.startswith("["))):
                host, port = split_host_port(text, "kv_connector_extra_config['producers'] entry")
                self.entries.append((host, port))
            else:
                self.entries.append((text.strip("[]").lower(), None))
        self._resolve = resolve or _resolve
        self._clock = clock
        self._resolved: dict[str, tuple[float, set[str]]] = {}

    def allows(self, address: str) -> bool:
        """Whether ``address`` (``"host:port"``, checked by ``DecodeParams.parse``) is an allowed producer."""
        host, port = split_host_port(address, "the producer's address")
        ip = _as_ip(host)
        for entry_host, entry_port in self.entries:
            if entry_port is not None and entry_port != port:
                continue
            if host == entry_host or (ip is not None and _as_ip(entry_host) == ip):
                return True
            if ip is not None and _as_ip(entry_host) is None and str(ip) in self._addresses(entry_host):
                return True
        return False

    def _addresses(self, name: str) -> set[str]:
        now = self._clock()
        cached = self._resolved.get(name)
        if cached is None or now - cached[0] > RESOLVE_TTL_S:
            try:
                cached = (now, {str(ipaddress.ip_address(a)) for a in self._resolve(name)})
            except (OSError, ValueError):
                cached = (now, set())
            self._resolved[name] = cached
        return cached[1]


def _as_ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve(name: str) -> set[str]:
    return {info[4][0].split("%", 1)[0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
