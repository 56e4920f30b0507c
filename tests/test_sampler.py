"""Tests for the batched sampler: greedy, filters, seeds, statistics and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Logprob, Sampler, SamplerOutput, TokenLogprobs, make_generator
from engine.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def fixed_default_rng():
    # Unseeded rows draw from the default RNG: pin it so every test is deterministic, and
    # restore it so other test files are unaffected.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None] | None = None) -> SamplerOutput:
    return sampler(logits, params, generators or [None] * len(params))


def _repeat(probs: list[float], num_rows: int) -> torch.Tensor:
    """The same known distribution on every row: [num_rows, len(probs)] logits."""
    return torch.tensor(probs).log().unsqueeze(0).repeat(num_rows, 1)


def test_greedy_is_argmax(sampler):
    logits = torch.randn(8, 1000)
    for temperature in (0.0, 1e-7):
        out = _sample(sampler, logits, [SamplingParams(temperature=temperature)] * 8)
        assert out.token_ids == logits.argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 8


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_greedy(sampler, temperature):
    logits = torch.randn(16, 500)
    out = _sample(sampler, logits, [SamplingParams(temperature=temperature, top_k=1)] * 16)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_stays_in_k_best(sampler):
    row = torch.randn(200)
    k = 5
    allowed = set(row.topk(k).indices.tolist())
    out = _sample(sampler, row.repeat(2000, 1),
                  [SamplingParams(temperature=3.0, top_k=k)] * 2000)
    assert set(out.token_ids) == allowed  # never outside, and every one of them reachable


def test_top_p_stays_in_nucleus(sampler):
    # Cumulative mass 0.4, 0.7, 0.9, ...: with top_p=0.75 the nucleus is the first three.
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    out = _sample(sampler, _repeat(probs, 2000), [SamplingParams(top_p=0.75)] * 2000)
    assert set(out.token_ids) == {0, 1, 2}


def test_top_p_keeps_at_least_one_token(sampler):
    logits = torch.randn(64, 300)
    out = _sample(sampler, logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_applies_to_the_top_k_renormalised(sampler):
    # After top_k=2 the mass is 0.57 / 0.43, so top_p=0.55 keeps only the first token
    # (over the raw distribution, 0.4 < 0.55 would have kept two).
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    out = _sample(sampler, _repeat(probs, 500), [SamplingParams(top_k=2, top_p=0.55)] * 500)
    assert set(out.token_ids) == {0}


def test_min_p_excludes_unlikely_tokens(sampler):
    # min_p * p_max = 0.125: tokens 3 (0.1) and 4 (0.05) are out.
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    out = _sample(sampler, _repeat(probs, 2000), [SamplingParams(min_p=0.25)] * 2000)
    assert set(out.token_ids) == {0, 1, 2}


def test_top_p_applies_to_what_min_p_kept_renormalised(sampler):
    # vLLM's v1 order: min_p=0.5 keeps 0.40 and 0.35 (renormalised 0.53 / 0.47), so top_p=0.5
    # then keeps only the first; over the raw distribution 0.40 < 0.5 would have kept both.
    probs = [0.40, 0.35, 0.05, 0.05, 0.05, 0.05, 0.05]
    out = _sample(sampler, _repeat(probs, 500), [SamplingParams(min_p=0.5, top_p=0.5)] * 500)
    assert set(out.token_ids) == {0}
    # With top-k as well, and in a batch beside rows without min_p.
    params = [SamplingParams(min_p=0.5, top_p=0.5, top_k=3), SamplingParams(top_p=0.5)] * 500
    out = _sample(sampler, _repeat(probs, 1000), params)
    assert set(out.token_ids[0::2]) == {0} and set(out.token_ids[1::2]) == {0, 1}


def test_filters_combine_per_row(sampler):
    # Each row has its own filter in one batch; none may leak into another row.
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    rows = {"top_k": SamplingParams(top_k=2), "top_p": SamplingParams(top_p=0.75),
            "min_p": SamplingParams(min_p=0.4), "none": SamplingParams()}
    allowed = {"top_k": {0, 1}, "top_p": {0, 1, 2}, "min_p": {0, 1, 2}, "none": set(range(5))}
    names = list(rows) * 600
    out = _sample(sampler, _repeat(probs, len(names)), [rows[n] for n in names])
    for name in rows:
        seen = {t for n, t in zip(names, out.token_ids) if n == name}
        assert seen == allowed[name], name


def _seeded_run(sampler: Sampler, target: torch.Tensor, params: SamplingParams,
                neighbours: list[tuple[torch.Tensor, SamplingParams]], position: int,
                num_steps: int = 12) -> list[int]:
    """Tokens the seeded target row gets over several steps inside a given batch."""
    rows = list(neighbours)
    rows.insert(position, (target, params))
    generators = [make_generator(p.seed, "cpu") for _, p in rows]
    logits = torch.stack([r for r, _ in rows])
    tokens = []
    for _ in range(num_steps):
        out = sampler(logits, [p for _, p in rows], generators)
        tokens.append(out.token_ids[position])
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=42),
    SamplingParams(temperature=1.3, top_k=40, seed=42),
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01, seed=42),
])
def test_seed_is_independent_of_batch(sampler, params):
    target = torch.randn(1000)
    others = [(torch.randn(1000), p) for p in (
        SamplingParams(),  # unseeded: shares the default RNG
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, seed=7),  # forces the sort path for the whole batch
        SamplingParams(temperature=2.0, top_k=3, min_p=0.2),
    )]
    alone = _seeded_run(sampler, target, params, [], 0)
    assert len(set(alone)) > 1  # a real random stream, not a constant
    assert _seeded_run(sampler, target, params, others, 0) == alone
    assert _seeded_run(sampler, target, params, others, 2) == alone
    assert _seeded_run(sampler, target, params, others[1:2], 1) == alone
    assert _seeded_run(sampler, target, params, others[3:], 1) == alone


def test_different_seeds_differ(sampler):
    target = torch.zeros(1000)  # uniform: two streams agreeing by chance is ~1e-36
    streams = [_seeded_run(sampler, target, SamplingParams(seed=s), [], 0) for s in (1, 2)]
    assert streams[0] != streams[1]


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(5, "cpu"), make_generator(5, torch.device("cpu"))
    assert torch.equal(torch.rand(10, generator=a), torch.rand(10, generator=b))


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_sampling_matches_distribution(sampler, temperature):
    probs = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    num_samples = 20000
    out = _sample(sampler, _repeat(probs.tolist(), num_samples),
                  [SamplingParams(temperature=temperature)] * num_samples)
    expected = torch.softmax(probs.log() / temperature, dim=0)
    # 5 degrees of freedom: P(chi2 > 40) is about 1e-7, so this only fails on a real bias.
    assert _chi_square(out.token_ids, expected) < 40.0


def test_seeded_sampling_matches_distribution(sampler):
    probs = torch.tensor([0.5, 0.3, 0.2])
    tokens = []
    for seed in range(3000):
        out = sampler(_repeat(probs.tolist(), 1), [SamplingParams(seed=seed)],
                      [make_generator(seed, "cpu")])
        tokens.extend(out.token_ids)
    assert _chi_square(tokens, probs) < 30.0  # 2 degrees of freedom


def test_logprobs_are_raw_log_softmax(sampler):
    logits = torch.randn(6, 300) * 2
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.7, top_k=20, logprobs=3),
              SamplingParams(temperature=1.5, top_p=0.8),  # did not ask
              SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=2.0, min_p=0.05, logprobs=20),
              SamplingParams(temperature=0.0)]
    out = _sample(sampler, logits, params)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None and out.logprobs[5] is None
    for i in (0, 1, 3, 4):
        entry = out.logprobs[i]
        assert isinstance(entry, TokenLogprobs)
        token = out.token_ids[i]
        assert entry.sampled.token_id == token
        assert entry.sampled.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert entry.sampled.rank == int((reference[i] > reference[i, token]).sum()) + 1

        n = params[i].logprobs
        assert len(entry.top) == n
        expected = reference[i].topk(n) if n else None
        for r, lp in enumerate(entry.top):
            assert lp == Logprob(token_id=expected.indices[r].item(), logprob=lp.logprob,
                                 rank=r + 1)
            assert lp.logprob == pytest.approx(expected.values[r].item(), abs=1e-5)
        assert [lp.logprob for lp in entry.top] == sorted((lp.logprob for lp in entry.top),
                                                          reverse=True)
    assert out.logprobs[0].sampled.rank == 1  # greedy took the most likely token


def test_logprobs_larger_than_vocab(sampler):
    logits = torch.randn(1, 4)
    out = _sample(sampler, logits, [SamplingParams(temperature=0.0, logprobs=20)])
    assert [lp.rank for lp in out.logprobs[0].top] == [1, 2, 3, 4]


def test_mixed_batch_of_greedy_and_random_rows(sampler):
    logits = torch.randn(40, 400)
    params = [SamplingParams(temperature=0.0) if i % 3 == 0
              else SamplingParams(temperature=1.5, top_k=4, seed=i if i % 2 else None)
              for i in range(40)]
    generators = [make_generator(p.seed, "cpu") for p in params]
    out = sampler(logits, params, generators)
    argmax = logits.argmax(dim=-1).tolist()
    top4 = logits.topk(4, dim=-1).indices.tolist()
    for i, token in enumerate(out.token_ids):
        if i % 3 == 0:
            assert token == argmax[i]
        else:
            assert token in top4[i]
    random_rows = [i for i in range(40) if i % 3]
    assert any(out.token_ids[i] != argmax[i] for i in random_rows)


def test_masked_vocab_entries_are_never_sampled(sampler):
    # Models pad the vocabulary with -inf logits; no filter combination may pick them.
    logits = torch.randn(300, 50)
    logits[:, 40:] = -math.inf
    params = [SamplingParams(temperature=t, top_p=p, min_p=m)
              for t, p, m in [(1.0, 1.0, 0.0), (5.0, 0.99, 0.0), (5.0, 1.0, 1e-9)]] * 100
    out = _sample(sampler, logits, params)
    assert max(out.token_ids) < 40


@pytest.mark.parametrize("params", [SamplingParams(allowed_token_ids=[7]),
                                    SamplingParams(top_p=0.5), SamplingParams(min_p=0.5),
                                    SamplingParams(top_k=1, seed=3)])
def test_a_uniform_draw_of_zero_never_picks_a_filtered_token(sampler, monkeypatch, params):
    """uniform_ returns exactly 0 about once in 2**24 draws: that token's noise was -inf,
    and a row whose filters left only that token went all -inf, so argmax took token 0."""
    def zeros(self, *args, **kwargs):
        return self.zero_()

    monkeypatch.setattr(torch.Tensor, "uniform_", zeros)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(*a, **k))
    logits = torch.full((1, 10), -2.0)
    logits[0, 7] = 3.0  # the one token each filter keeps
    assert _sample(sampler, logits, [params], [make_generator(params.seed, "cpu")]).token_ids == [7]


def test_empty_batch(sampler):
    out = sampler(torch.empty(0, 10), [], [])
    assert out == SamplerOutput(token_ids=[], logprobs=[])


def test_mismatched_inputs_raise(sampler):
    with pytest.raises(ValueError, match="must match"):
        sampler(torch.randn(2, 10), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="must match"):
        sampler(torch.randn(2, 10), [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match="num_reqs, vocab"):
        sampler(torch.randn(10), [SamplingParams()], [None])
