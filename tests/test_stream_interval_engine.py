"""The engine's stream interval: a request makes one output per N tokens after its first, each
carrying every token, text and logprob since the last, and its final output whatever is left."""
import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(preset_path):
    return LLM(str(preset_path("tiny-llama")), max_model_len=256)


def _run(llm, prompt, params, stream_interval, rid="s"):
    engine = llm.engine
    engine.add_request(rid, prompt, params, stream_interval=stream_interval)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


def _whole(llm, prompt, params):
    return llm.generate([prompt], params)[0]


@pytest.mark.parametrize("interval, sizes", [(1, [1] * 11), (4, [1, 4, 4, 2]),
                                              (5, [1, 5, 5]), (64, [1, 10])])
def test_outputs_come_one_per_interval_and_add_up_to_the_whole(llm, interval, sizes):
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=2)
    want = _whole(llm, "Once upon a time", params)
    assert len(set(want.token_ids)) > 3  # the outputs say something: not one repeated token
    outs = _run(llm, "Once upon a time", params, interval)
    assert [len(o.new_token_ids) for o in outs] == sizes
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids
    assert "".join(o.text_delta for o in outs) == want.text
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    # Logprobs cover every token so far, held ones included.
    assert [len(o.logprobs) for o in outs] == [sum(sizes[:i + 1]) for i in range(len(sizes))]
    assert [lp.sampled.token_id for lp in outs[-1].logprobs] == want.token_ids


def test_a_stop_string_inside_a_held_interval_ends_the_request_at_once(llm):
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = _whole(llm, "a stop string test", SamplingParams(**greedy))
    stop = ref.text[8:11]
    want = _whole(llm, "a stop string test", SamplingParams(**greedy, stop=[stop]))
    assert want.finish_reason == "stop" and len(want.token_ids) < 40
    outs = _run(llm, "a stop string test", SamplingParams(**greedy, stop=[stop]), 16)
    assert outs[-1].finished and outs[-1].stop_reason == stop
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids
    assert "".join(o.text_delta for o in outs) == want.text == ref.text[:ref.text.index(stop)]


def test_an_abort_hands_over_the_held_tokens(llm):
    engine = llm.engine
    engine.add_request("held", [5, 9, 14, 20], SamplingParams(max_tokens=100, ignore_eos=True),
                       stream_interval=50)
    outs = []
    for _ in range(7):  # the first output, then six tokens held
        outs.extend(engine.step())
    engine.abort("held")
    outs.extend(engine.step())
    assert [len(o.new_token_ids) for o in outs] == [1, 6]
    assert outs[-1].finish_reason == "abort" and outs[-1].token_ids == [
        t for o in outs for t in o.new_token_ids]
    s = engine.get_stats()
    assert s.num_free_blocks == s.num_total_blocks


@pytest.mark.parametrize("bad", [0, -1, 1025, True, 2.0, "4"])
def test_a_bad_stream_interval_is_refused(llm, bad):
    with pytest.raises(ValueError, match="stream_interval must be an integer in"):
        llm.engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=3),
                               stream_interval=bad)
    assert not llm.engine.has_unfinished_requests()
