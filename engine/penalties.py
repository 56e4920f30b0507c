"""Repetition, presence and frequency penalties, applied to a step's logits before sampling.

Definitions are vLLM's (and, for the repetition penalty, Hugging Face's):

- ``repetition_penalty`` r: every token seen in the prompt or the output so far has its logit
  divided by r when positive, multiplied by r otherwise (r > 1 discourages repeats);
- ``presence_penalty`` p: ``p`` is subtracted from every token the output contains;
- ``frequency_penalty`` f: ``f * count`` is subtracted, count being how often the output
  contains the token.

"Output" means every token sampled for the request so far, including those it resumed from
after a migration and the first token a prefill worker sampled, since the engine keeps those
apart from the prompt everywhere. Each penalised request keeps its counts between steps
(``PenaltyState``) and adds only the tokens new since its last step, so a step costs
O(new tokens) per request plus one batched pass over the penalised rows' logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyState:
    """One request's token statistics on the logits' device."""

    prompt_mask: torch.Tensor    # [vocab] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [vocab] int32: occurrences in the output
    num_counted: int = 0         # output tokens already in output_counts

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int], vocab_size: int,
                   device: torch.device) -> PenaltyState:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[torch.tensor(prompt_token_ids, dtype=torch.long, device=device)] = True
        return cls(mask, torch.zeros(vocab_size, dtype=torch.int32, device=device))

    def update(self, output_token_ids: list[int]) -> None:
        """Counts the output tokens added since the last update."""
        new = output_token_ids[self.num_counted:]
        if new:
            idx = torch.tensor(new, dtype=torch.long, device=self.output_counts.device)
            self.output_counts.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
            self.num_counted = len(output_token_ids)


def apply_penalties(logits: torch.Tensor, repetition: list[float], presence: list[float],
                    frequency: list[float], states: list[PenaltyState]) -> torch.Tensor:
    """Penalised copy of ``logits`` [num_rows, vocab], one state and one value of each
    penalty per row (1.0 / 0.0 / 0.0: that penalty off)."""
    _check(logits, repetition, presence, frequency, states)
    device = logits.device
    x = logits.float().clone()                                    # [num_rows, vocab]
    counts = torch.stack([s.output_counts for s in states])      # [num_rows, vocab] int32
    in_output = counts > 0
    if any(r != 1.0 for r in repetition):
        r = torch.tensor(repetition, dtype=torch.float32, device=device).unsqueeze(1)
        seen = in_output | torch.stack([s.prompt_mask for s in states])
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if any(f != 0.0 for f in frequency):
        f = torch.tensor(frequency, dtype=torch.float32, device=device).unsqueeze(1)
        x -= f * counts
    if any(p != 0.0 for p in presence):
        p = torch.tensor(presence, dtype=torch.float32, device=device).unsqueeze(1)
        x -= p * in_output
    return x


def _check(logits, repetition, presence, frequency, states) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if not len(repetition) == len(presence) == len(frequency) == len(states) == n:
        raise ValueError(f"{n} logit rows need as many penalties and states")
    for s in states:
        if s.output_counts.shape != (vocab,) or s.prompt_mask.shape != (vocab,):
            raise ValueError(f"penalty state of {tuple(s.output_counts.shape)} for a vocab of "
                             f"{vocab}")
