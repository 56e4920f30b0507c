"""Batched next-token sampling: penalties, logit bias, allowed tokens, min_tokens, greedy,
temperature, top-k, top-p, min-p, seeds, logprobs.

One call samples one token for every request of the step. The work is batched: greedy rows
share one argmax, random rows share one temperature division, one threshold per row that
folds top-k, top-p and min-p into a single mask, and one exponential race.

Filters are expressed as a per-row logit threshold (keep tokens whose scaled logit is >= it)
rather than as a scattered boolean mask. The threshold depends only on a row's sorted
*values*, never on sort indices, so a row gets the same mask whether the batch took the full
sort path or the cheaper top-k-only path, and whatever else shares the batch. The price is
that tokens tied with the last kept token are kept too; tied tokens are equally likely, so
"which of them is in the top k" has no meaningful answer anyway.

Logprobs are the log-softmax of the RAW logits, before temperature, top-k, top-p and min-p,
which is what vLLM reports by default ("raw_logprobs"): they describe the model, not the
sampling distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.logprobs import Logprob, TokenLogprobs
from engine.penalties import PenaltyState, apply_penalties
from engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # One entry per request; None where the request did not ask for logprobs.
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A private RNG for a seeded request; None means "use the default RNG"."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _is_greedy(params: SamplingParams) -> bool:
    # top_k == 1 leaves only the argmax, whatever the temperature: skip the random path.
    return params.greedy or params.top_k == 1


class Sampler:
    def __init__(self, eos_token_ids: list[int] = ()) -> None:
        # What min_tokens holds back besides each request's stop_token_ids.
        self.eos_token_ids = list(eos_token_ids)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 penalty_states: list[PenaltyState | None] | None = None,
                 num_output_tokens: list[int] | None = None,
                 bad_word_bans: list[list[int]] | None = None,
                 choices: list[list[int] | torch.Tensor | None] | None = None) -> SamplerOutput:
        """Samples one token per row of ``logits`` [num_reqs, vocab]. Rows whose params have
        penalties need their request's ``PenaltyState``, and rows with ``min_tokens`` their
        output length so far (``num_output_tokens``); ``bad_word_bans`` are per row token ids
        this step must not sample (engine/bad_words.py), ``choices`` per row the only ones it
        may (a list or an integer tensor, its guide's: engine/guides.py; None: any)."""
        _check_inputs(logits, params, generators)
        if choices is not None and len(choices) != len(params):
            raise ValueError(f"{len(choices)} rows of choices for {len(params)} rows")
        num_reqs = logits.shape[0]
        if num_reqs == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw = logits  # logprobs describe the model: before penalties, bias and bans
        # vLLM's order: allowed ids, bans and bias, then penalties (a repetition penalty
        # divides a biased logit: (x + b) / r, not x / r + b). Bans stay -inf through them.
        logits = _biased_and_banned(logits, params, self._banned(params, num_output_tokens,
                                                                  bad_word_bans), choices)
        logits = _penalised(logits, params, penalty_states)

        random_rows = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)  # [num_reqs]
        elif len(random_rows) == num_reqs:
            token_ids = _sample_random(logits, params, generators)
        else:
            token_ids = logits.argmax(dim=-1)
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = _sample_random(logits[rows], [params[i] for i in random_rows],
                                             [generators[i] for i in random_rows])
        return SamplerOutput(token_ids=token_ids.tolist(),
                             logprobs=_compute_logprobs(raw, token_ids, params))

    def _banned(self, params: list[SamplingParams], num_output_tokens: list[int] | None,
                bad_word_bans: list[list[int]] | None) -> list[list[int]] | None:
        """Per row, the stop tokens min_tokens still holds back and the bad words' bans;
        None when no row has any."""
        if bad_word_bans is not None and len(bad_word_bans) != len(params):
            raise ValueError(f"{len(bad_word_bans)} rows of bad word bans for {len(params)} rows")
        rows = [i for i, p in enumerate(params) if p.min_tokens > 0]
        if not rows:
            return bad_word_bans if bad_word_bans and any(bad_word_bans) else None
        if num_output_tokens is None or len(num_output_tokens) != len(params):
            raise ValueError("rows with min_tokens need their output lengths")
        banned = [list(b) for b in bad_word_bans] if bad_word_bans else [[] for _ in params]
        for i in rows:
            p = params[i]
            if num_output_tokens[i] < p.min_tokens:
                banned[i] += p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
        return banned if any(banned) else None


