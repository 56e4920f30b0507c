"""What the engine hands back: per-request outputs, KV leases and stats."""
from __future__ import annotations

from dataclasses import dataclass

from engine.logprobs import TokenLogprobs


@dataclass
class KVLease:
    """Prefill role: the blocks holding a request's prompt KV, kept until released or expired."""

    request_id: str
    block_ids: list[int]
    # Prompt tokens whose K/V is in the blocks (the first sampled token's is not).
    num_tokens: int
    block_size: int
    expires_at: float  # time.monotonic() deadline


@dataclass(frozen=True)
class LeaseEnded:
    """Prefill role: a lease's blocks went back to the cache (released, or ``expired``). Comes
    out of ``LLMEngine.take_kv_events`` after the block events, for the transfer ledger."""

    request_id: str
    expired: bool = False


@dataclass
class KVAllocation:
    """Decode role: where a remotely prefilled request's prompt KV must be written."""

    request_id: str
    block_ids: list[int]
    # Leading tokens already present here through the prefix cache; their blocks need no copy.
    num_cached_tokens: int
    num_tokens: int
    block_size: int

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def block_ids_to_fill(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks:]


@dataclass
class PrefixCacheReset:
    """What ``reset_prefix_cache`` did: forgot every cached block, or nothing while requests
    (or KV leases, or quarantined pulls) held blocks."""

    reset: bool
    # Cached blocks forgotten (0 when refused).
    num_blocks_evicted: int
    # Blocks held when asked: a reset needs none.
    num_blocks_in_use: int


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # All output tokens so far, and the ones new since the last output for this request.
    token_ids: list[int]
    new_token_ids: list[int]
    # The whole output text, on the final output only; streams concatenate text_delta.
    text: str = ""
    text_delta: str = ""
    finished: bool = False
    # "stop", "length" or "abort" once finished.
    finish_reason: str | None = None
    # The stop token id or stop string that ended the request.
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # When asked for, from the first token on: None for the first prompt token (nothing
    # precedes it), then each prompt token's logprob given the ones before it (vLLM's shape).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_lease: KVLease | None = None
    # time.monotonic() stamps: the request's arrival here and its first scheduled step.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_leased: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    num_preemptions: int
    num_expired_leases: int
    num_steps: int
    # Decode role: failed pulls whose blocks are held back until a late write cannot land.
    num_quarantined: int = 0
    # Of prefix_cache_hits: tokens copied from blocks the prompt shared only in part.
    prefix_cache_partial_hits: int = 0
