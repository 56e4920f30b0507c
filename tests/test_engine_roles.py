"""The prefill and decode roles, joined by copying KV blocks between two engines."""
import random
import threading
import time

import pytest

from engine import LLM, EngineConfig, LLMEngine, NoFreeBlocksError, SamplingParams

MAX_NEW = 16


@pytest.fixture(scope="module")
def model(preset_path):
    return str(preset_path("tiny-llama"))


def _prompts(seed, lengths, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randint(5, 7000) for _ in range(shared)]
    return [prefix + [rng.randint(5, 7000) for _ in range(n)] for n in lengths]


def _run_until(engine, pred, limit=10_000):
    outs = []
    for _ in range(limit):
        outs.extend(engine.step())
        if pred(outs):
            return outs
    raise AssertionError("engine did not get there")


def _disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params):
    """Prefill each prompt on one engine, move its blocks, decode on the other."""
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, params)
    leased = _run_until(prefill, lambda o: sum(x.kv_lease is not None for x in o) == len(prompts))
    results = {}
    for out in leased:
        lease = out.kv_lease
        assert lease.num_tokens == len(out.prompt_token_ids)
        assert len(out.token_ids) == 1 and not out.finished
        alloc = decode.add_prefilled_request(out.request_id, out.prompt_token_ids,
                                             out.token_ids[0], params)
        skip = alloc.num_cached_blocks
        # [blocks, layers, 2, block_size, kv_heads, head_size]: copy only what decode lacks.
        decode.kv_cache[alloc.block_ids_to_fill] = \
            prefill.kv_cache[lease.block_ids[skip:len(alloc.block_ids)]]
        decode.commit_prefilled(out.request_id)
        prefill.release_kv(out.request_id)
        results[out.request_id] = [out.token_ids[0]]
    outs = _run_until(decode, lambda o: sum(x.finished for x in o) == len(prompts))
    for o in outs:
        if o.finished:
            results[o.request_id] = o.token_ids
    prefill.step()  # applies the releases
    return [results[f"r{i}"] for i in range(len(prompts))]


def _free(engine: LLMEngine) -> bool:
    s = engine.get_stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_leased == 0 and s.num_running == 0


def test_prefill_and_decode_roles_match_one_engine(model):
    prompts = _prompts(3, [4, 16, 31, 50, 77])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model).generate(prompts, params)]
    prefill = LLMEngine(EngineConfig(model, role="prefill", max_num_batched_tokens=32))
    decode = LLMEngine(EngineConfig(model, role="decode"))
    got = _disaggregated(prefill, decode, prompts, params)
    assert got == expected
    assert _free(prefill) and _free(decode)


def test_decode_role_skips_prefix_it_holds(model):
    prompts = _prompts(4, [10, 20], shared=40)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model).generate(prompts, params)]
    prefill = LLMEngine(EngineConfig(model, role="prefill"))
    decode = LLMEngine(EngineConfig(model, role="decode"))
    got = [_disaggregated(prefill, decode, [p], params)[0] for p in prompts[:1]]
    # The second request's first two blocks (32 of 40 shared tokens) are already on decode.
    prefill.add_request("x", prompts[1], params)
    lease = _run_until(prefill, lambda o: any(x.kv_lease for x in o))[-1]
    alloc = decode.add_prefilled_request("x", prompts[1], lease.token_ids[0], params)
    assert alloc.num_cached_tokens == 32 and alloc.num_cached_blocks == 2
    decode.kv_cache[alloc.block_ids_to_fill] = \
        prefill.kv_cache[lease.kv_lease.block_ids[2:len(alloc.block_ids)]]
    decode.commit_prefilled("x")
    prefill.release_kv("x")
    out = _run_until(decode, lambda o: any(x.finished for x in o))[-1]
    assert got + [out.token_ids] == expected


