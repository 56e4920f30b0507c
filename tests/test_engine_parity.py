"""Greedy tokens equal Hugging Face's, token for token, however the engine batches them."""
import random

import pytest

from engine import LLM, SamplingParams
from tests.hf_oracle import hf_greedy, hf_last_logprobs

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "micro-llama"]
MAX_NEW = 20


def _prompts(seed: int, lengths: list[int], shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(5, 7000) for _ in range(shared_prefix)]
    return [prefix + [rng.randint(5, 7000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=PRESETS)
def case(request, preset_path):
    path = str(preset_path(request.param))
    prompts = _prompts(1, [3, 17, 40, 64, 95, 130])
    expected = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    # Random weights must still give varied text, or equality would prove little.
    assert all(len(set(e)) >= MAX_NEW // 2 for e in expected), expected
    return request.param, path, prompts, expected


def _greedy(**kw):
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kw)


def _assert_all_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == stats.num_leased == 0


def test_batch_matches_hf(case):
    name, path, prompts, expected = case
    llm = LLM(path)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    _assert_all_free(llm)


def test_chunked_prefill_matches_hf(case):
    name, path, prompts, expected = case
    # A 24-token budget splits every long prompt into several chunks mixed with decodes.
    llm = LLM(path, max_num_batched_tokens=24)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == expected
    _assert_all_free(llm)


def test_preemption_matches_hf(case):
    name, path, prompts, expected = case
    # 14 blocks of 16 tokens cannot hold six requests at once: some get preempted and redone.
    llm = LLM(path, num_gpu_blocks=14, max_num_batched_tokens=64)
    outs = llm.generate(prompts, _greedy())
    assert llm.engine.get_stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    _assert_all_free(llm)


def test_prefix_cache_hits_match_hf(case, preset_path):
    name, path, _, _ = case
    prompts = _prompts(2, [5, 21, 33], shared_prefix=70)
    expected = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    llm = LLM(path)
    first = llm.generate(prompts[:1], _greedy())
    rest = llm.generate(prompts[1:], _greedy())
    assert [o.token_ids for o in first + rest] == expected
    # All 70 shared: 4 whole blocks, then 6 tokens copied from the first prompt's fifth block.
    assert all(o.num_cached_tokens == 70 for o in rest)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= 2 * 70
    _assert_all_free(llm)
    # Forgotten: the same prompts compute afresh, to the same tokens.
    done = llm.reset_prefix_cache()
    assert done.reset and done.num_blocks_evicted >= 4 and done.num_blocks_in_use == 0
    again = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in again] == expected
    assert again[0].num_cached_tokens == 0


def test_partial_block_hits_match_hf(case):
    """Prefixes that end inside a cached block: a second turn that goes on from 10 tokens of
    the first turn's output, and two prompts sharing 70 tokens admitted in the same step,
    where the second must not copy the first's fifth block before the step computes it."""
    name, path, prompts, expected = case
    llm = LLM(path)
    turn1 = prompts[3]  # 64 tokens; its output fills and caches a fifth block
    assert llm.generate([turn1], _greedy())[0].token_ids == expected[3]
    turn2 = turn1 + expected[3][:10] + [11, 12, 13]
    same_step = _prompts(5, [30, 9], shared_prefix=70)  # the first fills its fifth block
    outs = llm.generate([turn2] + same_step, _greedy())
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, MAX_NEW)
                                          for p in [turn2] + same_step]
    assert [o.num_cached_tokens for o in outs] == [74, 0, 64]
    assert llm.engine.kv_manager.stats.partial_hits == 10
    _assert_all_free(llm)


def test_partial_block_hits_can_be_turned_off(preset_path):
    llm = LLM(str(preset_path("tiny-llama")), enable_partial_block_hits=False)
    prompts = _prompts(2, [5, 21], shared_prefix=70)
    llm.generate(prompts[:1], _greedy())
    assert llm.generate(prompts[1:], _greedy())[0].num_cached_tokens == 64
    assert llm.engine.kv_manager.stats.partial_hits == 0


def test_a_prefix_cache_reset_waits_for_no_request_to_hold_blocks(preset_path):
    prompts = _prompts(1, [3, 17, 40, 64, 95, 130])
    llm = LLM(str(preset_path("tiny-llama")))
    llm.generate(prompts[1:3], _greedy())
    llm.engine.add_request("held", prompts[4], _greedy())
    llm.engine.step()  # its prompt's blocks are held now
    refused = llm.reset_prefix_cache()
    assert not refused.reset and refused.num_blocks_evicted == 0
    assert refused.num_blocks_in_use >= 6
    # Still cached: all but its last token (two whole blocks, and 7 tokens of the third, which
    # its first run filled with its output).
    assert llm.generate(prompts[2:3], _greedy())[0].num_cached_tokens == 39
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache().reset
    assert llm.generate(prompts[2:3], _greedy())[0].num_cached_tokens == 0


def test_prefill_logprobs_match_hf(case):
    name, path, prompts, _ = case
    llm = LLM(path)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        ref = hf_last_logprobs(path, prompt)
        lp = out.logprobs[0]
        assert lp.sampled.token_id == int(ref.argmax())
        for entry in [lp.sampled, *lp.top]:
            assert abs(entry.logprob - float(ref[entry.token_id])) < 1e-4
