"""The scheduler under pressure: few KV blocks, a small step budget, prompts sharing a prefix.

After every step each block's ref count must equal the number of block tables holding it (a
leak keeps a block out of use for good; a double free hands one block to two requests), and
the greedy tokens of every request that was not aborted must be Hugging Face's. Admission is
first come, first served: a long prompt queued behind a stream of short ones runs, and the
short ones behind it wait for it, not for ever.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import RequestStatus
from tests.hf_oracle import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(preset_path):
    return str(preset_path("tiny-llama"))


def _prompts(seed: int, lengths: list[int], shared: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(5, 7000) for _ in range(shared)]
    return [prefix + [rng.randint(5, 7000) for _ in range(n)] for n in lengths]


def _check_blocks(engine: LLMEngine) -> None:
    """Every block's ref count is the number of live block tables holding it, exactly the
    unheld blocks are in the free queue, and a held block table covers what was computed."""
    kv = engine.kv_manager
    holders = Counter(b.block_id for blocks in kv._req_blocks.values() for b in blocks)
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
        assert block.in_free_queue == (block.ref_cnt == 0), block
    assert set(kv._req_blocks) <= set(engine.scheduler.requests)
    for req in engine.scheduler.running:
        assert len(kv.get_block_ids(req.request_id)) * kv.block_size >= req.num_computed_tokens


def _all_free(engine: LLMEngine) -> bool:
    s = engine.get_stats()
    return (s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0
            and all(b.ref_cnt == 0 for b in engine.kv_manager.pool.blocks))


def _state(req) -> str:
    if req.status == RequestStatus.PREEMPTED:
        return "preempted"
    if req.status == RequestStatus.WAITING:
        return "waiting"
    return "prefilling" if req.num_computed_tokens < req.num_prompt_tokens else "decoding"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_requests_sharing_a_prefix_keep_ref_counts_and_match_hf(model,
                                                                         prefix_caching):
    # 10 blocks of 16 tokens for seven requests of 45-95 tokens that share 32 prompt tokens
    # (two blocks held by several at once): requests are preempted and resumed, with their
    # prefix from the cache when it is on.
    prompts = _prompts(3, [13, 30, 45, 63, 20, 38, 52], shared=32)
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine = LLMEngine(EngineConfig(model, num_gpu_blocks=10, max_num_batched_tokens=24,
                                    enable_prefix_caching=prefix_caching))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got = {}
    while engine.has_unfinished_requests():
        got.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        _check_blocks(engine)
    assert engine.get_stats().num_preemptions > 0
    assert [got[f"r{i}"] for i in range(len(prompts))] == [hf_greedy(model, p, 12)
                                                            for p in prompts]
    assert _all_free(engine)


def test_aborts_in_every_state_free_each_block_once(model):
    """One request is aborted in each state it can be in: waiting, prefilling (chunked, its
    prefix blocks shared), decoding, preempted, and finished (a no-op)."""
    prompts = _prompts(4, [40, 25, 50, 10, 60, 33, 45, 18, 28, 55], shared=32)
    params = SamplingParams(max_tokens=16, **GREEDY)
    engine = LLMEngine(EngineConfig(model, num_gpu_blocks=10, max_num_batched_tokens=16,
                                    max_num_seqs=4))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    aborted: dict[str, str] = {}  # state -> the request aborted in it
    finished: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for req in list(engine.scheduler.requests.values()):
            state = _state(req)
            shared = state != "prefilling" or any(
                engine.kv_manager.pool.blocks[b].ref_cnt > 1
                for b in engine.kv_manager.get_block_ids(req.request_id))
            if state not in aborted and shared and req.request_id not in aborted.values():
                aborted[state] = req.request_id
                engine.abort(req.request_id)  # idle engine: applied now
                _check_blocks(engine)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice"
                finished[out.request_id] = out.token_ids
                reasons[out.request_id] = out.finish_reason
                if "finished" not in aborted and out.finish_reason == "length":
                    aborted["finished"] = out.request_id
                    engine.abort(out.request_id)
        _check_blocks(engine)
    assert set(aborted) == {"waiting", "prefilling", "decoding", "preempted", "finished"}
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(prompts)))
    for state, rid in aborted.items():
        assert reasons[rid] == ("length" if state == "finished" else "abort"), (state, rid)
    for i, p in enumerate(prompts):
        if reasons[f"r{i}"] == "length":
            assert finished[f"r{i}"] == hf_greedy(model, p, 16)
    assert _all_free(engine)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_long_prompt_behind_a_stream_of_short_ones_runs_in_arrival_order(model, chunked):
    """First come, first served: with a new short request every step, a 142-token prompt
    queued behind a few of them is admitted once they are, and the short ones after it
    are admitted only after it (none overtakes it), each of them in arrival order. Without
    chunked prefill the prompt fits a step only beside at most two decodes: it waits for
    the running ones to drain, which they do as nothing overtakes it."""
    rng = random.Random(5)
    budget = 8 if chunked else 144
    engine = LLMEngine(EngineConfig(model, num_gpu_blocks=16, max_num_batched_tokens=budget,
                                    enable_chunked_prefill=chunked, max_num_seqs=8))
    short = SamplingParams(max_tokens=4, **GREEDY)
    arrivals: list[str] = []
    first_scheduled: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    step = 0
    while step < 40 or engine.has_unfinished_requests():
        if step < 40:
            rid = f"s{step}"
            engine.add_request(rid, [rng.randint(5, 7000) for _ in range(rng.randint(2, 5))],
                               short)
            arrivals.append(rid)
        if step == 3:
            engine.add_request("long", [rng.randint(5, 7000) for _ in range(142)],
                               SamplingParams(max_tokens=4, **GREEDY))
            arrivals.append("long")
        finished_at.update((o.request_id, step) for o in engine.step() if o.finished)
        for req in engine.scheduler.running:
            first_scheduled.setdefault(req.request_id, step)
        step += 1
        assert step < 1000, "requests were never scheduled"
    admitted = sorted(first_scheduled, key=lambda r: (first_scheduled[r], arrivals.index(r)))
    assert admitted == arrivals
    # Served while the short ones still arrive: it waited for those ahead of it only.
    assert finished_at["long"] < 40
    assert _all_free(engine)


def _commit_from(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int],
                 params: SamplingParams) -> None:
    """Prefills ``prompt`` on ``prefill``, copies its KV into ``decode`` and commits it there
    (as a decode worker's KV pull does), releasing the prefill engine's lease."""
    prefill.add_request(rid, prompt, params)
    leased = None
    while leased is None:
        leased = next((o for o in prefill.step() if o.kv_lease is not None), None)
    alloc = decode.add_prefilled_request(rid, prompt, leased.token_ids[0], params)
    skip = alloc.num_cached_blocks
    decode.kv_cache[alloc.block_ids_to_fill] = \
        prefill.kv_cache[leased.kv_lease.block_ids[skip:len(alloc.block_ids)]]
    decode.commit_prefilled(rid)
    prefill.release_kv(rid)


def test_decode_worker_local_prefills_aborted_beside_kv_holders_free_each_block_once(model):
    """A decode worker prefilling prompts itself (local prefill: plain requests of its
    decode-role engine) beside requests whose KV was pulled: the local ones reuse a pulled
    prompt's prefix blocks. Aborted mid-prefill (a client cancel), a local prefill gives its
    references back and no more; so does a pulled request aborted while it waits holding its
    KV; the others still get Hugging Face's tokens."""
    prefix = _prompts(6, [0], shared=32)[0]
    held, local, late, cancelled = (prefix + tail for tail in _prompts(7, [20, 45, 30, 60], 0))
    params = SamplingParams(max_tokens=8, **GREEDY)
    prefill = LLMEngine(EngineConfig(model, role="prefill"))
    decode = LLMEngine(EngineConfig(model, role="decode", num_gpu_blocks=12,
                                    max_num_batched_tokens=16, max_num_seqs=2))
    _commit_from(prefill, decode, "held", held, params)
    decode.step()  # admitted and decoding; its two prefix blocks are cached
    decode.add_request("cancelled", cancelled, params)
    decode.add_request("local", local, params)
    outs = decode.step()
    req = decode.scheduler.requests["cancelled"]
    assert req.num_cached_tokens == 32 and req.num_computed_tokens < len(cancelled)
    shared = decode.kv_manager.get_block_ids("cancelled")[:2]
    assert [decode.kv_manager.pool.blocks[b].ref_cnt for b in shared] == [2, 2]
    decode.abort("cancelled")
    _check_blocks(decode)
    assert [decode.kv_manager.pool.blocks[b].ref_cnt for b in shared] == [1, 1]
    # Two requests run: a third pulled one waits in the queue holding its KV.
    _commit_from(prefill, decode, "late", late, params)
    outs += decode.step()
    late_req = decode.scheduler.requests["late"]
    assert late_req.status == RequestStatus.WAITING and late_req.num_computed_tokens > 0
    decode.abort("late")
    _check_blocks(decode)
    while decode.has_unfinished_requests():
        outs += decode.step()
        _check_blocks(decode)
    got = {o.request_id: o for o in outs if o.finished}
    assert {r: o.finish_reason for r, o in got.items()} == {
        "held": "length", "local": "length", "cancelled": "abort", "late": "abort"}
    assert got["local"].token_ids == hf_greedy(model, local, 8)
    assert got["held"].token_ids == hf_greedy(model, held, 8)
    assert _all_free(decode)
    prefill.step()  # applies the last release
    assert _all_free(prefill)
