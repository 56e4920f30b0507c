"""Priority scheduling (EngineConfig.scheduling_policy="priority", SamplingParams.priority):
admission in (priority, arrival) order, the lowest priority preempted first, the same tokens
either way, and what is refused."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.serving_helpers import random_prompts


def _finish_order(engine: LLMEngine, requests) -> tuple[list[str], dict[str, list[int]]]:
    for rid, prompt, params in requests:  # all queued before the first step
        engine.add_request(rid, prompt, params)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.token_ids
    return order, tokens


def _engine(policy: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", scheduling_policy=policy, **kw))


def test_waiting_requests_run_by_priority_then_arrival():
    prompts = random_prompts(4, seed=51, lo=10, hi=30)
    prios = {"a": 5, "b": 1, "c": 3, "d": 1}
    reqs = [(rid, p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                    priority=prios[rid])) for rid, p in zip("abcd", prompts)]
    order, tokens = _finish_order(_engine("priority", max_num_seqs=1, num_gpu_blocks=64), reqs)
    assert order == ["b", "d", "c", "a"]
    fcfs_reqs = [(rid, p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                 for rid, p in zip("abcd", prompts)]
    fcfs_order, fcfs_tokens = _finish_order(_engine("fcfs", max_num_seqs=1, num_gpu_blocks=64),
                                            fcfs_reqs)
    assert fcfs_order == ["a", "b", "c", "d"] and fcfs_tokens == tokens


def test_the_lowest_priority_is_preempted_first():
    # Two requests that cannot both grow in 8 blocks of 16 tokens: one is preempted.
    prompts = random_prompts(2, seed=52, lo=40, hi=40)

    def run(policy: str, prios: tuple[int, int]):
        engine = _engine(policy, num_gpu_blocks=8)
        reqs = [(rid, p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                        priority=prio))
                for rid, p, prio in zip(("first", "second"), prompts, prios)]
        order, tokens = _finish_order(engine, reqs)
        assert engine.scheduler.num_preemptions > 0
        return order, tokens

    fcfs_order, want = run("fcfs", (0, 0))
    assert fcfs_order == ["first", "second"]  # fcfs preempts the later one
    order, tokens = run("priority", (5, 0))
    assert order == ["second", "first"] and tokens == want  # same tokens after recompute


def test_priority_is_refused_where_it_cannot_apply():
    engine = _engine("fcfs", num_gpu_blocks=16)
    with pytest.raises(ValueError, match="scheduling policy priority"):
        engine.add_request("x", [1, 2, 3], SamplingParams(priority=1))
    with pytest.raises(ValueError, match="32-bit integer"):
        SamplingParams(priority=2**31)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(model="tiny-llama", scheduling_policy="lifo")
