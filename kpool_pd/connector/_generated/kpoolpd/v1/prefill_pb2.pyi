from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_UCX: _ClassVar[Transport]
    TRANSPORT_GRPC_STREAM: _ClassVar[Transport]

class PoolKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_KIND_UNSPECIFIED: _ClassVar[PoolKind]
    POOL_KIND_BLOCKS: _ClassVar[PoolKind]
    POOL_KIND_RINGS: _ClassVar[PoolKind]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_UCX: Transport
TRANSPORT_GRPC_STREAM: Transport
POOL_KIND_UNSPECIFIED: PoolKind
POOL_KIND_BLOCKS: PoolKind
POOL_KIND_RINGS: PoolKind

class Layout(_message.Message):
    __slots__ = ("layout_hash", "fields_json", "block_bytes", "ring_block_bytes")
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RING_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout_hash: str
    fields_json: str
    block_bytes: int
    ring_block_bytes: int
    def __init__(self, layout_hash: _Optional[str] = ..., fields_json: _Optional[str] = ..., block_bytes: _Optional[int] = ..., ring_block_bytes: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "layout", "transports", "ucx_worker_address", "model_identity", "ucx_warmup_tag", "engine_secret", "protocol_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    UCX_WARMUP_TAG_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: Layout
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    ucx_worker_address: bytes
    model_identity: str
    ucx_warmup_tag: int
    engine_secret: bytes
    protocol_version: int
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., ucx_worker_address: _Optional[bytes] = ..., model_identity: _Optional[str] = ..., ucx_warmup_tag: _Optional[int] = ..., engine_secret: _Optional[bytes] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "layout", "transports", "ucx_worker_address", "lease_ms", "max_prompt_tokens", "chunk_bytes", "model_identity", "pull_session", "engine_secret", "pull_session_idle_ms", "protocol_version", "push", "pull_batches", "piece_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PULL_SESSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    PULL_SESSION_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PIECE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: Layout
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    ucx_worker_address: bytes
    lease_ms: int
    max_prompt_tokens: int
    chunk_bytes: int
    model_identity: str
    pull_session: bool
    engine_secret: bytes
    pull_session_idle_ms: int
    protocol_version: int
    push: bool
    pull_batches: bool
    piece_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., ucx_worker_address: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., model_identity: _Optional[str] = ..., pull_session: _Optional[bool] = ..., engine_secret: _Optional[bytes] = ..., pull_session_idle_ms: _Optional[int] = ..., protocol_version: _Optional[int] = ..., push: _Optional[bool] = ..., pull_batches: _Optional[bool] = ..., piece_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "engine_id", "pipelined", "dcp_engine_ids", "dcp_interleave", "engine_secret", "mrope_positions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    DCP_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    DCP_INTERLEAVE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    engine_id: str
    pipelined: bool
    dcp_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    dcp_interleave: int
    engine_secret: bytes
    mrope_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., engine_id: _Optional[str] = ..., pipelined: _Optional[bool] = ..., dcp_engine_ids: _Optional[_Iterable[str]] = ..., dcp_interleave: _Optional[int] = ..., engine_secret: _Optional[bytes] = ..., mrope_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class RingRange(_message.Message):
    __slots__ = ("start_slot", "num_slots")
    START_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    start_slot: int
    num_slots: int
    def __init__(self, start_slot: _Optional[int] = ..., num_slots: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "grant_id", "prompt_len", "num_blocks", "ring_live", "first_token", "lease_ms", "src_block_ids", "src_ring_id", "pipelined", "piece_blocks", "prefill_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RING_LIVE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SRC_RING_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    PIECE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    grant_id: str
    prompt_len: int
    num_blocks: int
    ring_live: RingRange
    first_token: int
    lease_ms: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    src_ring_id: int
    pipelined: bool
    piece_blocks: int
    prefill_ms: float
    def __init__(self, request_id: _Optional[str] = ..., grant_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., num_blocks: _Optional[int] = ..., ring_live: _Optional[_Union[RingRange, _Mapping]] = ..., first_token: _Optional[int] = ..., lease_ms: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., src_ring_id: _Optional[int] = ..., pipelined: _Optional[bool] = ..., piece_blocks: _Optional[int] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("grant_id", "engine_id", "transport", "integrity", "ucx_tag_base", "dcp_rank", "engine_secret", "regions")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    UCX_TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    DCP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    engine_id: str
    transport: Transport
    integrity: bool
    ucx_tag_base: int
    dcp_rank: int
    engine_secret: bytes
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, grant_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., integrity: _Optional[bool] = ..., ucx_tag_base: _Optional[int] = ..., dcp_rank: _Optional[int] = ..., engine_secret: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("kind", "offset", "nbytes", "plane")
    KIND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    kind: PoolKind
    offset: int
    nbytes: int
    plane: int
    def __init__(self, kind: _Optional[_Union[PoolKind, str]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., plane: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("region", "offset", "data")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    region: int
    offset: int
    data: bytes
    def __init__(self, region: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullDone(_message.Message):
    __slots__ = ("bytes", "regions", "crc32", "send_ms", "sent_after_prefill_ms")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    SENT_AFTER_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    regions: int
    crc32: _containers.RepeatedScalarFieldContainer[int]
    send_ms: float
    sent_after_prefill_ms: float
    def __init__(self, bytes: _Optional[int] = ..., regions: _Optional[int] = ..., crc32: _Optional[_Iterable[int]] = ..., send_ms: _Optional[float] = ..., sent_after_prefill_ms: _Optional[float] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token", "prefill_ms", "after_prompt_ms", "sent_ms")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    AFTER_PROMPT_MS_FIELD_NUMBER: _ClassVar[int]
    SENT_MS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    prefill_ms: float
    after_prompt_ms: float
    sent_ms: float
    def __init__(self, first_token: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., after_prompt_ms: _Optional[float] = ..., sent_ms: _Optional[float] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("chunk", "done", "prefilled", "granted")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    done: PullDone
    prefilled: PrefillDone
    granted: PrefillResponse
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., done: _Optional[_Union[PullDone, _Mapping]] = ..., prefilled: _Optional[_Union[PrefillDone, _Mapping]] = ..., granted: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("prefill", "transport", "integrity", "ucx_tag_base", "regions")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    UCX_TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillRequest
    transport: Transport
    integrity: bool
    ucx_tag_base: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., transport: _Optional[_Union[Transport, str]] = ..., integrity: _Optional[bool] = ..., ucx_tag_base: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class PullSessionRequest(_message.Message):
    __slots__ = ("pull", "cancel_grant_id", "pulls")
    PULL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    cancel_grant_id: str
    pulls: PullBatch
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., cancel_grant_id: _Optional[str] = ..., pulls: _Optional[_Union[PullBatch, _Mapping]] = ...) -> None: ...

class PullBatch(_message.Message):
    __slots__ = ("pulls",)
    PULLS_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ...) -> None: ...

class PullFailure(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PullSessionResponse(_message.Message):
    __slots__ = ("grant_id", "response", "failure")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    response: PullResponse
    failure: PullFailure
    def __init__(self, grant_id: _Optional[str] = ..., response: _Optional[_Union[PullResponse, _Mapping]] = ..., failure: _Optional[_Union[PullFailure, _Mapping]] = ...) -> None: ...

class PackedPullRequest(_message.Message):
    __slots__ = ("pulls", "ucx_tag", "piece_bytes")
    PULLS_FIELD_NUMBER: _ClassVar[int]
    UCX_TAG_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    ucx_tag: int
    piece_bytes: int
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ..., ucx_tag: _Optional[int] = ..., piece_bytes: _Optional[int] = ...) -> None: ...

class AwaitOffersRequest(_message.Message):
    __slots__ = ("engine_id", "engine_secret", "wait_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_secret: bytes
    wait_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., engine_secret: _Optional[bytes] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class AnnouncedOffer(_message.Message):
    __slots__ = ("grant_id", "params_json")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    params_json: str
    def __init__(self, grant_id: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class AwaitOffersResponse(_message.Message):
    __slots__ = ("offers",)
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    offers: _containers.RepeatedCompositeFieldContainer[AnnouncedOffer]
    def __init__(self, offers: _Optional[_Iterable[_Union[AnnouncedOffer, _Mapping]]] = ...) -> None: ...

class PackedPullResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PullSessionResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PullSessionResponse, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("grant_id", "engine_id", "dcp_rank", "all_ranks", "engine_secret")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DCP_RANK_FIELD_NUMBER: _ClassVar[int]
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    engine_id: str
    dcp_rank: int
    all_ranks: bool
    engine_secret: bytes
    def __init__(self, grant_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., dcp_rank: _Optional[int] = ..., all_ranks: _Optional[bool] = ..., engine_secret: _Optional[bytes] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "grant_ids", "engine_secret")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECRET_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    grant_ids: _containers.RepeatedScalarFieldContainer[str]
    engine_secret: bytes
    def __init__(self, engine_id: _Optional[str] = ..., grant_ids: _Optional[_Iterable[str]] = ..., engine_secret: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("unknown_grant_ids", "lease_ms", "engine_unknown")
    UNKNOWN_GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    unknown_grant_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ms: int
    engine_unknown: bool
    def __init__(self, unknown_grant_ids: _Optional[_Iterable[str]] = ..., lease_ms: _Optional[int] = ..., engine_unknown: _Optional[bool] = ...) -> None: ...
