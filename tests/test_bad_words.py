"""bad_words (engine/bad_words.py): the words' token sequences, the bans they put on the next
token, and greedy output under them against Hugging Face's logits with the rule applied in
plain Python."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.bad_words import bad_word_bans, tokenize_bad_words
from engine.tokenizer import load_tokenizer
from tests.hf_oracle import hf_tokenizer
from tests.hf_oracle import hf_model

GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(preset_path):
    return load_tokenizer(preset_path("tiny-llama"))


def test_each_word_is_spelled_both_ways_without_special_tokens(tokenizer, preset_path):
    hf = hf_tokenizer(preset_path("tiny-llama"))
    seqs = tokenize_bad_words(tokenizer, ["  quick fox", "quick fox"])
    plain = hf.encode("quick fox", add_special_tokens=False)
    spaced = hf.encode(" quick fox", add_special_tokens=False)
    assert plain != spaced  # the tokenizer spells them apart, so both are kept, once each
    assert seqs == [plain, spaced]
    assert hf.bos_token_id not in {t for s in seqs for t in s}
    assert tokenize_bad_words(tokenizer, []) == []
    with pytest.raises(ValueError, match="tokenizer"):
        tokenize_bad_words(None, ["x"])


def test_the_last_token_is_banned_where_the_output_ends_with_the_rest():
    seqs = [[5], [1, 2, 3], [7, 8]]
    assert bad_word_bans(seqs, []) == [5]
    assert bad_word_bans(seqs, [9, 1, 2]) == [5, 3]
    assert bad_word_bans(seqs, [1, 2, 7]) == [5, 8]
    assert bad_word_bans(seqs, [2, 1]) == [5]


@pytest.mark.parametrize("bad", [[""], ["   "], [3], ["ok"] * 257])
def test_bad_words_are_checked(bad):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=bad)


@torch.inference_mode()
def _hf_greedy_without(path, prompt: list[int], seqs: list[list[int]], n: int) -> list[int]:
    """Greedy decoding on HF's logits, the rule written out token by token. On HF's own KV
    cache: a forward of the whole sequence each step took 3x as long."""
    model = hf_model(str(path))
    out: list[int] = []
    res = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(n):
        logits = res.logits[0, -1].float()
        for seq in seqs:
            if len(seq) == 1 or out[len(out) - len(seq) + 1:] == seq[:-1]:
                logits[seq[-1]] = -float("inf")
        out.append(int(logits.argmax()))
        if len(out) < n:
            res = model(torch.tensor([out[-1:]]), cache=res.cache, use_cache=True)
    return out


def _words_from(tokenizer, ids: list[int]) -> list[str]:
    """Words spelled by single output tokens and by a pair, that tokenize back to them."""
    words = []
    for i in range(len(ids) - 1):
        for piece in ([ids[i]], ids[i:i + 2]):
            text = tokenizer.decode(piece)
            if text.strip() and tokenizer.encode_plain(text) == piece:
                words.append(text)
    return words


def test_greedy_output_avoids_the_words_as_hugging_face_would(preset_path, tokenizer):
    path = preset_path("tiny-llama")
    prompt = tokenizer.encode("Once upon a time, in a land far away,")
    with LLM(str(path)) as llm:
        plain = llm.generate([prompt], SamplingParams(**GREEDY))[0]
        words = _words_from(tokenizer, plain.token_ids)
        pair = next(w for w in words if len(tokenizer.encode_plain(w)) == 2)
        single = next(w for w in words if len(tokenizer.encode_plain(w)) == 1)
        for bad in ([single], [pair], [single, pair]):
            got = llm.generate([prompt], SamplingParams(bad_words=bad, **GREEDY))[0]
            seqs = tokenize_bad_words(tokenizer, bad)
            assert got.token_ids == _hf_greedy_without(path, prompt, seqs, len(got.token_ids))
            assert got.token_ids != plain.token_ids  # the word was in the way
            for seq in seqs:
                assert all(got.token_ids[i:i + len(seq)] != seq
                           for i in range(len(got.token_ids)))


def test_bans_give_way_where_they_would_leave_no_allowed_token(tokenizer):
    from engine.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    allowed = [7, 9]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed, min_tokens=2,
                             stop_token_ids=allowed),  # everything allowed is held back
              SamplingParams(temperature=0.0, allowed_token_ids=allowed, min_tokens=2,
                             stop_token_ids=[9]),  # one allowed token is left
              SamplingParams(temperature=0.8, allowed_token_ids=allowed, min_tokens=2,
                             stop_token_ids=allowed)]
    out = Sampler()(logits, params, [None] * 3, num_output_tokens=[0, 0, 0])
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.token_ids[1] == 7
    assert out.token_ids[2] in allowed
    # Bad words alike: a one-token word that is the only allowed token.
    out = Sampler()(logits[:1], [SamplingParams(temperature=0.0, allowed_token_ids=[7])],
                    [None], bad_word_bans=[[7]])
    assert out.token_ids == [7]