def _biased_and_banned(logits: torch.Tensor, params: list[SamplingParams],
                       banned: list[list[int]] | None,
                       choices: list[list[int] | torch.Tensor | None] | None = None,
                       owned: bool = False) -> torch.Tensor:
    """logits plus each row's logit_bias, with the tokens outside its allowed_token_ids (or
    this step's ``choices``) and its banned ones at -inf (in place when ``owned``, else in a
    copy).

    The bans (min_tokens, bad words) give way in a row where they would leave no token at all
    (allowed_token_ids all banned): the row samples from its allowed tokens as if unbanned,
    rather than from a row of -inf, whose argmax is token 0, allowed or not."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    # SamplingParams refuses allowed_token_ids beside guided_choice: a row has one or none.
    keeps = [c if choices is not None and c is not None else p.allowed_token_ids
             for p, c in zip(params, choices or [None] * len(params))]
    allowed = [i for i, k in enumerate(keeps) if len(k)]
    if not biased and not allowed and banned is None:
        return logits
    # A copy unless the penalties already made one ([num_rows, vocab] float32).
    out = logits if owned else logits.float().clone()
    for i in allowed:
        keep = torch.as_tensor(keeps[i], dtype=torch.long, device=out.device)
        kept = out[i, keep]
        out[i] = -math.inf
        out[i, keep] = kept
    for i in biased:
        bias = params[i].logit_bias
        ids = torch.tensor(list(bias), dtype=torch.long, device=out.device)
        out[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=out.dtype,
                                               device=out.device))
    undo = []
    for i, ids in enumerate(banned or ()):
        if ids:
            if allowed:
                undo.append((i, ids, out[i, ids].clone()))
            out[i, ids] = -math.inf
    if undo:
        dead = torch.isneginf(out.amax(dim=-1)).tolist()  # one reduction and sync a step
        for i, ids, values in undo:
            if dead[i]:
                out[i, ids] = values
    return out


def _penalised(logits: torch.Tensor, params: list[SamplingParams],
               states: list[PenaltyState | None] | None) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    if states is None or len(states) != len(params) or any(states[i] is None for i in rows):
        raise ValueError("rows with penalties need their requests' penalty states")
    sub = [params[i] for i in rows]
    args = ([p.repetition_penalty for p in sub], [p.presence_penalty for p in sub],
            [p.frequency_penalty for p in sub], [states[i] for i in rows])
    if len(rows) == len(params):
        return apply_penalties(logits, *args)
    index = torch.tensor(rows, device=logits.device)
    out = logits.float().clone()
    out[index] = apply_penalties(logits[index], *args)
    return out


def _check_inputs(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_reqs, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"got {logits.shape[0]} logit rows, {len(params)} sampling params and "
                         f"{len(generators)} generators; they must match one to one")


def _sample_random(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> torch.Tensor:
    """Samples rows that are not greedy. Returns [num_rows] int64."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                               device=logits.device)
    x = logits.float() / temperature.unsqueeze(1)  # [num_rows, vocab], a fresh tensor
    threshold = _keep_threshold(x, params)
    if threshold is not None:
        x = torch.where(x < threshold, -math.inf, x)
    # Gumbel-max: argmax(x + g), g ~ Gumbel(0, 1), is a draw from softmax(x); it is the
    # exponential race argmax(p / q), q ~ Exp(1), taken in log space, so no softmax.
    return x.add_(_gumbel_noise(x, generators)).argmax(dim=-1)


