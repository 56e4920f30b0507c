"""Token embedding and LM head, split across ranks along the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import check_shape, linear_forward
from kernels.cpu_linear import PackedLinear, pack_linear
from kernels.cpu_small_linear import small_linear_usable
from engine.parallel_state import get_tp_group


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ceil(vocab / tp_size) rows; the last rank's tail is zero padding."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition,
                             num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        check_shape(loaded_weight, (self.num_embeddings, param.shape[1]))
        n = max(self.vocab_end - self.vocab_start, 0)
        param.data[n:].zero_()
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them.
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(~owned.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; each rank computes its vocab slice."""

    packed_weight: PackedLinear | None = None
    # Set by pack(): calls of few rows go to the few-rows kernel on the plain weight.
    use_small_linear: bool = False

    def pack(self, kernel: str = "onednn", few_rows_kernel: bool = True,
             threads: int | None = None) -> bool:
        """Packs the weight for ``kernel`` (CPU). The plain copy stays: a tied head shares it
        with the embedding, which looks rows up in it. False where ``kernel`` cannot run the
        dtype."""
        self.packed_weight = pack_linear(self.weight.data, kernel, threads)
        self.use_small_linear = (self.packed_weight is not None and few_rows_kernel
                                 and small_linear_usable(self.weight.data))
        return self.packed_weight is not None

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits slice, no communication: [N, hidden] -> [N, vocab / tp]."""
        return linear_forward(hidden, self.weight, self.packed_weight, None,
                              self.use_small_linear)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, hidden] -> [N, vocab]
        logits = self.matmul(hidden)
        if self.tp_size > 1:
            logits = self.tp_group.all_gather(logits, dim=-1)[:, :self.num_embeddings]
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
