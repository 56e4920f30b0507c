from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "resume_token_ids", "router_id", "router_incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    router_id: str
    router_incarnation: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., router_id: _Optional[str] = ..., router_incarnation: _Optional[str] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_s", "compute_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "text_delta", "logprobs", "finish_reason", "stop_reason", "kv_handle", "num_cached_tokens", "timings", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    text_delta: str
    logprobs: _common_pb2.TokenLogprobs
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    kv_handle: _common_pb2.KVHandle
    num_cached_tokens: int
    timings: PrefillTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "may_be_read")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAY_BE_READ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    may_be_read: bool
    def __init__(self, request_id: _Optional[str] = ..., may_be_read: _Optional[bool] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "kv_handle", "local_prefill", "resume_token_ids", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    kv_handle: _common_pb2.KVHandle
    local_prefill: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class ForgetLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_timeout_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_timeout_s: float
    def __init__(self, lease_id: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ...) -> None: ...

class ForgetLeaseResponse(_message.Message):
    __slots__ = ("may_be_reading",)
    MAY_BE_READING_FIELD_NUMBER: _ClassVar[int]
    may_be_reading: bool
    def __init__(self, may_be_reading: _Optional[bool] = ...) -> None: ...

class DecodeTimings(_message.Message):
    __slots__ = ("kv_transfer_s", "queue_s", "first_step_s")
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    kv_transfer_s: float
    queue_s: float
    first_step_s: float
    def __init__(self, kv_transfer_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., first_step_s: _Optional[float] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "text_delta", "logprobs", "finish_reason", "stop_reason", "num_cached_tokens", "timings", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    num_cached_tokens: int
    timings: DecodeTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[DecodeTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeStart(_message.Message):
    __slots__ = ("request", "timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    timeout_s: float
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DecodeControl(_message.Message):
    __slots__ = ("start", "cancel", "heartbeat")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    cancel: str
    heartbeat: DecodeHeartbeat
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., cancel: _Optional[str] = ..., heartbeat: _Optional[_Union[DecodeHeartbeat, _Mapping]] = ...) -> None: ...

class DecodeHeartbeat(_message.Message):
    __slots__ = ("interval_s", "misses")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    misses: int
    def __init__(self, interval_s: _Optional[float] = ..., misses: _Optional[int] = ...) -> None: ...

class DecodeError(_message.Message):
    __slots__ = ("code", "message", "refused", "kv_source_failed")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FAILED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    refused: bool
    kv_source_failed: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., refused: _Optional[bool] = ..., kv_source_failed: _Optional[bool] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("request_id", "chunk", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: DecodeChunk
    error: DecodeError
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[DecodeChunk, _Mapping]] = ..., error: _Optional[_Union[DecodeError, _Mapping]] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("events", "closing")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    closing: bool
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ..., closing: _Optional[bool] = ...) -> None: ...
