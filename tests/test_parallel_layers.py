"""Tensor-parallel shard math: every rank's slice, put back together, is the full layer.

Single-process tests set the TP rank/size by hand and rebuild the full result from each rank's
local output. One test runs the whole model with 2 gloo processes against the 1-process model.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                           QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding)
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.parallel_state import (destroy_tp_group, get_tp_rank, get_tp_size, init_tp_group,
                                   tensor_model_parallel_all_gather,
                                   tensor_model_parallel_all_reduce)
from kernels import get_attention_backend
from tests.paged_batch import PagedBatcher, random_tokens


@pytest.fixture(autouse=True)
def _reset_tp():
    yield
    destroy_tp_group()


def per_rank(tp_size: int, build):
    """build() on each rank of a tp_size group, in rank order."""
    layers = []
    for rank in range(tp_size):
        init_tp_group(rank, tp_size)
        layers.append(build())
    destroy_tp_group()
    return layers


def load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def test_defaults_and_identity_collectives():
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    x = torch.randn(3, 4)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x, dim=0) is x
    with pytest.raises(ValueError, match="invalid tensor-parallel rank"):
        init_tp_group(2, 2)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_and_row_parallel(tp_size):
    x = torch.randn(5, 16)
    w1, b1 = torch.randn(32, 16), torch.randn(32)
    w2, b2 = torch.randn(8, 32), torch.randn(8)
    cols = per_rank(tp_size, lambda: ColumnParallelLinear(16, 32, bias=True))
    rows = per_rank(tp_size, lambda: RowParallelLinear(32, 8, bias=True))
    for col, row in zip(cols, rows):
        load(col, "weight", w1), load(col, "bias", b1)
        load(row, "weight", w2), load(row, "bias", b2)
    hidden = F.linear(x, w1, b1)
    # Column outputs concatenate to the full output.
    torch.testing.assert_close(torch.cat([c(x) for c in cols], dim=-1), hidden)
    # Row partial products (on each rank's column slice) sum to the full output.
    parts = hidden.chunk(tp_size, dim=-1)
    total = sum(F.linear(p, r.weight) for p, r in zip(parts, rows)) + rows[0].bias
    torch.testing.assert_close(total, F.linear(hidden, w2, b2))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_merged_gate_up(tp_size):
    x = torch.randn(3, 8)
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    layers = per_rank(tp_size, lambda: MergedColumnParallelLinear(8, [12, 12]))
    for layer in layers:
        load(layer, "weight", gate, 0), load(layer, "weight", up, 1)
    outs = [layer(x).chunk(2, dim=-1) for layer in layers]
    torch.testing.assert_close(torch.cat([g for g, _ in outs], -1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat([u for _, u in outs], -1), F.linear(x, up))


@pytest.mark.parametrize("tp_size, num_kv_heads", [(1, 2), (2, 2), (2, 4), (4, 2), (4, 1)])
def test_qkv_heads_split_or_replicated(tp_size, num_kv_heads):
    heads, head_size = 8, 4
    x = torch.randn(3, 16)
    wq = torch.randn(heads * head_size, 16)
    wk, wv = torch.randn(2, num_kv_heads * head_size, 16)
    bq, bk, bv = torch.randn(heads * head_size), *torch.randn(2, num_kv_heads * head_size)
    layers = per_rank(tp_size, lambda: QKVParallelLinear(16, head_size, heads, num_kv_heads,
                                                         bias=True))
    for layer in layers:
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            load(layer, "weight", w, sid), load(layer, "bias", b, sid)
    full_k = F.linear(x, wk, bk).view(3, num_kv_heads, head_size)
    qs, ks = [], []
    for rank, layer in enumerate(layers):
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        ks.append(k.view(3, -1, head_size))
        torch.testing.assert_close(v, F.linear(x, wv, bv).view(3, num_kv_heads, head_size)[
            :, layer.kv_head_start:layer.kv_head_start + layer.num_kv_heads].reshape(3, -1))
        # Query heads on this rank use KV heads on this rank.
        group = heads // num_kv_heads
        first_q_head = rank * layer.num_heads
        assert first_q_head // group == layer.kv_head_start
    torch.testing.assert_close(torch.cat(qs, -1), F.linear(x, wq, bq))
    if tp_size <= num_kv_heads:
        torch.testing.assert_close(torch.cat(ks, 1), full_k)
    else:
        replicas = tp_size // num_kv_heads
        for rank, k in enumerate(ks):
            torch.testing.assert_close(k[:, 0], full_k[:, rank // replicas])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vocab_parallel_embedding_and_lm_head(tp_size):
    vocab, dim = 509, 8  # not divisible: the last rank is padded
    table = torch.randn(vocab, dim)
    embeds = per_rank(tp_size, lambda: VocabParallelEmbedding(vocab, dim))
    heads = per_rank(tp_size, lambda: ParallelLMHead(vocab, dim))
    for e, h in zip(embeds, heads):
        load(e, "weight", table), load(h, "weight", table)
    ids = torch.tensor([0, 1, 127, 128, 255, 256, 508])
    # Each id is owned by exactly one rank; the others contribute zeros (the all-reduce sum).
    total = torch.zeros(len(ids), dim)
    for e in embeds:
        owned = (ids >= e.vocab_start) & (ids < e.vocab_end)
        local = F.embedding(torch.where(owned, ids - e.vocab_start, 0), e.weight)
        total += local * owned[:, None]
    torch.testing.assert_close(total, table[ids])
    hidden = torch.randn(4, dim)
    logits = torch.cat([F.linear(hidden, h.weight) for h in heads], dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, hidden @ table.T)


def test_indivisible_shapes_are_rejected():
    init_tp_group(0, 3)
    with pytest.raises(ValueError, match="number of attention heads"):
        QKVParallelLinear(16, 4, 8, 2)
    with pytest.raises(ValueError, match="output size"):
        ColumnParallelLinear(16, 32)


def test_loader_rejects_wrong_full_shape():
    layer = ColumnParallelLinear(16, 32)
    with pytest.raises(ValueError, match=r"shape \(16, 16\), expected \(32, 16\)"):
        load(layer, "weight", torch.randn(16, 16))


# ---- the whole model on 2 gloo processes --------------------------------------------------


def _two_steps(model, cfg) -> torch.Tensor:
    """Logits of a mixed batch: two prompts, then a decode next to a prefill chunk."""
    batcher = PagedBatcher(model, cfg)
    tokens = random_tokens(24, seed=11)
    return torch.cat([
        batcher.step([("a", tokens[:20]), ("b", tokens[:7])]),
        batcher.step([("a", tokens[20:21]), ("b", tokens[7:9])], num_decodes=1)])


def _tp_worker(rank: int, world: int, folders: list[str], init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    try:
        init_tp_group(rank, world)
        for folder in folders:
            model = load_model(folder, torch.float32, "cpu", get_attention_backend())
            cfg = ModelConfig.from_pretrained(folder)
            # This rank's KV heads: split when there are enough, else one replicated head.
            local_kv = max(cfg.num_key_value_heads // world, 1)
            logits = _two_steps(model, dataclasses.replace(cfg, num_key_value_heads=local_kv))
            if rank == 0:
                torch.save(logits, f"{folder}/tp{world}.pt")
    finally:
        dist.destroy_process_group()


def test_two_rank_model_matches_one_rank(tmp_path):
    from tests.test_model_parity import build_hf, save_hf

    # llama-gqa splits its 2 KV heads over the ranks; qwen3 (1 KV head) replicates it.
    folders = [str(save_hf(build_hf(name, seed=6), tmp_path / name))
               for name in ("llama-gqa", "qwen3")]
    mp.spawn(_tp_worker, args=(2, folders, str(tmp_path / "init")), nprocs=2, join=True)
    for folder in folders:
        model = load_model(folder, torch.float32, "cpu", get_attention_backend())
        expected = _two_steps(model, ModelConfig.from_pretrained(folder))
        torch.testing.assert_close(torch.load(f"{folder}/tp2.pt"), expected, atol=1e-4, rtol=0)