def test_unreleased_lease_expires(model):
    prefill = LLMEngine(EngineConfig(model, role="prefill", kv_lease_timeout_s=0.2))
    prefill.add_request("a", list(range(5, 60)), SamplingParams(max_tokens=4))
    _run_until(prefill, lambda o: any(x.kv_lease for x in o))
    assert prefill.get_stats().num_leased == 1 and not _free(prefill)
    time.sleep(0.3)
    prefill.step()
    assert _free(prefill)
    assert prefill.get_stats().num_expired_leases == 1


def test_abort_waiting_for_kv_frees_blocks(model):
    decode = LLMEngine(EngineConfig(model, role="decode"))
    params = SamplingParams(max_tokens=4)
    decode.add_prefilled_request("a", list(range(5, 70)), 9, params)
    assert not _free(decode)
    decode.abort("a")
    assert _free(decode)  # an idle engine frees at once
    outs = decode.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert _free(decode)


def test_an_allocation_that_fails_midway_frees_its_id_and_blocks(model):
    """An error between taking the id and handing the allocation back (Ctrl-C, a failed
    check) kept the id taken for good: the request could not be sent again."""
    decode = LLMEngine(EngineConfig(model, role="decode"))
    params = SamplingParams(max_tokens=4)
    real = decode.kv_manager.allocate_slots

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)  # the blocks are taken, then the interrupt lands
        raise KeyboardInterrupt

    decode.kv_manager.allocate_slots = interrupted
    with pytest.raises(KeyboardInterrupt):
        decode.add_prefilled_request("a", list(range(5, 70)), 9, params)
    decode.kv_manager.allocate_slots = real
    assert _free(decode)
    alloc = decode.add_prefilled_request("a", list(range(5, 70)), 9, params)  # its id is free
    assert alloc.block_ids
    decode.abort("a")
    assert _free(decode)


def test_an_abort_between_commit_and_admission_is_not_lost(model):
    """commit_prefilled takes the request out of the KV wait, then queues its admission: a
    cancel from another thread in between must still abort it, not let it run to max_tokens
    for nobody."""
    decode = LLMEngine(EngineConfig(model, role="decode"))
    decode.add_prefilled_request("a", list(range(5, 70)), 9,
                                 SamplingParams(max_tokens=20, ignore_eos=True))
    real = decode._inbox

    class Inbox:  # the other thread's abort lands just before the admission is queued
        def put(self, item):
            if item[0] == "admit":
                decode._inbox = real
                decode.abort("a")
            real.put(item)

    decode._inbox = Inbox()
    try:
        decode.commit_prefilled("a")
    finally:
        decode._inbox = real
    outs = [o for _ in range(3) for o in decode.step()]
    # Its one token is the prefill worker's: no decode step ran for it.
    assert [(o.finish_reason, o.token_ids) for o in outs] == [("abort", [9])]
    assert _free(decode) and not decode.has_unfinished_requests()


def test_decode_role_refuses_when_full(model):
    decode = LLMEngine(EngineConfig(model, role="decode", num_gpu_blocks=8))
    params = SamplingParams(max_tokens=4)
    decode.add_prefilled_request("a", list(range(5, 75)), 9, params)  # 5 of 8 blocks
    with pytest.raises(NoFreeBlocksError):
        decode.add_prefilled_request("b", list(range(100, 170)), 9, params)
    decode.abort("a")
    decode.step()
    assert _free(decode)
    # The refused id was not kept: a retry with room works.
    alloc = decode.add_prefilled_request("b", list(range(100, 170)), 9, params)
    assert len(alloc.block_ids) == 5


