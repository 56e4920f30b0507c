"""Timed runs for ``pdserve bench gpu``: the engine's step loop and HF ``generate``, both split
into a prefill phase and a decode phase from host timestamps taken as tokens arrive.

The split point is the moment every sequence of the batch holds its first output token. Up to
then the run is dominated by prefill; after it only decode steps remain, so
``decode_tokens / decode_s`` counts just the tokens sampled after that moment over just the time
after it. Both sides sync the device per step anyway (the engine's scheduler needs the sampled
ids on the host; HF ``generate`` reads its stop flag every step), so the stamps cost nothing.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import torch

_request_ids = itertools.count()


@dataclass
class RunTiming:
    num_seqs: int
    output_tokens: int
    e2e_s: float
    prefill_s: float  # start until every sequence had its first output token
    decode_s: float  # from then until the last token
    decode_tokens: int  # tokens sampled within decode_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.e2e_s


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = token_id_limit(vocab_size)
    return [[rng.randint(1, hi) for _ in range(length)] for _ in range(num)]


def token_id_limit(vocab_size: int) -> int:
    # nano-vllm draws ids in [0, 10000]; small vocabularies clip to their own size.
    return max(2, min(vocab_size - 1, 10000))


def build_engine(model: str, device: str, dtype: str, max_num_seqs: int,
                 max_num_batched_tokens: int, enforce_eager: bool = False,
                 num_gpu_blocks: int | None = None, gpu_memory_utilization: float = 0.9):
    from engine import LLM

    return LLM(model, device=device, dtype=dtype, detokenize=False, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
               num_gpu_blocks=num_gpu_blocks, gpu_memory_utilization=gpu_memory_utilization)


def timed_engine_run(llm, prompts: list[list[int]], output_lens: list[int],
                     temperature: float = 0.0) -> RunTiming:
    """Queues every prompt at once and steps the engine until all are done (ignore_eos)."""
    from engine import SamplingParams

    eng = llm.engine
    rids = [f"bench-gpu-{next(_request_ids)}" for _ in prompts]
    produced = dict.fromkeys(rids, 0)
    waiting = len(rids)  # sequences still without a first token
    first_at, tokens_at_first = None, 0
    t0 = time.perf_counter()
    for rid, prompt, n in zip(rids, prompts, output_lens):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=temperature,
                                                    ignore_eos=True))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id not in produced:
                continue
            if produced[out.request_id] == 0 and out.token_ids:
                waiting -= 1
            produced[out.request_id] = len(out.token_ids)
        if first_at is None and waiting == 0:
            first_at, tokens_at_first = time.perf_counter(), sum(produced.values())
    end = time.perf_counter()
    total = sum(produced.values())
    if total != sum(output_lens) or first_at is None:
        raise RuntimeError(f"engine produced {total} tokens, expected {sum(output_lens)}")
    return RunTiming(len(prompts), total, end - t0, first_at - t0, end - first_at,
                     total - tokens_at_first)


def load_hf_model(path, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


class _TokenClock:
    """A transformers streamer that only stamps the host time of each generated step."""

    def __init__(self) -> None:
        self.seen_prompt = False
        self.stamps: list[float] = []

    def put(self, value) -> None:
        if not self.seen_prompt:  # generate hands the prompt over first
            self.seen_prompt = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def timed_hf_run(model, prompts: list[list[int]], max_new: int, device: str,
                 pad_id: int = 0) -> RunTiming:
    """One static batch through ``generate``, left-padded, exactly ``max_new`` tokens each."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = _TokenClock()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                   min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                   pad_token_id=pad_id, streamer=clock)
    end = time.perf_counter()
    if len(clock.stamps) != max_new:
        raise RuntimeError(f"HF generate streamed {len(clock.stamps)} steps, expected {max_new}")
    n = len(prompts)
    return RunTiming(n, n * max_new, end - t0, clock.stamps[0] - t0,
                     clock.stamps[-1] - clock.stamps[0], n * (max_new - 1))