def _gumbel_noise(x: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Gumbel(0, 1) noise shaped like x [num_rows, vocab].

    A seeded row draws exactly ``vocab`` uniforms from its own generator and nothing else, so
    its token does not depend on its batch neighbours or its position. Unseeded rows share
    one draw from the default RNG.
    """
    # -log(-log u) from uniforms: torch's CPU exponential_ is several times slower than
    # rand + two logs. uniform_ returns exactly 0 about once in 2**24 draws: its -inf noise
    # made a row whose filters left one token all -inf, and argmax then picked token 0, which
    # the filters had ruled out. Clamped to the smallest normal float, the noise stays finite.
    uniform = torch.empty_like(x)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        uniform.uniform_()
    else:
        if len(seeded) < len(generators):
            unseeded = torch.tensor([i for i, g in enumerate(generators) if g is None],
                                    device=x.device)
            uniform[unseeded] = torch.rand((len(unseeded), x.shape[1]), device=x.device)
        for i in seeded:
            uniform[i].uniform_(generator=generators[i])
    return uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_().log_().neg_()


def _keep_threshold(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Lowest scaled logit each row keeps after min-p, top-k and top-p: [num_rows, 1].

    None when no row filters anything; a row that filters nothing gets its minimum or -inf.
    """
    vocab = x.shape[1]
    device = x.device
    min_p_threshold = None
    if any(p.min_p > 0.0 for p in params):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); log(0) = -inf keeps all.
        log_min_p = torch.tensor([p.min_p for p in params], device=device).log()
        min_p_threshold = x.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    needs_top_p = any(p.top_p < 1.0 for p in params)
    if not needs_top_p and all(k == vocab for k in top_k):
        return min_p_threshold
    sorted_x = _sort_descending(x)
    if min_p_threshold is not None and needs_top_p:
        # min-p first, as vLLM's v1 sampler has it: top-p's nucleus is taken over what min-p
        # kept, renormalised (after, it would be taken over the whole distribution and could
        # keep more). Top-k's count is the same either way: min-p keeps a prefix.
        sorted_x = sorted_x.masked_fill(sorted_x < min_p_threshold, -math.inf)
    top_p = [p.top_p if p.top_p < 1.0 else math.inf for p in params] if needs_top_p else None
    threshold = _top_k_top_p_threshold(
        sorted_x, torch.tensor(top_k, device=device),
        None if top_p is None else torch.tensor(top_p, device=device))
    if min_p_threshold is None:
        return threshold
    return torch.maximum(threshold, min_p_threshold)


def _sort_descending(x: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first: [num_rows, vocab]. No indices: thresholds need none."""
    if x.device.type == "cpu":
        # numpy's SIMD sort is about ten times faster than torch.sort on CPU, and sorted
        # values are exact either way.
        return torch.from_numpy(np.ascontiguousarray(np.sort(x.numpy(), axis=-1)[:, ::-1]))
    return x.sort(dim=-1, descending=True).values


def _top_k_top_p_threshold(sorted_x: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor | None) -> torch.Tensor:
    """Threshold after top-k, then top-p over the top-k renormalised (vLLM's order).

    sorted_x [num_rows, vocab] descending, top_k [num_rows] (vocab = off),
    top_p [num_rows] (inf = off) or None when no row uses it. Returns [num_rows, 1].
    """
    num_kept = top_k
    if top_p is not None:
        positions = torch.arange(sorted_x.shape[1], device=sorted_x.device)
        masked = sorted_x.masked_fill(positions >= top_k.unsqueeze(1), -math.inf)
        cumulative = masked.softmax(dim=-1).cumsum_(dim=-1)  # [num_rows, vocab], non-decreasing
        # The nucleus is the shortest prefix whose mass reaches top_p: the positions still
        # below top_p plus the one that crosses it, so at least one token.
        in_nucleus = (cumulative < top_p.unsqueeze(1)).sum(dim=-1) + 1
        num_kept = torch.minimum(in_nucleus, top_k)
    return sorted_x.gather(1, (num_kept - 1).unsqueeze(1))


def _compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                      params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Raw-logit logprobs of the sampled token and the top-n, only for rows that asked."""
    result: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return result
    if len(rows) < len(params):
        index = torch.tensor(rows, device=logits.device)
        logits, token_ids = logits[index], token_ids[index]
    for i, lp in zip(rows, token_logprobs(logits, token_ids,
                                          [params[i].logprobs for i in rows])):
        result[i] = lp
    return result


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logits`` [num_rows, vocab]: the log-softmax at ``token_ids`` [num_rows]
    with its rank, and the row's ``num_top[row]`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1

    k = min(max(num_top, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [num_rows, k], descending
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    token_list, chosen_list, rank_list = (token_ids.tolist(), chosen.squeeze(1).tolist(),
                                          ranks.tolist())
    return [TokenLogprobs(
        sampled=Logprob(token_id=token_list[j], logprob=chosen_list[j], rank=rank_list[j]),
        top=[Logprob(token_id=top_ids[j][r], logprob=top_values[j][r], rank=r + 1)
             for r in range(min(n, k))]) for j, n in enumerate(num_top)]
