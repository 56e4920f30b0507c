"""A model input as one flat int64 buffer, for rank 0 to hand each step to its TP workers.

Pickle-free on purpose: a worker only ever decodes numbers, so a corrupted or hostile message
can fail to parse but never run code. Layout (all int64): the header
``[num_tokens, num_seqs, max_blocks, num_sampled, num_decodes, block_size, num_copies]``, then
input_ids, positions, slot_mapping (num_tokens each), query_start_loc (num_seqs + 1),
seq_lens (num_seqs), block_tables (num_seqs * max_blocks), sample_indices (num_sampled),
block_copies (num_copies source, destination pairs).
"""
from __future__ import annotations

import torch

from engine.model_runner import ModelInput
from kernels.attention_backend import AttentionMetadata

_HEADER = 7


def encode_model_input(inp: ModelInput) -> bytes:
    meta = inp.meta
    num_seqs, max_blocks = meta.block_tables.shape
    copies = (inp.block_copies if inp.block_copies is not None
              else torch.empty((0, 2), dtype=torch.int64))
    header = torch.tensor([meta.num_tokens, num_seqs, max_blocks, inp.sample_indices.numel(),
                           meta.num_decodes, meta.block_size, copies.shape[0]],
                          dtype=torch.int64)
    parts = [header, inp.input_ids, inp.positions, meta.slot_mapping, meta.query_start_loc,
             meta.seq_lens, meta.block_tables.reshape(-1), inp.sample_indices,
             copies.reshape(-1)]
    flat = torch.cat([p.to(device="cpu", dtype=torch.int64) for p in parts])
    return flat.numpy().tobytes()


def decode_model_input(data: bytes, device: torch.device) -> ModelInput:
    if len(data) % 8 or len(data) < 8 * _HEADER:
        raise ValueError(f"step message of {len(data)} bytes is not a model input")
    flat = torch.frombuffer(bytearray(data), dtype=torch.int64)
    n_tok, n_seq, max_blocks, n_samp, n_dec, block_size, n_copies = flat[:_HEADER].tolist()
    sizes = [n_tok, n_tok, n_tok, n_seq + 1, n_seq, n_seq * max_blocks, n_samp, 2 * n_copies]
    if min(sizes) < 0 or _HEADER + sum(sizes) != flat.numel():
        raise ValueError("step message sizes do not add up")
    ids, pos, slots, qsl, seq_lens, tables, samples, copies = flat[_HEADER:].split(sizes)
    seq_lens_list = seq_lens.tolist()
    qsl_list = qsl.tolist()
    query_lens = [b - a for a, b in zip(qsl_list, qsl_list[1:])]
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=qsl.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        block_tables=tables.view(n_seq, max_blocks).to(device=device, dtype=torch.int32),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens_list,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_list),
        block_size=block_size,
        num_decodes=n_dec,
    )
    return ModelInput(input_ids=ids.to(device), positions=pos.to(device), meta=meta,
                      sample_indices=samples.to(device), sample_request_ids=[],
                      block_copies=copies.view(n_copies, 2) if n_copies else None)
