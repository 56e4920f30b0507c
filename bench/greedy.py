"""When two engines' greedy outputs can be compared token for token.

A greedy output is the same on two engines only where every step's argmax wins by more than
float rounding. A request's logits move with what it is batched with and on how many threads
(oneMKL computes calls of under 4 rows, and at 2 threads a split's last rows, with other
kernels: up to 3e-5 in a logprob in process), and in a cluster its KV comes from another
process. The 32-stream parity test's prompt 29 had a step whose top two logprobs were 1.9e-4
apart, and it flipped in two of 14 runs one afternoon. 2e-3 is ~60x what rounding moved.
"""
from __future__ import annotations

MIN_GREEDY_GAP = 2e-3


def greedy_is_decisive(out, max_tokens: int) -> bool:
    """Whether each of the first ``max_tokens`` steps of ``out`` (a greedy RequestOutput with
    logprobs=2) won by MIN_GREEDY_GAP at least."""
    return min(t.top[0].logprob - t.top[1].logprob
               for t in out.logprobs[:max_tokens]) >= MIN_GREEDY_GAP