def test_a_refused_id_used_again_for_another_prompt_gets_its_own_kv(model):
    """A refusal must leave nothing of the prompt under its id: the block hashes it computed
    were taken for the next prompt's under that id, which then hit (and cached its KV under)
    the first prompt's hashes: wrong tokens for it and for a later request with that prompt."""
    decode = LLMEngine(EngineConfig(model, role="decode", num_gpu_blocks=8))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    p1, p2 = _prompts(5, [48, 48])
    decode.add_prefilled_request("holder", list(range(5, 95)), 9, greedy)  # 6 of 8 blocks
    with pytest.raises(NoFreeBlocksError):
        decode.add_prefilled_request("same", p1, 9, greedy)
    decode.abort("holder")
    decode.step()
    # The id comes back (a client's own request id) with another prompt, run in this engine.
    decode.add_request("same", p2, greedy)
    got = {o.request_id: o for o in _run_until(decode, lambda o: any(x.finished for x in o))
           if o.finished}
    decode.add_request("victim", p1, greedy)
    got.update((o.request_id, o) for o in _run_until(decode, lambda o: any(
        x.finished and x.request_id == "victim" for x in o)) if o.finished)
    with LLM(model, enable_prefix_caching=False) as ref:
        want = ref.generate([p2, p1], greedy)
    assert len({tuple(w.token_ids) for w in want}) == 2
    assert got["same"].token_ids == want[0].token_ids and got["same"].num_cached_tokens == 0
    assert got["victim"].token_ids == want[1].token_ids
    assert got["victim"].num_cached_tokens == 0  # p1 never ran here: nothing of it is cached
    assert _free(decode)


def test_requests_waiting_with_their_kv_cannot_starve_each_other(model):
    """Three 32-token prompts fill a 6-block decode engine exactly, and each needs a third
    block for its first decode step: with nothing running, the last one gives its blocks up
    (and recomputes later) so the others can run, instead of every one waiting forever."""
    prompts = _prompts(9, [32, 32, 32])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model).generate(prompts, params)]
    assert len({tuple(e) for e in expected}) == 3
    prefill = LLMEngine(EngineConfig(model, role="prefill"))
    decode = LLMEngine(EngineConfig(model, role="decode", num_gpu_blocks=6))
    assert _disaggregated(prefill, decode, prompts, params) == expected
    assert decode.get_stats().num_preemptions >= 1
    assert _free(decode)


def test_seeded_sampling_continues_across_roles_and_preemption(model):
    prompts = _prompts(5, [12, 40, 70])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model).generate(prompts, params)]
    assert len({tuple(e) for e in expected}) == 3
    preempting = LLM(model, num_gpu_blocks=9, max_num_batched_tokens=32)
    assert [o.token_ids for o in preempting.generate(prompts, params)] == expected
    assert preempting.engine.get_stats().num_preemptions > 0
    prefill = LLMEngine(EngineConfig(model, role="prefill"))
    decode = LLMEngine(EngineConfig(model, role="decode"))
    assert _disaggregated(prefill, decode, prompts, params) == expected


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_migrated_request_continues_where_it_stopped(model, params):
    """A request resumed with the output it already produced elsewhere goes on exactly as the
    uninterrupted one: on one engine, and through the prefill and decode roles."""
    prompts = _prompts(6, [9, 37, 60])
    expected = [o.token_ids for o in LLM(model).generate(prompts, params)]
    assert len({t for e in expected for t in e}) > 20  # diverse, not one repeated token
    cut = [1, 9, 23]  # resumed after 1, 9 and 23 of 24 tokens
    one = LLMEngine(EngineConfig(model))
    for i, (p, k) in enumerate(zip(prompts, cut)):
        one.add_request(f"m{i}", p, params, resume_token_ids=expected[i][:k])
    done = {o.request_id: o for o in _run_until(
        one, lambda o: sum(x.finished for x in o) == 3) if o.finished}
    assert [done[f"m{i}"].token_ids for i in range(3)] == expected
    assert _free(one)
    prefill = LLMEngine(EngineConfig(model, role="prefill", max_num_batched_tokens=32))
    decode = LLMEngine(EngineConfig(model, role="decode"))
    for i, (p, k) in enumerate(zip(prompts, cut)):
        prefill.add_request(f"r{i}", p, params, resume_token_ids=expected[i][:k])
        lease = _run_until(prefill, lambda o: bool(o))[-1]
        if k + 1 == params.max_tokens:  # its last token: the prefill worker finishes it
            assert lease.finished and lease.kv_lease is None
            assert lease.token_ids == expected[i] and lease.new_token_ids == [expected[i][k]]
            continue
        assert lease.kv_lease.num_tokens == len(p) + k  # the resumed tokens' KV came along
        assert lease.new_token_ids == [expected[i][k]]
        alloc = decode.add_prefilled_request(f"r{i}", p, lease.new_token_ids[0], params,
                                             resume_token_ids=expected[i][:k])
        decode.kv_cache[alloc.block_ids_to_fill] = \
            prefill.kv_cache[lease.kv_lease.block_ids[alloc.num_cached_blocks:len(alloc.block_ids)]]
        decode.commit_prefilled(f"r{i}")
        prefill.release_kv(f"r{i}")
    done = {o.request_id: o for o in _run_until(
        decode, lambda o: sum(x.finished for x in o) == 2) if o.finished}
    assert [done[f"r{i}"].token_ids for i in range(2)] == expected[:2]
    prefill.step()
    assert _free(prefill) and _free(decode)


