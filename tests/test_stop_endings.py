"""How an output ends when its last text and its last token disagree: a stop token whose text
completes a stop string, and a stop string let out only by the final flush. The engine's
sampler is replaced by a script of token ids, so the text is exactly what the test names."""
from __future__ import annotations

import pytest

import engine.llm_engine as llm_engine
from engine import LLM, SamplingParams
from engine.sampler import SamplerOutput


def _scripted(monkeypatch, script: list[int]) -> None:
    def sample(_sampler, _logits, sched, _device):
        rows = [s.request for s in sched.scheduled if s.samples]
        return SamplerOutput([script[r.num_output_tokens] for r in rows], [None] * len(rows))

    monkeypatch.setattr(llm_engine, "sample_tokens", sample)


@pytest.fixture(scope="module")
def llm():
    with LLM("micro-llama", num_gpu_blocks=64) as llm:
        yield llm


def test_a_stop_token_ends_the_output_as_it_is_its_text_unsearched(llm, monkeypatch):
    """vLLM's rule: a stop token kept in the text (include_stop_str_in_output) is not searched
    for stop strings. Its text was cut at one it completed, the stop reason still the token."""
    script = [272, 258, 795, 161]  # " the", "st", "op", ...
    assert [llm.tokenizer.decode([t]) for t in script[:3]] == [" the", "st", "op"]
    _scripted(monkeypatch, script)
    params = SamplingParams(max_tokens=8, stop=["to"], stop_token_ids=[795],
                            include_stop_str_in_output=True)
    out = llm.generate([[8189, 1065]], params)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([272, 258, 795], "stop", 795)
    assert out.text == " thestop"


def test_a_stop_string_the_final_flush_lets_out_ends_the_output_as_a_stop(llm, monkeypatch):
    """Whole characters held behind an unfinished one (token 1273: "ри" and a lead byte) are
    searched only once let out; the last flush found the stop string and cut the text, while
    the output said it ended for length."""
    script = [46, 50, 51, 1273, 272]  # "O", "S", "T", "ри" + the first byte of a character
    _scripted(monkeypatch, script)
    out = llm.generate([[8189, 1065]], SamplingParams(max_tokens=4, stop=["Tри"]))[0]
    assert out.token_ids == script[:4] and out.text == "OS"
    assert (out.finish_reason, out.stop_reason) == ("stop", "Tри")


def test_text_held_before_an_eos_is_still_searched_for_stop_strings(llm, monkeypatch):
    """eos not kept in the text: the final flush holds only earlier tokens' text, which a
    stop string in it still cuts."""
    (eos,) = llm.engine.outputs.eos_token_ids
    script = [46, 50, 51, 1273, eos]
    _scripted(monkeypatch, script)
    out = llm.generate([[8189, 1065]], SamplingParams(max_tokens=8, stop=["Tри"]))[0]
    assert out.text == "OS" and out.finish_reason == "stop"
