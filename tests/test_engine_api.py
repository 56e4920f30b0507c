"""The offline API and the step API: inputs, stops, sampling, aborts, block accounting."""
import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def llm(preset_path):
    return LLM(str(preset_path("tiny-llama")), max_model_len=256)


def _all_free(llm_or_engine) -> bool:
    e = getattr(llm_or_engine, "engine", llm_or_engine)
    s = e.get_stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([1, 2, 10**6], "outside the vocabulary"),
    ([1, -3], "outside the vocabulary"),
    ([1, "a"], "outside the vocabulary"),
    (list(range(5, 300)), "max_model_len"),
    (3.5, "string or a list"),
])
def test_bad_prompts_are_refused(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["hello", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=99), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 65), "stop has 65 strings, more than 64"),
    (dict(stop=["x" * 1025]), "a stop string has 1025 characters, more than 1024"),
    (dict(bad_words=["x" * 1025]), "a bad word has 1025 characters, more than 1024"),
    (dict(bad_words=["x"] * 257), "bad_words has 257 entries, more than 256"),
    (dict(stop_token_ids=[1] * 1025), "stop_token_ids has 1025 ids, more than 1024"),
    (dict(allowed_token_ids=[1] * (2**18 + 1)), "allowed_token_ids has 262145 ids, more than"),
    (dict(temperature=float("nan")), "temperature"),
    # -inf / inf is NaN, which would win the argmax over every masked-out token; 1e39 is
    # finite here and inf in float32.
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=100.5), "temperature"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_allowed_token_ids_are_a_set():
    assert SamplingParams(allowed_token_ids=[5, 3, 5, 3, 9]).allowed_token_ids == [5, 3, 9]


def test_the_hottest_temperature_still_keeps_masked_tokens_out(llm):
    allowed = [100, 200, 300]
    for seed in range(3):
        out = llm.generate(["hi"], SamplingParams(temperature=100.0, seed=seed, max_tokens=6,
                                                  allowed_token_ids=allowed))[0]
        assert set(out.token_ids) <= set(allowed), out.token_ids


def test_sampling_params_checked_against_vocab(llm):
    with pytest.raises(ValueError, match="stop token id"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**7]))


def test_unknown_preset_and_broken_folder(tmp_path):
    with pytest.raises(ValueError, match="tiny-llama"):
        LLM("no-such-model")
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(bad))


def test_bad_engine_config():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig("tiny-llama", block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig("tiny-llama", max_num_seqs=0)
    with pytest.raises(ValueError, match="role"):
        EngineConfig("tiny-llama", role="both")
    with pytest.raises(ValueError, match="kv_pull_streams"):
        EngineConfig("tiny-llama", kv_pull_streams=0)


def test_text_and_token_prompts_agree(llm):
    text = "The quick brown fox jumps over the lazy dog"
    ids = llm.tokenizer.encode(text)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a, b = llm.generate([text, ids], p)
    assert a.token_ids == b.token_ids
    assert a.prompt_token_ids == ids
    assert a.text == llm.tokenizer.decode(a.token_ids)


def test_streamed_deltas_add_up_to_the_text(llm):
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    deltas, last = [], None
    for out in llm.stream("Once upon a time", p):
        deltas.append(out.text_delta)
        last = out
    assert last.finished and len(last.token_ids) == 30
    assert "".join(deltas) == last.text == llm.tokenizer.decode(last.token_ids)


def test_max_tokens_and_stop_token(llm):
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = llm.generate(["stop here"], p)[0]
    stop_tok = ref.token_ids[5]
    first = ref.token_ids.index(stop_tok)
    out = llm.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0.0,
                                                     ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == ref.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert ref.finish_reason == "length"


def test_stop_string(llm):
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = llm.generate(["a stop string test"], p)[0]
    assert len(ref.text) > 12
    stop = ref.text[8:11]
    cut = ref.text.index(stop)
    out = llm.generate(["a stop string test"], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:cut]
    inc = llm.generate(["a stop string test"], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True))[0]
    assert inc.text == ref.text[:cut + len(stop)]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate(["same seed"], seeded)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["another", "same seed", "third prompt here"], [other, seeded, other])
    assert batch[1].token_ids == alone
    reseeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    assert llm.generate(["same seed"], reseeded)[0].token_ids != alone