def test_a_resume_that_leaves_nothing_to_generate_is_refused(model):
    engine = LLMEngine(EngineConfig(model))
    params = SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match="nothing to generate"):
        engine.add_request("a", [5, 6, 7], params, resume_token_ids=[8, 9, 10])
    with pytest.raises(ValueError, match="resumed output token id 10000000 is outside"):
        engine.add_request("a", [5, 6, 7], params, resume_token_ids=[10**7])
    with pytest.raises(ValueError, match="first token id 10000000 is outside"):
        engine.add_prefilled_request("a", [5, 6, 7], 10**7, params)
    # The resumed tokens are the context's too: counted with the prompt's.
    n = engine.max_model_len
    with pytest.raises(ValueError, match=f"prompt has {n} tokens; max_model_len is {n}"):
        engine.add_request("a", [5] * (n - 2), params, resume_token_ids=[8, 9])
    assert not engine.has_unfinished_requests()


def test_a_resume_whose_output_has_ended_already_is_refused(model):
    """Output to resume from that a stop token, eos or stop string ended would be continued
    past its end: refused at intake (a stop string in it once failed the engine's step, and
    with it every request on the worker)."""
    engine = LLMEngine(EngineConfig(model))
    prompt = _prompts(9, [20])[0]
    engine.add_request("full", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))
    [full] = [o for o in _run_until(engine, lambda o: any(x.finished for x in o)) if o.finished]
    ids, eos = full.token_ids, min(engine.outputs.eos_token_ids)
    text6 = engine.tokenizer.decode(ids[:6])
    stop = next(text6[i:] for i in range(len(text6) - 2, -1, -1)
                if text6[i:].strip() and text6.find(text6[i:]) == i)  # only at the end
    refused = [
        (dict(stop=[stop]), ids[:6], "completes the stop string"),
        (dict(stop=[stop]), ids[:8], "output token 6 completes the stop string"),
        (dict(stop_token_ids=[ids[2]]), ids[:6], "output token 3 .* is a stop token"),
        (dict(), ids[:3] + [eos], "output token 4 .* is eos"),
    ]
    for kw, resume, match in refused:
        with pytest.raises(ValueError, match=match):
            engine.add_request("r", prompt, SamplingParams(max_tokens=12, **kw),
                               resume_token_ids=resume)
    # Within min_tokens nothing ends it; eos ends nothing with ignore_eos.
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, min_tokens=6, temperature=0.0,
                                                   stop_token_ids=[ids[2]], ignore_eos=True),
                       resume_token_ids=ids[:6])
    engine.add_request("b", prompt, SamplingParams(max_tokens=12, ignore_eos=True),
                       resume_token_ids=ids[:3] + [eos])
    done = {o.request_id: o for o in _run_until(
        engine, lambda o: sum(x.finished for x in o) == 2) if o.finished}
    assert done["a"].token_ids == ids and len(done["b"].token_ids) == 12
    assert _free(engine)


