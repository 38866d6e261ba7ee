from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_tokens", "mrope_positions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    mrope_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., mrope_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateStarted(_message.Message):
    __slots__ = ("request_id", "prefill_address", "prefill_engine_id", "transport", "transfer_bytes", "transfer_regions", "transfer_ms", "queue_ms", "prefill_ms", "exposed_transfer_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_REGIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_address: str
    prefill_engine_id: str
    transport: str
    transfer_bytes: int
    transfer_regions: int
    transfer_ms: float
    queue_ms: float
    prefill_ms: float
    exposed_transfer_ms: float
    def __init__(self, request_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., prefill_engine_id: _Optional[str] = ..., transport: _Optional[str] = ..., transfer_bytes: _Optional[int] = ..., transfer_regions: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., exposed_transfer_ms: _Optional[float] = ...) -> None: ...

class GenerateTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateFinished(_message.Message):
    __slots__ = ("output_digest", "state_digest", "num_tokens", "steps", "drafts_proposed", "drafts_accepted", "ttft_ms", "total_ms")
    OUTPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    output_digest: str
    state_digest: str
    num_tokens: int
    steps: int
    drafts_proposed: int
    drafts_accepted: int
    ttft_ms: float
    total_ms: float
    def __init__(self, output_digest: _Optional[str] = ..., state_digest: _Optional[str] = ..., num_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., drafts_proposed: _Optional[int] = ..., drafts_accepted: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "tokens", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: GenerateStarted
    tokens: GenerateTokens
    finished: GenerateFinished
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., tokens: _Optional[_Union[GenerateTokens, _Mapping]] = ..., finished: _Optional[_Union[GenerateFinished, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_json", "layout_hash", "max_prompt_tokens", "max_new_tokens", "vocab_size")
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_json: str
    layout_hash: str
    max_prompt_tokens: int
    max_new_tokens: int
    vocab_size: int
    def __init__(self, model_json: _Optional[str] = ..., layout_hash: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...
