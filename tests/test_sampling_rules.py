"""What the sampler does to logits besides temperature and filters: repetition, presence and
frequency penalties (engine/penalties.py), logit_bias and min_tokens. The batched code against
per-token Python references, the sampler around them, and the engine's greedy output against
Hugging Face (its own repetition penalty; its logits with the definitions applied in Python
for the rest), also across a resumed request."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine import SamplingParams
from engine.penalties import PenaltyState, apply_penalties
from engine.sampler import Sampler
from tests.hf_oracle import hf_model
from tests.serving_helpers import random_prompts

VOCAB = 50


def _reference(logits: list[float], prompt: list[int], output: list[int], rep: float,
               pres: float, freq: float) -> list[float]:
    """One row, token by token, straight from the definitions."""
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        n = output.count(tok)
        out.append(x - freq * n - (pres if n else 0.0))
    return out


def _state(prompt, output, in_steps=1):
    s = PenaltyState.for_prompt(prompt, VOCAB, torch.device("cpu"))
    step = max(1, len(output) // in_steps)
    for end in range(step, len(output) + step, step):  # as the engine does, step by step
        s.update(output[:end])
    return s


def test_batched_penalties_equal_the_definitions():
    rng = random.Random(0)
    rows = []
    for i in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))]
        rows.append((prompt, output, rng.choice([1.0, 1.3, 0.7]), rng.choice([0.0, 0.5, -1.0]),
                     rng.choice([0.0, 0.25, 2.0])))
    logits = torch.randn(len(rows), VOCAB) * 3
    states = [_state(p, o, in_steps=3) for p, o, *_ in rows]
    got = apply_penalties(logits, [r[2] for r in rows], [r[3] for r in rows],
                          [r[4] for r in rows], states)
    for i, (prompt, output, rep, pres, freq) in enumerate(rows):
        want = _reference(logits[i].tolist(), prompt, output, rep, pres, freq)
        assert got[i].tolist() == pytest.approx(want, abs=1e-5)
        assert states[i].output_counts.sum().item() == len(output)
    assert not torch.equal(got, logits)


def test_penalty_state_counts_only_new_tokens():
    s = _state([1, 2], [])
    s.update([3, 3])
    s.update([3, 3])  # nothing new
    s.update([3, 3, 4])
    assert s.output_counts[3].item() == 2 and s.output_counts[4].item() == 1
    assert s.prompt_mask[[1, 2]].all() and not s.prompt_mask[3]


def test_apply_penalties_checks_its_inputs():
    with pytest.raises(ValueError, match="as many"):
        apply_penalties(torch.zeros(2, VOCAB), [1.0], [0.0], [0.0], [_state([1], [])])
    with pytest.raises(ValueError, match="penalty state"):
        apply_penalties(torch.zeros(1, VOCAB + 1), [1.0], [0.0], [0.0], [_state([1], [])])


def test_sampler_penalises_only_its_rows_and_reports_raw_logprobs():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.0
    plain = SamplingParams(temperature=0.0, logprobs=1)
    penalised = SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=2.0)
    out = Sampler()(logits, [plain, penalised], [None, None], [None, _state([1], [7])])
    assert out.token_ids == [7, 8]  # 7 once in the output: 5 - 2 < 4
    raw = torch.log_softmax(logits[1], dim=-1)
    assert out.logprobs[1].sampled.logprob == pytest.approx(raw[8].item())
    assert out.logprobs[1].sampled.rank == 2
    with pytest.raises(ValueError, match="penalty states"):
        Sampler()(logits, [plain, penalised], [None, None])


def test_logit_bias_comes_before_the_penalties_as_in_vllm():
    """vLLM applies bias (and bans) first, then penalties: a repetition penalty divides a
    biased logit, (x + b) / r, not x / r + b."""
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :3] = torch.tensor([3.0, 5.0, -1.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 4.0},
                            presence_penalty=0.5)
    out = Sampler()(logits, [params], [None], [_state([0], [])])
    # Token 0 (in the prompt): (3 + 4) / 2 = 3.5 < 5; the other order gave 3 / 2 + 4 = 5.5.
    assert out.token_ids == [1]
    # A banned token stays out whatever the penalties do to -inf.
    banned = SamplingParams(temperature=0.0, repetition_penalty=2.0, min_tokens=1,
                            stop_token_ids=[1])
    out = Sampler()(logits, [banned], [None], [_state([1], [])], [0])
    assert out.token_ids == [0]


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
])
def test_sampling_params_validate_penalties(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


# The random model rarely repeats itself: of these, the first one's unpenalised greedy output
# has a repeated token and the second's a token of its prompt, so the penalties change them.
PROMPTS = [random_prompts(12, seed=5, lo=5, hi=40)[i] for i in (3, 10)]
GREEDY = dict(max_tokens=32, temperature=0.0, ignore_eos=True)


@torch.inference_mode()
def test_repetition_penalty_equals_hugging_faces(reference, preset_path):
    model = hf_model(str(preset_path("tiny-llama")))
    got = reference.generate(PROMPTS, SamplingParams(repetition_penalty=1.8, **GREEDY))
    plain = reference.generate(PROMPTS, SamplingParams(**GREEDY))
    for prompt, out in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist()
    assert set(plain[1].token_ids) & set(PROMPTS[1])  # a prompt token, which the penalty...
    assert got[1].token_ids != plain[1].token_ids     # ...made the model avoid


@torch.inference_mode()
def _hf_greedy_with(path, prompt, n, adjust, stop_ids=()) -> list[int]:
    """Greedy on HF's logits after ``adjust(logits, output)``, ending at a stop id."""
    model = hf_model(str(path))
    output: list[int] = []
    while len(output) < n and not (output and output[-1] in stop_ids):
        logits = model(torch.tensor([prompt + output])).logits[0, -1].float().tolist()
        x = adjust(logits, output)
        output.append(max(range(len(x)), key=x.__getitem__))
    return output