def test_a_resumed_output_is_replayed_once_at_intake_not_in_the_step(model, monkeypatch):
    """The text of a resumed output is rebuilt where add_request is called: in the engine's
    step it stalled every other stream for as long as a long migrated output took."""
    engine = LLMEngine(EngineConfig(model))
    prompt = _prompts(10, [16])[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["\x00"])
    engine.add_request("full", prompt, params)
    [full] = [o for o in _run_until(engine, lambda o: any(x.finished for x in o)) if o.finished]
    replays = []
    real = engine.outputs.replay
    monkeypatch.setattr(engine.outputs, "replay",
                        lambda *a: replays.append(a) or real(*a))
    engine.add_request("r", prompt, params, resume_token_ids=full.token_ids[:20])
    assert len(replays) == 1

    def in_step(*a):
        raise AssertionError("replayed in the engine's step")

    monkeypatch.setattr(engine.outputs, "replay", in_step)
    done = [o for o in _run_until(engine, lambda o: any(x.finished for x in o)) if o.finished]
    assert done[0].token_ids == full.token_ids and done[0].text == full.text
    assert _free(engine)


def _stream_deltas(engine: LLMEngine, rid: str) -> tuple[list[str], list[int]]:
    """The text deltas and token ids ``rid`` streams, step by step, to its end."""
    deltas, ids = [], []
    for out in _run_until(engine, lambda o: any(x.finished and x.request_id == rid for x in o)):
        if out.request_id == rid:
            deltas.append(out.text_delta)
            ids.extend(out.new_token_ids)
    return deltas, ids


@pytest.mark.parametrize("with_stop", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_migrated_request_streams_exactly_the_text_not_yet_streamed(model, with_stop):
    """Wherever a stream is cut, what was streamed before plus what the continuation streams
    is the uninterrupted text: nothing repeated or lost (unfinished characters and possible
    stop strings held back at the cut included)."""
    prompt = _prompts(8, [30])[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model))
    engine.add_request("full", prompt, params)
    deltas, ids = _stream_deltas(engine, "full")
    text = "".join(deltas)
    assert len(deltas) == len(ids) == 40
    if with_stop:  # a stop string late in the text, found nowhere earlier
        i = next(i for i in range(len(text) - 3, 0, -1) if text.find(text[i:i + 3]) == i)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                stop=[text[i:i + 3]])
        engine.add_request("stopped", prompt, params)
        deltas, ids = _stream_deltas(engine, "stopped")
        text = "".join(deltas)
    for k in range(1, len(ids)):
        engine.add_request(f"k{k}", prompt, params, resume_token_ids=ids[:k])
        rest, rest_ids = _stream_deltas(engine, f"k{k}")
        assert ids[:k] + rest_ids == ids
        assert "".join(deltas[:k]) + "".join(rest) == text, f"cut after {k} tokens"
    assert _free(engine)


