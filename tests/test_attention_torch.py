"""The torch paged-attention backend against the dense, token-by-token oracle."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import get_attention_backend
from kernels.attention_backend import AttentionMetadata
from kernels.reference import reference_paged_attention
from kernels.cpu_attention import CPUAttentionBackend
from kernels.cpu_build import compiler
from kernels.cpu_decode import cpu_kernels_available
from kernels.torch_attention import TorchAttentionBackend
from tests.cache_views import block_major_views

BLOCK_SIZE = 16
HEAD_SIZE = 32
NUM_BLOCKS = 64


def make_meta(query_lens: list[int], seq_lens: list[int], num_decodes: int,
              gen: torch.Generator, num_blocks: int = NUM_BLOCKS) -> AttentionMetadata:
    """A batch whose sequences own random, distinct cache blocks."""
    bs = BLOCK_SIZE
    need = [-(-s // bs) for s in seq_lens]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    slots = []
    for table, q_len, seq_len in zip(tables, query_lens, seq_lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // bs] * bs + pos % bs)
    width = max(need)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=bs,
        num_decodes=num_decodes)


def random_inputs(meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                  gen: torch.Generator, dtype: torch.dtype = torch.float32):
    t = meta.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q = rand(t, num_heads, HEAD_SIZE)
    k, v = rand(t, num_kv_heads, HEAD_SIZE), rand(t, num_kv_heads, HEAD_SIZE)
    # The cached prefixes (and every unused slot) hold random values.
    # Layer views of a block-major cache, as the engine passes them.
    k_cache, v_cache = block_major_views(rand(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE),
                                         rand(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE))
    return q, k, v, k_cache, v_cache


def check_against_reference(backend, query_lens, seq_lens, num_decodes, num_heads,
                            num_kv_heads, seed=0, dtype=torch.float32, atol=2e-5):
    gen = torch.Generator().manual_seed(seed)
    meta = make_meta(query_lens, seq_lens, num_decodes, gen)
    q, k, v, k_cache, v_cache = random_inputs(meta, num_heads, num_kv_heads, gen, dtype)
    scale = HEAD_SIZE ** -0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference_paged_attention(q, k, v, ref_k, ref_v, meta, scale)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=atol, rtol=atol)
    # The new K/V landed in exactly the slots the reference wrote.
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


BACKENDS = {
    "default": TorchAttentionBackend,
    # A tiny budget puts every decode in its own chunk: exercises chunking and the sort.
    "chunked": lambda: TorchAttentionBackend(decode_chunk_bytes=1),
    "mid": lambda: TorchAttentionBackend(decode_chunk_bytes=40 * 2 * 4 * HEAD_SIZE * 4),
    # Decodes through the compiled kernel, prefills through torch.
    "cpu": CPUAttentionBackend,
}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


def test_non_finite_values_in_masked_padding_do_not_reach_any_output(backend):
    """Decodes read whole blocks: stale slots past a sequence's end, and block 0 wherever a
    shorter table is padded (another request's block). An inf there (an fp16 overflow in
    that other request) must stay out of every output, as the reference keeps it."""
    gen = torch.Generator().manual_seed(3)
    meta = make_meta([1, 1, 1], [40, 5, 21], 3, gen)
    q, k, v, k_cache, v_cache = random_inputs(meta, 4, 2, gen)
    owned = [row[:-(-s // BLOCK_SIZE)] for row, s in
             zip(meta.block_tables.tolist(), meta.seq_lens_list)]
    other = next(b for b in range(NUM_BLOCKS) if all(b not in row for row in owned))
    table = meta.block_tables.clone()
    table[1, 1:] = other  # the 5-token decode's padding: a block it does not own
    meta.block_tables = table
    for cache in (k_cache, v_cache):
        cache[other] = float("inf")
        for row, s in zip(owned, meta.seq_lens_list):  # each sequence's own stale tail
            cache[row[-1], (s - 1) % BLOCK_SIZE + 1:] = float("nan")
    expected = reference_paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta,
                                         HEAD_SIZE ** -0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_SIZE ** -0.5)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decodes_only(backend, group):
    # One token, exactly one block, block boundaries, and longer contexts.
    seq_lens = [1, 16, 17, 33, 5, 32, 100, 15]
    check_against_reference(backend, [1] * len(seq_lens), seq_lens, len(seq_lens),
                            num_heads=2 * group, num_kv_heads=2, seed=group)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_decodes_and_prefill_chunks(backend, group):
    # 3 decodes, then: a chunk with a cached prefix, a fresh prompt, a chunk ending on a block
    # boundary, a one-token chunk after a prefix, a chunk starting mid-block.
    query_lens = [1, 1, 1, 7, 20, 16, 1, 9]
    seq_lens = [40, 16, 1, 37, 20, 32, 18, 30]
    check_against_reference(backend, query_lens, seq_lens, num_decodes=3,
                            num_heads=2 * group, num_kv_heads=2, seed=10 + group)


def test_prefill_only_no_decodes(backend):
    check_against_reference(backend, [5, 1, 16], [5, 1, 48], num_decodes=0,
                            num_heads=4, num_kv_heads=1, seed=3)


def test_single_token(backend):
    check_against_reference(backend, [1], [1], num_decodes=1, num_heads=2, num_kv_heads=2)
    check_against_reference(backend, [1], [1], num_decodes=0, num_heads=2, num_kv_heads=2)


def test_bfloat16(backend):
    check_against_reference(backend, [1, 1, 6], [30, 3, 22], num_decodes=2, num_heads=4,
                            num_kv_heads=2, seed=5, dtype=torch.bfloat16, atol=2e-2)


def test_negative_slots_are_not_written():
    gen = torch.Generator().manual_seed(7)
    meta = make_meta([1, 1, 1], [9, 20, 4], num_decodes=3, gen=gen)
    q, k, v, k_cache, v_cache = random_inputs(meta, 4, 2, gen)
    meta.slot_mapping[1] = -1  # a padding token: its K/V must go nowhere
    before = k_cache.clone()
    scale = HEAD_SIZE ** -0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference_paged_attention(q, k, v, ref_k, ref_v, meta, scale)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert int((k_cache != before).any(dim=(2, 3)).sum()) == 2  # two slots written
    torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], atol=2e-5, rtol=2e-5)


def test_same_meta_reused_across_layers():
    # Every layer of a step passes the same meta with its own cache; the per-step plan is
    # reused, the data must not be.
    gen = torch.Generator().manual_seed(8)
    meta = make_meta([1, 1, 4], [12, 30, 25], num_decodes=2, gen=gen)
    backend = TorchAttentionBackend(decode_chunk_bytes=1)
    scale = HEAD_SIZE ** -0.5
    for _layer in range(2):
        q, k, v, k_cache, v_cache = random_inputs(meta, 4, 2, gen)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        expected = reference_paged_attention(q, k, v, ref_k, ref_v, meta, scale)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_prefix_chunk_folds_query_groups_into_one_query():
    # A chunk after a cached prefix attends with each KV head's query heads folded into one
    # longer query: the same numbers as giving every query head its own copy of the context's
    # K/V; the repeated mask is made once a step, whatever the layer count. Bit for bit where
    # oneMKL's GEMMs round a row alike whatever the rows beside it (AVX-512 hosts); its AVX2
    # kernels (an AMD Zen 3 VM, through kernels/mkl_vendor.py) move some rows by ~2 ulp.
    gen = torch.Generator().manual_seed(11)
    meta = make_meta([37], [90], num_decodes=0, gen=gen)
    backend = TorchAttentionBackend()
    scale = HEAD_SIZE ** -0.5
    masks = set()
    for _layer in range(3):
        q, k, v, k_cache, v_cache = random_inputs(meta, 8, 2, gen)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        seq = backend._cached[1].prefills[0]  # the step plan every layer shares
        masks.add(id(seq.group_masks[4]))
        ids = seq.block_ids
        kk = k_cache.index_select(0, ids).reshape(-1, 2, HEAD_SIZE)[:90].transpose(0, 1)
        vv = v_cache.index_select(0, ids).reshape(-1, 2, HEAD_SIZE)[:90].transpose(0, 1)
        per_head = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kk.repeat_interleave(4, 0)[None],
            vv.repeat_interleave(4, 0)[None], attn_mask=seq.mask, scale=scale)
        torch.testing.assert_close(out, per_head[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert len(masks) == 1


@st.composite
def batches(draw):
    """Random mixes: decodes first, then prefill chunks with or without a cached prefix."""
    num_decodes = draw(st.integers(0, 4))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 3))
    seq_lens = [draw(st.integers(1, 70)) for _ in range(num_decodes + num_prefills)]
    query_lens = [1] * num_decodes + [draw(st.integers(1, s)) for s in seq_lens[num_decodes:]]
    return query_lens, seq_lens, num_decodes


@settings(max_examples=30, deadline=None)
@given(batch=batches(), group=st.sampled_from([1, 2, 4]),
       budget=st.sampled_from([1, 5000, None]),
       seed=st.integers(0, 2**16))
def test_random_batches(batch, group, budget, seed):
    query_lens, seq_lens, num_decodes = batch
    check_against_reference(TorchAttentionBackend(budget), query_lens, seq_lens, num_decodes,
                            num_heads=2 * group, num_kv_heads=2, seed=seed)


def test_reference_matches_dense_attention():
    """The oracle itself against attention over dense, unpaged K/V (repeat_kv + softmax)."""
    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv_heads, scale = 4, 2, 0.3
    query_lens, seq_lens = [1, 6], [21, 19]
    meta = make_meta(query_lens, seq_lens, num_decodes=1, gen=gen)
    q, k, v, k_cache, v_cache = random_inputs(meta, num_heads, num_kv_heads, gen)
    # Dense contexts; the cached prefix is scattered into the pages, the rest is "new".
    ctx_k = [torch.randn(s, num_kv_heads, HEAD_SIZE, generator=gen) for s in seq_lens]
    ctx_v = [torch.randn(s, num_kv_heads, HEAD_SIZE, generator=gen) for s in seq_lens]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(seq_len - q_len):
            block = int(meta.block_tables[i, pos // BLOCK_SIZE])
            k_cache[block, pos % BLOCK_SIZE] = ctx_k[i][pos]
            v_cache[block, pos % BLOCK_SIZE] = ctx_v[i][pos]
        k[start:start + q_len] = ctx_k[i][seq_len - q_len:]
        v[start:start + q_len] = ctx_v[i][seq_len - q_len:]
        start += q_len
    out = reference_paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        kk = ctx_k[i].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, H, D]
        vv = ctx_v[i].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q[start:start + q_len], kk) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        dense = torch.einsum("hqs,shd->qhd", scores.softmax(-1), vv)
        torch.testing.assert_close(out[start:start + q_len], dense, atol=1e-5, rtol=1e-5)
        start += q_len


def test_get_attention_backend():
    disabled = os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1"
    if compiler() is not None and not disabled:  # then the CPU kernels must build and be picked
        assert cpu_kernels_available()
        assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
        assert get_attention_backend("cpu").name == "cpu"
    else:
        assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert type(get_attention_backend("torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flashinfer")


def test_auto_leaves_triton_for_a_head_size_its_kernels_cannot_tile():
    """A model with head_dim 80 or 96 on a GPU: "auto" must not pick Triton, which would fail
    at the first forward; asking for Triton itself fails at start-up, saying why."""
    pytest.importorskip("triton")
    assert get_attention_backend("auto", "cuda", head_size=64).name == "triton"
    for head_size in (80, 96, 8):
        assert get_attention_backend("auto", "cuda", head_size=head_size).name == "torch"
        with pytest.raises(ValueError, match="power of two >= 16; this model's is"):
            get_attention_backend("triton", "cuda", head_size=head_size)


def test_bench_prefill_attention_smoke(capsys):
    from engine.cli import main as cli_main

    rc = cli_main(["bench", "prefill_attention", "--shapes", "5x40,17x33", "--reps", "1",
                   "--num-heads", "4", "--num-kv-heads", "2", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert [(p["query_len"], p["seq_len"]) for p in r["points"]] == [(5, 40), (17, 33)]
    assert all(p["folded_ms"] > 0 and p["per_head_copy_ms"] > 0 for p in r["points"])
    assert cli_main(["bench", "prefill_attention", "--shapes", "40x40"]) == 2
