from google.protobuf import struct_pb2 as _struct_pb2
from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedScalarFieldContainer[str]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[str]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "continue_final_message", "add_generation_prompt", "chat_template_kwargs", "chat_template_name", "tools", "chat_template")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    continue_final_message: bool
    add_generation_prompt: bool
    chat_template_kwargs: _struct_pb2.Struct
    chat_template_name: str
    tools: _containers.RepeatedScalarFieldContainer[str]
    chat_template: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., continue_final_message: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., chat_template_name: _Optional[str] = ..., tools: _Optional[_Iterable[str]] = ..., chat_template: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "resume_token_ids", "expect_model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatPrompt
    sampling: _common_pb2.SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    expect_model: ModelIdentity
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., expect_model: _Optional[_Union[ModelIdentity, _Mapping]] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("name", "fingerprint", "chat_template")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    chat_template: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., chat_template: _Optional[str] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("router_queue_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "decode_queue_s", "first_decode_step_s", "ttft_s", "e2e_s")
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    router_queue_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    kv_transfer_s: float
    decode_queue_s: float
    first_decode_step_s: float
    ttft_s: float
    e2e_s: float
    def __init__(self, router_queue_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_compute_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., decode_queue_s: _Optional[float] = ..., first_decode_step_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "timings", "prefill_worker_id", "decode_worker_id", "local_prefill", "migrations")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: RequestTimings
    prefill_worker_id: str
    decode_worker_id: str
    local_prefill: bool
    migrations: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[RequestTimings, _Mapping]] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., local_prefill: _Optional[bool] = ..., migrations: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "logprobs", "finish_reason", "stop_reason", "usage", "index", "prompt_logprobs", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    usage: Usage
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    model: ModelIdentity
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs", "finish_reason", "stop_reason", "usage")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    usage: Usage
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "stop_reason", "usage", "choices", "prompt_logprobs", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    usage: Usage
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    model: ModelIdentity
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "model_mismatch")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    model_mismatch: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ..., model_mismatch: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("num_prefill_workers", "num_decode_workers", "requests_total", "requests_in_flight", "requests_failed", "prompt_tokens_routed", "prefix_tokens_matched", "requests_prefilled_locally", "requests_prefilled_remotely", "requests_migrated", "migrations_exhausted", "worker_hangs", "decode_waits", "requests_prefilled_on_decode_cache", "requests_rerouted")
    NUM_PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_MATCHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PREFILLED_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PREFILLED_REMOTELY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_HANGS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WAITS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PREFILLED_ON_DECODE_CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REROUTED_FIELD_NUMBER: _ClassVar[int]
    num_prefill_workers: int
    num_decode_workers: int
    requests_total: int
    requests_in_flight: int
    requests_failed: int
    prompt_tokens_routed: int
    prefix_tokens_matched: int
    requests_prefilled_locally: int
    requests_prefilled_remotely: int
    requests_migrated: int
    migrations_exhausted: int
    worker_hangs: int
    decode_waits: int
    requests_prefilled_on_decode_cache: int
    requests_rerouted: int
    def __init__(self, num_prefill_workers: _Optional[int] = ..., num_decode_workers: _Optional[int] = ..., requests_total: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., requests_failed: _Optional[int] = ..., prompt_tokens_routed: _Optional[int] = ..., prefix_tokens_matched: _Optional[int] = ..., requests_prefilled_locally: _Optional[int] = ..., requests_prefilled_remotely: _Optional[int] = ..., requests_migrated: _Optional[int] = ..., migrations_exhausted: _Optional[int] = ..., worker_hangs: _Optional[int] = ..., decode_waits: _Optional[int] = ..., requests_prefilled_on_decode_cache: _Optional[int] = ..., requests_rerouted: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "undrain")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    undrain: bool
    def __init__(self, worker_id: _Optional[str] = ..., undrain: _Optional[bool] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "age_s", "phase", "prefill_worker_id", "decode_worker_id", "prompt_tokens", "output_tokens", "migrations")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    age_s: float
    phase: str
    prefill_worker_id: str
    decode_worker_id: str
    prompt_tokens: int
    output_tokens: int
    migrations: int
    def __init__(self, request_id: _Optional[str] = ..., age_s: _Optional[float] = ..., phase: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., migrations: _Optional[int] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ...) -> None: ...

class CancelRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelRequestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("worker_id", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerPrefixCacheReset]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerPrefixCacheReset, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "block_size", "has_chat_template", "chat_template_names", "sampling_defaults", "eos_token_ids", "identity", "accepts_request_chat_template")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_REQUEST_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    has_chat_template: bool
    chat_template_names: _containers.RepeatedScalarFieldContainer[str]
    sampling_defaults: _common_pb2.SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    identity: ModelIdentity
    accepts_request_chat_template: bool
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., chat_template_names: _Optional[_Iterable[str]] = ..., sampling_defaults: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., identity: _Optional[_Union[ModelIdentity, _Mapping]] = ..., accepts_request_chat_template: _Optional[bool] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("transfer_id", "prefill_worker_id", "prefill_address", "router_id", "router_live", "state", "decode_worker_id", "num_blocks", "num_tokens", "age_s", "expires_in_s", "pull_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_LIVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    PULL_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prefill_worker_id: str
    prefill_address: str
    router_id: str
    router_live: bool
    state: str
    decode_worker_id: str
    num_blocks: int
    num_tokens: int
    age_s: float
    expires_in_s: float
    pull_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., router_id: _Optional[str] = ..., router_live: _Optional[bool] = ..., state: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., age_s: _Optional[float] = ..., expires_in_s: _Optional[float] = ..., pull_s: _Optional[float] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("transfers", "num_omitted")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_OMITTED_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferInfo]
    num_omitted: int
    def __init__(self, transfers: _Optional[_Iterable[_Union[TransferInfo, _Mapping]]] = ..., num_omitted: _Optional[int] = ...) -> None: ...