def test_kv_events_are_kept_only_for_an_engine_that_publishes_them(model):
    """An offline engine's block events went unread and piled up for good; a served one
    (enable_kv_events) gets every store and removal, and its ended leases."""
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = _prompts(9, [40, 50, 60])
    offline = LLMEngine(EngineConfig(model, num_gpu_blocks=16))
    for i, p in enumerate(prompts):
        offline.add_request(f"o{i}", p, greedy)
    _run_until(offline, lambda o: sum(x.finished for x in o) == len(prompts))
    assert offline.take_kv_events() == []
    served = LLMEngine(EngineConfig(model, role="prefill", num_gpu_blocks=16))
    served.enable_kv_events()
    served.add_request("s0", prompts[0], greedy)
    _run_until(served, lambda o: any(x.kv_lease is not None for x in o))
    served.release_kv("s0")
    served.step()
    events = served.take_kv_events()
    stored = [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert len(stored) == 40 // 16
    assert [e.request_id for e in events if type(e).__name__ == "LeaseEnded"] == ["s0"]


@pytest.mark.parametrize("recomputes", ["no-prefix-caching", "prompt-logprobs"])
def test_a_request_that_recomputes_beside_a_waiting_kv_holder_finishes(model, recomputes):
    """Decode role, chunked prefill: a running request that cannot reuse its own blocks
    preempted itself, came back a chunk at a time and ran out of blocks again, for ever,
    while a committed request waited holding its written KV. The holder gives way first."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    caching = recomputes != "no-prefix-caching"
    extra = dict(prompt_logprobs=1) if recomputes == "prompt-logprobs" else {}
    engine = LLMEngine(EngineConfig(model, role="decode", num_gpu_blocks=8, block_size=4,
                                    max_num_batched_tokens=8, enable_prefix_caching=caching))
    engine.add_request("big", list(range(10, 30)), SamplingParams(max_tokens=2, **greedy,
                                                                  **extra))
    engine.step()  # big's first chunk
    engine.add_prefilled_request("held", list(range(40, 56)), 7,
                                 SamplingParams(max_tokens=2, **greedy))
    engine.commit_prefilled("held")
    done = {o.request_id for o in _run_until(
        engine, lambda o: sum(x.finished for x in o) == 2, limit=200) if o.finished}
    assert done == {"big", "held"}
    assert _free(engine)


def test_a_stale_admit_of_an_aborted_request_leaves_a_new_one_under_its_id_alone(model):
    """An abort and the id's reuse in the window between commit_prefilled and its admit
    reaching the step: the old admit ran the aborted request on the new one's blocks, under
    its id, and the new one's own admit found nothing to admit."""
    engine = LLMEngine(EngineConfig(model, role="decode", num_gpu_blocks=32, block_size=4))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_prefilled_request("a", list(range(5, 30)), 9, params)
    inbox, reused = engine._inbox, []

    class Window:  # another thread acting while commit_prefilled has yet to queue its admit
        def put(self, item):
            if item[0] == "admit" and not reused:
                engine.abort("a")
                inbox.put(item)  # the first commit's admit lands now
                engine.add_prefilled_request("a", list(range(100, 125)), 11, params)
                reused.append(True)
                engine.commit_prefilled("a")
                return
            inbox.put(item)

        def get_nowait(self):
            return inbox.get_nowait()

    engine._inbox = Window()
    engine.commit_prefilled("a")
    engine._inbox = inbox
    outs = _run_until(engine, lambda o: any(x.finished and x.token_ids[0] == 11 for x in o),
                      limit=50)
    finished = [o for o in outs if o.finished]
    assert [o.token_ids[0] for o in finished] == [9, 11]  # the old one aborted, the new one ran
    assert finished[0].finish_reason == "abort" and len(finished[1].token_ids) == 4
    assert _free(engine)


def test_an_abort_queued_for_an_ended_request_spares_a_new_allocation_under_its_id(model):
    """A caller that leaves as its request ends sends an abort that waits for the next step
    when a step is running; an allocation that takes the id first must not be what it ends."""
    engine = LLMEngine(EngineConfig(model, role="decode"))
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [5, 6, 7, 8], greedy)
    while not any(o.finished for o in engine.step()):
        pass
    stepping, done = threading.Event(), threading.Event()

    def step_in_another_thread():
        with engine._lock:
            stepping.set()
            done.wait(30)

    t = threading.Thread(target=step_in_another_thread)
    t.start()
    stepping.wait(30)
    engine.abort("r")  # the step holds the lock: the abort waits in the inbox
    done.set()
    t.join()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    alloc = engine.add_prefilled_request("r", [9, 10, 11, 12, 13], 14, params)
    assert alloc.block_ids
    engine.commit_prefilled("r")
    finals = []
    while engine.has_unfinished_requests():
        finals += [o.finish_reason for o in engine.step() if o.finished]
    assert finals == ["length"]
    assert _free(engine)
