"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the ones
before it, with its rank and the top-k, against Hugging Face's logits on the same weights,
however the engine splits, batches, caches or preempts the prompt."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import MAX_PROMPT_LOGPROB_TOKENS, Scheduler
from tests.hf_oracle import hf_model

TOP = 3


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(5, 7000) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    logits = hf_model(str(path))(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_hf(path, prompt: list[int], got, top: int = TOP) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    if len(prompt) == 1:
        return
    want = hf_prompt_logprobs(path, prompt)
    targets = torch.tensor(prompt[1:])
    want_lp = want.gather(1, targets.unsqueeze(1)).squeeze(1)
    # Ranks deep in the tail pass near-ties; any rank HF's logprobs allow within 1e-4 will do.
    rank_lo = (want > (want_lp + 1e-4).unsqueeze(1)).sum(dim=-1) + 1
    rank_hi = (want > (want_lp - 1e-4).unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = want.topk(top, dim=-1)
    for i, lp in enumerate(got[1:]):
        assert lp.sampled.token_id == prompt[i + 1]
        assert lp.sampled.logprob == pytest.approx(want_lp[i].item(), abs=2e-3)
        assert rank_lo[i].item() <= lp.sampled.rank <= rank_hi[i].item()
        assert [t.token_id for t in lp.top] == top_ids[i].tolist()
        assert [t.rank for t in lp.top] == list(range(1, top + 1))
        assert [t.logprob for t in lp.top] == pytest.approx(top_lp[i].tolist(), abs=2e-3)
    # Random weights must still score the prompt unevenly, or equality would prove little.
    assert len({lp.sampled.rank for lp in got[1:]}) > min(len(prompt) - 1, 8) // 2


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_chunked_and_batched_prompt_logprobs_match_hf(preset, preset_path):
    path = str(preset_path(preset))
    prompts = _prompts(1, [1, 2, 17, 40, 130])
    # A 24-token budget splits the long prompts into chunks that share steps with decodes
    # and with requests that do not ask for prompt logprobs.
    with LLM(path, max_num_batched_tokens=24) as llm:
        plain = _prompts(2, [30, 9])
        outs = llm.generate(prompts + plain, [_params(prompt_logprobs=TOP)] * len(prompts)
                            + [_params()] * len(plain))
        for p, o in zip(prompts, outs):
            assert_matches_hf(path, p, o.prompt_logprobs)
        assert all(o.prompt_logprobs is None for o in outs[len(prompts):])
        # The sampled tokens are the ones a request without prompt logprobs gets.
        again = llm.generate(prompts, _params())
        assert [o.token_ids for o in again] == [o.token_ids for o in outs[:len(prompts)]]


def test_prompt_logprobs_compute_the_whole_prompt_past_the_prefix_cache(preset_path):
    path = str(preset_path("tiny-llama"))
    prompt = _prompts(3, [70])[0]
    with LLM(path) as llm:
        llm.generate([prompt], _params())  # its blocks are now in the prefix cache
        scored = llm.generate([prompt], _params(prompt_logprobs=0))[0]
        assert scored.num_cached_tokens == 0
        assert_matches_hf(path, prompt, scored.prompt_logprobs, top=0)
        # Requests that do not ask still hit the cache.
        assert llm.generate([prompt], _params())[0].num_cached_tokens == 64


def test_prompt_logprobs_survive_preemption(preset_path):
    path = str(preset_path("tiny-llama"))
    prompts = _prompts(4, [17, 40, 64, 95, 130, 33])
    # 14 blocks of 16 tokens cannot hold six requests at once: some get preempted and redone.
    with LLM(path, num_gpu_blocks=14, max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                    ignore_eos=True, prompt_logprobs=1))
        assert llm.engine.get_stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert_matches_hf(path, p, o.prompt_logprobs, top=1)


def test_a_long_prompt_keeps_at_most_the_cap_of_logit_rows_a_step(preset_path):
    path = str(preset_path("tiny-llama"))
    prompt = _prompts(5, [MAX_PROMPT_LOGPROB_TOKENS + 190])[0]
    with LLM(path, max_num_batched_tokens=2048) as llm:
        out = llm.generate([prompt], _params(prompt_logprobs=2))[0]
        steps = list(llm.engine.step_num_tokens)
    assert steps[:2] == [MAX_PROMPT_LOGPROB_TOKENS, 190]
    assert_matches_hf(path, prompt, out.prompt_logprobs, top=2)


def test_scheduler_shares_the_cap_between_requests():
    cfg = EngineConfig(model="tiny-llama", max_num_batched_tokens=2048, block_size=16)
    sched = Scheduler(cfg, KVCacheManager(256, 16, True))
    wants = [Request(f"r{i}", list(range(1, 401)), _params(prompt_logprobs=0)) for i in range(2)]
    plain = Request("plain", list(range(1001, 1401)), _params())
    for r in (*wants, plain):
        sched.add_request(r)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("r0", 400), ("r1", MAX_PROMPT_LOGPROB_TOKENS - 400), ("plain", 400)]


def test_the_stream_carries_them_from_the_first_token(preset_path):
    prompt = _prompts(6, [25])[0]
    with LLM("tiny-llama") as llm:
        outs = list(llm.stream(prompt, _params(prompt_logprobs=1)))
    assert_matches_hf(str(preset_path("tiny-llama")), prompt, outs[0].prompt_logprobs, top=1)
    assert all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer in"):
        SamplingParams(prompt_logprobs=bad)


def test_tensor_parallel_prompt_logprobs_equal_tp1(preset_path):
    path = str(preset_path("tiny-llama"))
    prompt = _prompts(7, [45])[0]
    with LLM(path, tensor_parallel_size=2, max_num_batched_tokens=32) as llm:
        out = llm.generate([prompt], _params(prompt_logprobs=TOP))[0]
    assert_matches_hf(path, prompt, out.prompt_logprobs)


def test_every_logprob_carries_its_token_as_text(preset_path):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(preset_path("tiny-llama"))
    with LLM("tiny-llama") as llm:
        out = llm.generate(["Paged attention stores the KV cache"],
                           _params(logprobs=3, prompt_logprobs=3))[0]
    items = [lp for lp in [*out.prompt_logprobs[1:], *out.logprobs]]
    assert len(items) == len(out.prompt_token_ids) - 1 + len(out.token_ids)
    for item in items:
        for lp in (item.sampled, *item.top):
            assert lp.decoded_token == tok.decode([lp.token_id], skip_special_tokens=False)
    assert "".join(lp.sampled.decoded_token for lp in out.logprobs) == out.text
