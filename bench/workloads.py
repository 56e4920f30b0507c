"""Benchmark workloads: seeded random prompts and output lengths."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class OfflineWorkload:
    name: str
    model: str
    num_requests: int
    prompt_len: tuple[int, int]  # uniform, inclusive
    output_len: tuple[int, int]
    dtype: str = "float32"
    seed: int = 0


WORKLOADS = {
    "tiny": OfflineWorkload("tiny", "tiny-llama", 64, (32, 512), (32, 256)),
    # Real Qwen3-0.6B shapes on 2 CPU cores: fewer and shorter requests keep it to minutes.
    "qwen3-0.6b-shape": OfflineWorkload("qwen3-0.6b-shape", "qwen3-0.6b-shape", 16,
                                        (32, 256), (16, 64)),
}


@dataclass
class OfflineRequests:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` random prompt token ids, clear of the special tokens at the top of small
    vocabularies."""
    hi = max(2, min(vocab_size, 8000) - 1)
    return [rng.randint(1, hi) for _ in range(n)]


def make_requests(w: OfflineWorkload, vocab_size: int, num_requests: int | None = None) -> OfflineRequests:
    if num_requests is not None and (isinstance(num_requests, bool) or num_requests < 1):
        # 0 read as "unset" ran the workload's own count instead.
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(w.seed)
    n = w.num_requests if num_requests is None else num_requests
    prompts, outs = [], []
    for _ in range(n):
        prompts.append(random_tokens(rng, rng.randint(*w.prompt_len), vocab_size))
        outs.append(rng.randint(*w.output_len))
    return OfflineRequests(prompts, outs)
