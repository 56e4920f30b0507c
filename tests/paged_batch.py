"""A minimal stand-in for the engine's model runner, for model tests: it owns a KV cache,
hands out (shuffled) blocks, and builds the AttentionMetadata of each step."""
from __future__ import annotations

import torch

from engine.model_config import ModelConfig
from kernels.attention_backend import AttentionMetadata

VOCAB = 512


class PagedBatcher:
    """The test's stand-in for the engine runner: block tables, slots and metadata."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int = 48,
                 block_size: int = 16, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        weight = model.lm_head.weight
        self.device = weight.device
        self.kv_cache = torch.zeros(num_blocks, cfg.num_hidden_layers, 2, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, dtype=weight.dtype,
                                    device=self.device)
        model.bind_kv_cache(self.kv_cache)
        # Shuffled so sequences get scattered, non-contiguous blocks.
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = self.free.tolist()
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, chunks: list[tuple[str, list[int]]], num_decodes: int = 0) -> torch.Tensor:
        """Runs one flattened batch; returns [num_tokens, vocab] logits of every token."""
        bs = self.block_size
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, tokens in chunks:
            start = self.computed.get(seq_id, 0)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * bs < start + len(tokens):
                table.append(self.free.pop())
            for pos in range(start, start + len(tokens)):
                slots.append(table[pos // bs] * bs + pos % bs)
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.computed[seq_id] = start + len(tokens)
        width = max(len(self.tables[s]) for s, _ in chunks)
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in chunks]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(rows, dtype=torch.int32, device=dev),
            query_lens_list=query_lens, seq_lens_list=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_size=bs, num_decodes=num_decodes)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            meta)
        assert hidden.shape == (len(ids), self.model.config.hidden_size)
        return self.model.compute_logits(hidden).cpu()


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