def _hf_penalised_greedy(path, prompt, n, rep, pres, freq) -> list[int]:
    return _hf_greedy_with(path, prompt, n,
                           lambda x, out: _reference(x, prompt, out, rep, pres, freq))


def test_presence_and_frequency_penalties_equal_the_definitions_on_hf(reference, preset_path):
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.1,
                            **GREEDY)
    got = reference.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, got):
        assert out.token_ids == _hf_penalised_greedy(preset_path("tiny-llama"), prompt, 32,
                                                     1.1, 0.5, 1.0)
    plain = reference.generate(PROMPTS[:1], SamplingParams(**GREEDY))[0].token_ids
    assert len(set(plain)) < len(plain) and len(set(got[0].token_ids)) == len(plain)


def test_a_resumed_request_keeps_penalising_its_earlier_output(reference):
    params = SamplingParams(frequency_penalty=1.5, repetition_penalty=1.2, **GREEDY)
    whole = reference.generate([PROMPTS[0]], params)[0].token_ids
    assert whole != reference.generate([PROMPTS[0]], SamplingParams(**GREEDY))[0].token_ids
    engine = reference.engine
    engine.add_request("resumed", PROMPTS[0], params, resume_token_ids=whole[:8])
    rest = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "resumed" and out.finished:
                rest = out.token_ids
    assert rest == whole


def test_min_tokens_holds_back_stop_tokens_until_then(reference, preset_path):
    prompt = PROMPTS[1]
    plain = reference.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    stop = plain[2]  # the model wants it third
    early = reference.generate([prompt], SamplingParams(stop_token_ids=[stop], max_tokens=32,
                                                        temperature=0.0))[0]
    assert early.token_ids == plain[:3] and early.stop_reason == stop
    held = reference.generate([prompt], SamplingParams(stop_token_ids=[stop], min_tokens=12,
                                                       max_tokens=32, temperature=0.0))[0]

    def ban_early(x, out):
        return [-math.inf if (t == stop and len(out) < 12) else v for t, v in enumerate(x)]

    want = _hf_greedy_with(preset_path("tiny-llama"), prompt, 32, ban_early, stop_ids=(stop,))
    assert held.token_ids == want and len(held.token_ids) > 12
    assert stop not in held.token_ids[:12]


def test_min_tokens_holds_even_when_only_a_stop_token_is_allowed(reference):
    # The sampler's bans would leave nothing to sample, so it lifts them and samples the stop
    # token; that token still ends nothing within min_tokens (as a stop string does not).
    stop = reference.generate([PROMPTS[1]], SamplingParams(**GREEDY))[0].token_ids[2]
    out = reference.generate([PROMPTS[1]], SamplingParams(
        stop_token_ids=[stop], allowed_token_ids=[stop], min_tokens=3, max_tokens=32,
        temperature=0.0))[0]
    assert out.token_ids == [stop] * 4 and out.finish_reason == "stop"


def test_min_tokens_defers_stop_strings(reference):
    prompt = PROMPTS[1]
    plain = reference.generate([prompt], SamplingParams(**GREEDY))[0]
    stop = reference.tokenizer.decode(plain.token_ids[1:2]).strip()
    assert stop and stop in reference.tokenizer.decode(plain.token_ids[:2])
    early = reference.generate([prompt], SamplingParams(stop=[stop], **GREEDY))[0]
    assert len(early.token_ids) <= 3 and early.stop_reason == stop  # found within a token
    held = reference.generate([prompt], SamplingParams(stop=[stop], min_tokens=10, **GREEDY))[0]
    assert held.token_ids == plain.token_ids[:len(held.token_ids)]
    assert len(held.token_ids) > 10 and held.text.startswith(early.text + stop)


