"""Conditional disaggregation: when the router lets a decode worker prefill a prompt itself.

As in NVIDIA Dynamo (and vLLM's ``max_local_prefill_length``): remote prefill pays a queue on
the prefill worker plus a KV transfer; a short prompt costs the decode worker little to compute
in its own batch. So a request skips the prefill worker when both hold:

- its uncached prompt (tokens the chosen prefill worker does not already hold) is at most
  ``max_local_prefill_length``: long prompts would stall the decode batch's steps, and a prompt
  mostly cached on the prefill worker is cheap there;
- that prefill worker already has at least ``local_prefill_queue_threshold`` prefill requests
  in flight from this router: an idle prefill worker is the faster place, since prefill there
  does not slow anyone's decode;
- the decode worker has fewer prompts of its own in prefill than the prefill worker has in
  flight: without this, a burst sent nearly every prompt to the decode worker (30 of 32 at
  concurrency 32 with one worker of each), moving the bottleneck instead of sharing it.

A second reason, on by default and independent of the first: the decode worker already holds
more of the prompt than any prefill worker. A chat's next turn is the last prompt, the reply
and a new message; the reply's KV was computed on the decode worker that streamed it, and
decode workers publish their cached blocks to the prefix index too. When one holds at least
``decode_prefix_reuse_min_tokens`` more of the prompt than the chosen prefill worker, and has
to compute no more of it than that lead, it prefills the prompt itself (Dynamo's KV router
weighs every worker's cache the same way): the prefill worker would recompute the reply and
send the whole prompt's KV back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefillConfig:
    # Uncached prompt tokens a decode worker may prefill itself; 0 (the default) turns local
    # prefill off: on the 2-core development VM (one core per worker) it measured no throughput
    # gain, since both cores were already busy, and it keeps prompts away from the prefill
    # workers' published prefix caches. Worth turning on where decode workers have spare
    # compute, as memory-bound GPU decode usually has.
    max_local_prefill_length: int = 0
    # Prefill requests in flight on the best prefill worker from which local prefill starts;
    # 0 sends every short enough prompt to the decode worker (no load balancing).
    local_prefill_queue_threshold: int = 2
    # Prompt tokens a decode worker must hold beyond the chosen prefill worker's cached prefix
    # to prefill the prompt itself (a chat's next turn after its reply); 0 turns that off.
    decode_prefix_reuse_min_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("max_local_prefill_length", "local_prefill_queue_threshold",
                     "decode_prefix_reuse_min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.max_local_prefill_length > 0


def should_prefill_locally(config: LocalPrefillConfig, num_prompt_tokens: int,
                           num_cached_tokens: int, prefill_inflight: int,
                           decode_prefilling: int) -> bool:
    """True when the decode worker should run this prompt instead of the prefill worker.

    ``num_cached_tokens``: the prompt's prefix the chosen prefill worker holds;
    ``prefill_inflight``: that worker's prefill requests in flight from this router;
    ``decode_prefilling``: prompts the decode worker is prefilling itself for this router.
    """
    if not config.enabled:
        return False
    uncached = num_prompt_tokens - min(num_cached_tokens, num_prompt_tokens)
    if uncached > config.max_local_prefill_length:
        return False
    if config.local_prefill_queue_threshold == 0:  # every short prompt, whatever the load
        return True
    return (prefill_inflight >= config.local_prefill_queue_threshold
            and decode_prefilling < prefill_inflight)


def should_reuse_decode_cache(config: LocalPrefillConfig, num_prompt_tokens: int,
                              decode_cached_tokens: int, prefill_cached_tokens: int,
                              decode_prefilling: int = 0,
                              load_cost_tokens: int = 256) -> bool:
    """True when a decode worker holding ``decode_cached_tokens`` of the prompt should prefill
    it, the best prefill worker holding ``prefill_cached_tokens``: its lead, less
    ``load_cost_tokens`` per prompt it is already prefilling for this router
    (``decode_prefilling``; the exchange rate prefill routing uses), is at least
    ``decode_prefix_reuse_min_tokens`` and at least what it has left to compute."""
    if config.decode_prefix_reuse_min_tokens == 0:
        return False
    decode_cached = min(decode_cached_tokens, num_prompt_tokens)
    lead = decode_cached - min(prefill_cached_tokens, num_prompt_tokens)
    lead -= load_cost_tokens * decode_prefilling
    return (lead >= config.decode_prefix_reuse_min_tokens
            and num_prompt_tokens - decode_cached <= lead)
