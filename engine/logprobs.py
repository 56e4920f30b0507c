"""A sampled token's logprobs, as outputs carry them: torch-free, since the router and the
client side read them too (engine/sampler.py computes them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    token_id: int
    logprob: float
    # 1 = the most likely token under the raw distribution.
    rank: int
    # The token as text on its own (vLLM's decoded_token), set where outputs are detokenized.
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    sampled: Logprob
    # The params.logprobs most likely tokens, most likely first.
    top: list[Logprob]
