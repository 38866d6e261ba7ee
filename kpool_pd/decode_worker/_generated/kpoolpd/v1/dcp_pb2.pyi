from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LandRequest(_message.Message):
    __slots__ = ("request_id", "prefill_address", "grant_id", "prompt_len", "max_tokens", "first_token", "src_block_ids", "src_ring_id", "ring_start_slot", "ring_num_slots", "lease_ms", "transport", "integrity")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SRC_RING_ID_FIELD_NUMBER: _ClassVar[int]
    RING_START_SLOT_FIELD_NUMBER: _ClassVar[int]
    RING_NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_address: str
    grant_id: str
    prompt_len: int
    max_tokens: int
    first_token: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    src_ring_id: int
    ring_start_slot: int
    ring_num_slots: int
    lease_ms: int
    transport: int
    integrity: bool
    def __init__(self, request_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., grant_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., max_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., src_ring_id: _Optional[int] = ..., ring_start_slot: _Optional[int] = ..., ring_num_slots: _Optional[int] = ..., lease_ms: _Optional[int] = ..., transport: _Optional[int] = ..., integrity: _Optional[bool] = ...) -> None: ...

class LandResponse(_message.Message):
    __slots__ = ("transfer_bytes", "transfer_regions", "transfer_ms", "transport")
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_REGIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_bytes: int
    transfer_regions: int
    transfer_ms: float
    transport: int
    def __init__(self, transfer_bytes: _Optional[int] = ..., transfer_regions: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., transport: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DropResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("rank", "free_blocks", "num_blocks", "free_rings", "num_rings", "requests", "steps", "step_seconds", "transfer_bytes", "broken")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_RINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_RINGS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    BROKEN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    free_blocks: int
    num_blocks: int
    free_rings: int
    num_rings: int
    requests: int
    steps: int
    step_seconds: float
    transfer_bytes: int
    broken: str
    def __init__(self, rank: _Optional[int] = ..., free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_rings: _Optional[int] = ..., num_rings: _Optional[int] = ..., requests: _Optional[int] = ..., steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., broken: _Optional[str] = ...) -> None: ...
