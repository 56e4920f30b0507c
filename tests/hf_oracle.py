"""Hugging Face transformers on the same weights: the correctness oracle."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with EOS disabled (the engine runs with ignore_eos)."""
    model = hf_model(str(path))
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_last_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    model = hf_model(str(path))
    logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)