def test_the_engine_seed_alone_sets_what_unseeded_samples_draw(preset_path):
    """An engine's ``seed`` (``--seed``) fixes its unseeded samples, the first engine a process
    starts included: the oneMKL probe that engine runs once per process drew from the global
    generator after the seed was set, so the same seed gave that engine other samples."""
    from kernels.cpu_mkl_linear import mkl_available

    path = str(preset_path("micro-llama"))
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)

    def samples(seed: int) -> list[list[int]]:
        with LLM(path, seed=seed) as llm:
            return [o.token_ids for o in llm.generate(["one prompt", "another"], unseeded)]

    mkl_available.cache_clear()  # as at a process's first engine
    first = samples(3)
    assert first == samples(3)
    assert first != samples(4)


def test_logprobs_returned_per_token(llm):
    out = llm.generate(["logprobs"], SamplingParams(max_tokens=5, temperature=0.0,
                                                    logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.sampled.token_id == tok and lp.sampled.rank == 1
        assert len(lp.top) == 3 and lp.top[0].logprob >= lp.top[-1].logprob


def test_abort_running_and_waiting_frees_blocks(preset_path):
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), max_num_seqs=2))
    p = SamplingParams(max_tokens=200, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10 + i, 90 + i)), p)
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_running == 2 and engine.get_stats().num_waiting == 2
    for i in range(4):
        engine.abort(f"r{i}")
    outs = engine.step()
    assert sorted(o.request_id for o in outs if o.finished) == ["r0", "r1", "r2", "r3"]
    assert all(o.finish_reason == "abort" for o in outs)
    assert _all_free(engine) and not engine.has_unfinished_requests()
    # Ids are free again once finished.
    engine.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=1))


def test_duplicate_request_id_refused(preset_path):
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama"))))
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=3))


def test_stream_closed_early_aborts(llm):
    gen = llm.stream("closing early", SamplingParams(max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()
    assert _all_free(llm)


def test_requests_added_from_another_thread_while_stepping(preset_path):
    import threading

    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama"))))
    finished, stop = {}, threading.Event()

    def loop():
        while not stop.is_set():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out

    t = threading.Thread(target=loop)
    t.start()
    try:
        for i in range(8):
            engine.add_request(f"t{i}", list(range(5 + i, 40 + 3 * i)),
                               SamplingParams(max_tokens=6 + i, ignore_eos=True))
        for _ in range(600):
            if len(finished) == 8:
                break
            stop.wait(0.05)
    finally:
        stop.set()
        t.join()
    assert {rid: len(o.token_ids) for rid, o in finished.items()} == {f"t{i}": 6 + i for i in range(8)}
    assert _all_free(engine)


def test_checkpoint_without_tokenizer_takes_token_ids(preset_path, tmp_path):
    import shutil

    src = preset_path("tiny-llama")
    dst = tmp_path / "no-tokenizer"
    dst.mkdir()
    for f in src.iterdir():
        if f.name.endswith((".json", ".safetensors")) and "tokenizer" not in f.name \
                and "special_tokens" not in f.name:
            shutil.copy(f, dst / f.name)
    llm = LLM(str(dst))
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], SamplingParams(max_tokens=3))


def test_an_interrupted_step_leaves_no_uncomputed_block_in_the_prefix_cache(preset_path):
    """Blocks are cached when allocated, before the step computes them: a step interrupted
    in its forward (Ctrl-C in a notebook, a CUDA OOM) left them cached with KV never written,
    and the same prompt's next run decoded from it."""
    path = str(preset_path("tiny-llama"))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i) % 200 + 5 for i in range(40)]
    with LLM(path, enable_prefix_caching=False) as ref:
        want = ref.generate([prompt], greedy)[0].token_ids
    with LLM(path) as llm:
        real, calls = llm.engine.executor.execute_model, []

        def interrupted_once(inp):
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(inp)

        llm.engine.executor.execute_model = interrupted_once
        with pytest.raises(KeyboardInterrupt):
            for _ in llm.stream(prompt, greedy):
                pass
        assert llm.engine.kv_manager.pool.num_cached_blocks == 0
        got = llm.generate([prompt], greedy)[0]
        assert got.token_ids == want
        assert _all_free(llm)


