from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias", "n", "allowed_token_ids", "priority", "prompt_logprobs", "bad_words", "guided_choice", "guided_regex", "guided_json", "guided_whitespace_pattern", "truncate_prompt_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_CHOICE_FIELD_NUMBER: _ClassVar[int]
    GUIDED_REGEX_FIELD_NUMBER: _ClassVar[int]
    GUIDED_JSON_FIELD_NUMBER: _ClassVar[int]
    GUIDED_WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    prompt_logprobs: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    guided_choice: _containers.RepeatedScalarFieldContainer[str]
    guided_regex: str
    guided_json: str
    guided_whitespace_pattern: str
    truncate_prompt_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., guided_choice: _Optional[_Iterable[str]] = ..., guided_regex: _Optional[str] = ..., guided_json: _Optional[str] = ..., guided_whitespace_pattern: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: Logprob
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, sampled: _Optional[_Union[Logprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class StopReason(_message.Message):
    __slots__ = ("stop_token_id", "stop_string")
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    stop_token_id: int
    stop_string: str
    def __init__(self, stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("worker_id", "worker_address", "backend", "rank_handles", "block_ids", "num_tokens", "block_size", "lease_timeout_s", "lease_id", "mac", "lease_expires_unix_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RANK_HANDLES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    backend: str
    rank_handles: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_size: int
    lease_timeout_s: float
    lease_id: str
    mac: bytes
    lease_expires_unix_s: float
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., backend: _Optional[str] = ..., rank_handles: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., lease_id: _Optional[str] = ..., mac: _Optional[bytes] = ..., lease_expires_unix_s: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "model", "block_size", "tensor_parallel_size", "kv_transfer_backend", "max_model_len", "kv_cache_layouts", "num_free_blocks", "num_total_blocks", "num_waiting", "num_running", "num_leased", "prefix_cache_queries", "prefix_cache_hits", "num_expired_leases", "num_preemptions", "num_inflight", "draining", "kv_bytes_transferred", "kv_transfer_failures", "kv_peers_connected", "num_quarantined", "prefix_cache_partial_hits", "model_fingerprint", "prefix_cache_evictions", "leases_forgotten", "leases_forget_reading", "leases_forget_no_room")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_PEERS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_PARTIAL_HITS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    LEASES_FORGET_READING_FIELD_NUMBER: _ClassVar[int]
    LEASES_FORGET_NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    model: str
    block_size: int
    tensor_parallel_size: int
    kv_transfer_backend: str
    max_model_len: int
    kv_cache_layouts: _containers.RepeatedScalarFieldContainer[str]
    num_free_blocks: int
    num_total_blocks: int
    num_waiting: int
    num_running: int
    num_leased: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_expired_leases: int
    num_preemptions: int
    num_inflight: int
    draining: bool
    kv_bytes_transferred: int
    kv_transfer_failures: int
    kv_peers_connected: int
    num_quarantined: int
    prefix_cache_partial_hits: int
    model_fingerprint: str
    prefix_cache_evictions: int
    leases_forgotten: int
    leases_forget_reading: int
    leases_forget_no_room: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., kv_transfer_backend: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_cache_layouts: _Optional[_Iterable[str]] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_leased: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_expired_leases: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_inflight: _Optional[int] = ..., draining: _Optional[bool] = ..., kv_bytes_transferred: _Optional[int] = ..., kv_transfer_failures: _Optional[int] = ..., kv_peers_connected: _Optional[int] = ..., num_quarantined: _Optional[int] = ..., prefix_cache_partial_hits: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., prefix_cache_evictions: _Optional[int] = ..., leases_forgotten: _Optional[int] = ..., leases_forget_reading: _Optional[int] = ..., leases_forget_no_room: _Optional[int] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerPrefixCacheResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerPrefixCacheReset(_message.Message):
    __slots__ = ("worker_id", "role", "reset", "num_blocks_evicted", "num_blocks_in_use", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    reset: bool
    num_blocks_evicted: int
    num_blocks_in_use: int
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., reset: _Optional[bool] = ..., num_blocks_evicted: _Optional[int] = ..., num_blocks_in_use: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