def test_a_stop_tokens_text_is_left_out_unless_asked_for(reference):
    prompt = PROMPTS[0]
    plain = reference.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    k = next(i for i in range(3, len(plain)) if plain[i] not in plain[:i])
    cut = reference.generate([prompt], SamplingParams(**{**GREEDY, "max_tokens": k}))[0]
    kept = reference.generate([prompt], SamplingParams(**{**GREEDY, "max_tokens": k + 1}))[0]
    assert kept.text != cut.text  # the stop token has text of its own
    for include, want in ((False, cut.text), (True, kept.text)):
        params = SamplingParams(stop_token_ids=[plain[k]], include_stop_str_in_output=include,
                                **GREEDY)
        outs = list(reference.stream(prompt, params))
        assert outs[-1].token_ids == plain[:k + 1] and outs[-1].stop_reason == plain[k]
        assert outs[-1].text == want == "".join(o.text_delta for o in outs)


def test_a_stop_string_begun_within_min_tokens_is_never_streamed(reference):
    """The first token past min_tokens may complete a stop string that began in the tokens
    before it: the stream must have held that beginning back, not sent text the end cuts."""
    cases = 0
    for prompt in random_prompts(12, seed=33, lo=4, hi=12):
        plain = reference.generate([prompt], SamplingParams(**GREEDY))[0]
        first, second = (reference.tokenizer.decode(plain.token_ids[i:i + 1]) for i in (0, 1))
        if len(first) < 2 or len(second) < 2 or "\ufffd" in first + second:
            continue
        stop = first[-2:] + second[:2]  # straddles min_tokens=1's boundary
        if stop in first:
            continue
        for include in (False, True):
            params = SamplingParams(stop=[stop], min_tokens=1, include_stop_str_in_output=include,
                                    **GREEDY)
            outs = list(reference.stream(prompt, params))
            final = outs[-1]
            assert final.stop_reason == stop and len(final.token_ids) == 2
            assert "".join(o.text_delta for o in outs) == final.text
            assert final.text == first[:-2] + (stop if include else "")
        cases += 1
    assert cases >= 2  # the prompts gave tokens long enough to straddle


def test_logit_bias_equals_the_definition_on_hf(reference, preset_path):
    prompt = PROMPTS[0]
    plain = reference.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    bias = {plain[3]: -5.0, 4321: 7.5, 17: 3.0}
    got = reference.generate([prompt], SamplingParams(logit_bias=bias, **GREEDY))[0].token_ids

    def add_bias(x, out):
        return [v + bias.get(t, 0.0) for t, v in enumerate(x)]

    assert got == _hf_greedy_with(preset_path("tiny-llama"), prompt, 32, add_bias)
    assert got != plain


def test_sampler_bias_and_bans_leave_logprobs_raw():
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 4.0
    eos = 5
    rows = [SamplingParams(temperature=0.0, min_tokens=2, logprobs=0),
            SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[9]),
            SamplingParams(temperature=0.0, logit_bias={6: 4.5})]
    out = Sampler([eos])(logits, rows, [None] * 3, num_output_tokens=[1, 1, 0])
    assert out.token_ids[0] != eos and out.token_ids[1] == eos and out.token_ids[2] == 6
    assert out.logprobs[0].sampled.logprob == pytest.approx(
        torch.log_softmax(logits[0], -1)[out.token_ids[0]].item())
    assert Sampler([eos])(logits[:1], rows[:1], [None], num_output_tokens=[2]).token_ids == [eos]
    with pytest.raises(ValueError, match="output lengths"):
        Sampler([eos])(logits, rows, [None] * 3)


def test_none_is_an_empty_list_as_in_vllm():
    p = SamplingParams(stop=None, stop_token_ids=None, allowed_token_ids=None, bad_words=None,
                       logit_bias=None)
    assert (p.stop, p.stop_token_ids, p.allowed_token_ids, p.bad_words, p.logit_bias) == \
        ([], [], [], [], {})


@pytest.mark.parametrize("kw, match", [
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={3: 101.0}), "logit_bias values"),
    (dict(logit_bias={-3: 1.0}), "logit_bias keys"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "more than 1024"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
])
def test_sampling_params_validate_min_tokens_and_bias(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={VOCAB: 1.0}).validate_vocab(VOCAB)


def test_allowed_token_ids_equal_the_definition_on_hf(reference, preset_path):
    prompt = PROMPTS[0]
    allowed = [11, 500, 1234, 4321, 7000]
    got = reference.generate([prompt], SamplingParams(allowed_token_ids=allowed,
                                                      **GREEDY))[0].token_ids

    def only_allowed(x, out):
        return [v if t in allowed else -math.inf for t, v in enumerate(x)]

    assert got == _hf_greedy_with(preset_path("tiny-llama"), prompt, 32, only_allowed)
    assert set(got) <= set(allowed) and len(set(got)) > 1
    sampled = reference.generate([prompt] * 4, [SamplingParams(
        allowed_token_ids=allowed, temperature=1.5, seed=s, max_tokens=32, ignore_eos=True)
        for s in range(4)])
    assert all(set(o.token_ids) <= set(allowed) for o in sampled)
    with pytest.raises(ValueError, match="non-negative token ids"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(allowed_token_ids=[VOCAB]).validate_vocab(VOCAB)