def _step_interrupted_at_second_token(engine: LLMEngine) -> list[str]:
    """A step computed, then interrupted (Ctrl-C) as it hands out its second token; the ids
    of the requests whose tokens it began to hand out."""
    real, calls = engine.outputs.append_token, []

    def interrupted(req, token_id, logprobs):
        calls.append(req.request_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(req, token_id, logprobs)

    engine.outputs.append_token = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        engine.outputs.append_token = real
    return calls


def test_an_interrupted_hand_out_of_a_steps_tokens_leaves_no_request_stuck(preset_path):
    """A step computed, then interrupted as it handed out its tokens (Ctrl-C in a notebook, a
    detokenizer error): the requests whose token it had not appended were advanced past the
    step all the same, were scheduled no token ever again, and held their blocks for good."""
    path = str(preset_path("tiny-llama"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 5 for i in range(20 + 3 * j)] for j in range(3)]
    engine = LLMEngine(EngineConfig(path, num_gpu_blocks=64))
    want = {}
    for j, prompt in enumerate(prompts):
        engine.add_request(f"want{j}", prompt, greedy)
    while engine.has_unfinished_requests():
        want.update({o.request_id[4:]: o.token_ids for o in engine.step() if o.finished})
    for j, prompt in enumerate(prompts):
        engine.add_request(f"got{j}", prompt, greedy)
    engine.step()  # the prompts, and their first tokens
    _step_interrupted_at_second_token(engine)  # one request has its token, the others not
    got = {}
    for _ in range(50):  # bounded: a stuck request never finishes
        if not engine.has_unfinished_requests():
            break
        got.update({o.request_id[3:]: o.token_ids for o in engine.step() if o.finished})
    assert got == want and len(set(map(tuple, want.values()))) == 3
    assert _all_free(engine)


def test_outputs_made_before_a_step_failed_come_with_the_next_step(preset_path):
    """A failed step re-raised and lost what it was to return: an abort's final output
    queued before it, and the final output of a request that finished in it before its
    hand-out was interrupted. A caller that steps on after the error never saw them."""
    path = str(preset_path("tiny-llama"))
    engine = LLMEngine(EngineConfig(path, num_gpu_blocks=64))
    prompt = [(7 * i) % 200 + 5 for i in range(20)]
    engine.add_request("aborted", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("short", prompt[1:], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("long", prompt[2:], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the prompts and their first tokens
    engine.abort("aborted")
    real_forward = engine.executor.execute_model

    def failing(inp):
        raise RuntimeError("forward failed")

    engine.executor.execute_model = failing
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    engine.executor.execute_model = real_forward
    calls = _step_interrupted_at_second_token(engine)
    assert calls == ["short", "long"]  # "short" took its last token before the interrupt
    ends = {}
    for _ in range(50):  # bounded: a lost output never comes
        if not engine.has_unfinished_requests():
            break
        ends.update({o.request_id: o for o in engine.step() if o.finished})
    assert {rid: o.finish_reason for rid, o in ends.items()} == \
        {"aborted": "abort", "short": "length", "long": "length"}
    assert len(ends["short"].token_ids) == 2 and len(ends["long"].token_ids) == 6
    assert _all_free(engine)
    # They started over as preempted requests do, but were not preempted for want of blocks.
    assert engine.get_stats().num_preemptions == 0


def test_stop_strings_without_detokenized_output_are_refused(preset_path):
    """Stop strings are matched on the text: an engine that makes none ran such a request to
    max_tokens, its stop never seen (bad_words, which need the tokenizer too, were refused)."""
    path = str(preset_path("tiny-llama"))
    with LLM(path, detokenize=False) as llm:
        with pytest.raises(ValueError, match="stop strings need detokenized output"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=["gru"]))
        stopped = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0]
        out = llm.generate([[5, 6, 7]], SamplingParams(
            max_tokens=4, temperature=0.0, stop_token_ids=[stopped.token_ids[1]]))[0]
        assert out.token_ids == stopped.token_ids[:2] and out.finish_reason == "stop"
