"""guided_choice (engine/guided_choice.py): the output is one of the given texts. The mask
against its definition, the engine's greedy choice against the same model stepped one token
at a time with that step's allowed tokens (allowed_token_ids, tested on its own), seeded
sampling landing on several choices, a resumed request finishing the choice it began, and
what is refused. Through a router (the first token the prefill worker's, the rest the decode
worker's): tests/test_serving.py."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.guided_choice import allowed_by_choices, check_choice_prefix
from tests.serving_helpers import final_output, random_prompts

CHOICES = ["positive", "negative", "neutral", "yes", "yes indeed", "no way"]
PROMPTS = random_prompts(6, seed=3)


def test_the_mask_allows_what_goes_on_spelling_a_choice():
    seqs = [[1, 2], [1, 2, 3], [1, 4], [5]]
    eos = [9]
    assert sorted(allowed_by_choices(seqs, [], eos)) == [1, 5]
    assert sorted(allowed_by_choices(seqs, [1], eos)) == [2, 4]
    assert sorted(allowed_by_choices(seqs, [1, 2], eos)) == [3, 9]  # whole, or goes on
    assert allowed_by_choices(seqs, [1, 2, 3], eos) == [9]
    assert allowed_by_choices(seqs, [5], eos) == [9]
    assert allowed_by_choices(seqs, [2], eos) == []
    check_choice_prefix(seqs, [1, 2, 3])
    with pytest.raises(ValueError, match="begins none of guided_choice's choices"):
        check_choice_prefix(seqs, [1, 3])


def _stepped(llm, prompt: list[int]) -> list[int]:
    """The greedy output with each step's allowed tokens given as allowed_token_ids."""
    seqs = [llm.tokenizer.encode_plain(c) for c in CHOICES]
    eos = llm.engine.sampler.eos_token_ids
    out: list[int] = []
    while not out or out[-1] not in eos:
        allowed = allowed_by_choices(seqs, out, eos)
        out += llm.generate([prompt + out], SamplingParams(
            max_tokens=1, temperature=0.0, allowed_token_ids=allowed))[0].token_ids
    return out


def test_greedy_picks_each_token_among_the_choices_as_the_model_ranks_them(reference):
    outs = reference.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0,
                                                      guided_choice=CHOICES))
    assert {o.text for o in outs} <= set(CHOICES)
    assert len({o.text for o in outs}) >= 3  # the model's ranking decides, not the first
    assert all(o.finish_reason == "stop" for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == _stepped(reference, prompt)


def test_seeded_samples_are_choices_too(reference):
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=i,
                             guided_choice=CHOICES) for i in range(12)]
    outs = reference.generate([PROMPTS[0]] * 12, params)
    assert {o.text for o in outs} <= set(CHOICES) and len({o.text for o in outs}) >= 3
    again = reference.generate([PROMPTS[0]] * 12, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_a_resumed_request_finishes_the_choice_it_began(reference):
    begun = reference.tokenizer.encode_plain("yes indeed")[:2]  # past "yes"
    params = SamplingParams(max_tokens=16, temperature=0.0, guided_choice=CHOICES)
    engine = reference.engine
    engine.add_request("resumed", PROMPTS[0], params, resume_token_ids=begun)
    final = final_output(engine, "resumed")
    assert final.text == "yes indeed" and final.finish_reason == "stop"
    with pytest.raises(ValueError, match="begins none of guided_choice's choices"):
        engine.add_request("astray", PROMPTS[0], params,
                           resume_token_ids=reference.tokenizer.encode_plain("maybe"))


@pytest.mark.parametrize("kw, match", [
    (dict(guided_choice=["a", ""]), "non-empty strings"),
    (dict(guided_choice=["a"] * 257), "257 choices, more than 256"),
    (dict(guided_choice=["a" * 1025]), "1025 characters"),
    (dict(guided_choice=["a"], ignore_eos=True), "ignore_eos cannot be set"),
    (dict(guided_choice=["a"], allowed_token_ids=[5]), "allowed_token_ids cannot be set"),
])
def test_bad_choices_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_a_lone_text_is_one_choice():
    from client.types import build_request
    from protos.convert import sampling_from_proto

    assert SamplingParams(guided_choice="yes").guided_choice == ["yes"]
    req = build_request("hi", None, {"guided_choice": "yes indeed"})
    assert sampling_from_proto(req.sampling).guided_choice == ["yes indeed"]
