"""What every attention backend does with inputs the engine should never send, and with views
it may: out-of-range slots and block ids and queries longer than their context are refused
with a ValueError naming the argument; caches and inputs whose head dim is padded (strided
views) are attended, on a slower path where the fast one cannot read them.

The caches are views into a buffer with a guard block on each side, so a backend that missed
an out-of-range index reads or writes the guard (and the test sees it) instead of memory
outside the buffer, which under Triton's interpreter corrupts the heap.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention_backend import AttentionMetadata
from kernels.cpu_attention import CPUAttentionBackend
from kernels.cpu_decode import cpu_kernels_available
from kernels.input_checks import DEBUG_ENV, index_checks_affordable
from kernels.reference import reference_paged_attention
from kernels.torch_attention import TorchAttentionBackend

BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS = 16, 32, 8
NUM_HEADS, NUM_KV_HEADS = 4, 2
SCALE = HEAD_SIZE ** -0.5
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_backend():
    pytest.importorskip("triton")
    from kernels.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


def _cpu_backend():
    if not cpu_kernels_available():
        pytest.skip("no C compiler")
    return CPUAttentionBackend()


# name: (backend factory, device)
BACKENDS = {"torch": (TorchAttentionBackend, "cpu"), "cpu": (_cpu_backend, "cpu"),
            "triton": (_triton_backend, TRITON_DEVICE)}


@pytest.fixture(params=list(BACKENDS))
def backend(request, monkeypatch):
    factory, device = BACKENDS[request.param]
    # On a GPU the Triton backend bounds indices only when asked (a sync a step).
    monkeypatch.setenv(DEBUG_ENV, "1")
    return factory(), device


# Two decodes (20 and 5 tokens), then a 3-token chunk after a 7-token prefix.
QUERY_LENS, SEQ_LENS, NUM_DECODES = [1, 1, 3], [20, 5, 10], 2
TABLES = [[1, 2], [3, 0], [4, 0]]
SLOTS = [2 * BLOCK_SIZE + 3, 3 * BLOCK_SIZE + 4, 4 * BLOCK_SIZE + 7, 4 * BLOCK_SIZE + 8,
         4 * BLOCK_SIZE + 9]


def _meta(device, query_lens=QUERY_LENS, seq_lens=SEQ_LENS, tables=TABLES, slots=SLOTS,
          num_decodes=NUM_DECODES) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=BLOCK_SIZE,
        num_decodes=num_decodes)


def _guarded_caches(gen, device, k_pad=0, v_pad=0):
    """(k_cache, v_cache, k_buffer, v_buffer): the caches are blocks 1..NUM_BLOCKS of their
    buffers, head dims padded by k_pad / v_pad."""
    caches = []
    for pad in (k_pad, v_pad):
        buf = torch.randn(NUM_BLOCKS + 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE + pad,
                          generator=gen).to(device)
        caches.append((buf[1:NUM_BLOCKS + 1, ..., :HEAD_SIZE], buf))
    (k_cache, k_buf), (v_cache, v_buf) = caches
    return k_cache, v_cache, k_buf, v_buf


def _qkv(gen, num_tokens, device, kv_pad=0):
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen).to(device)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE + kv_pad, generator=gen)
            .to(device)[..., :HEAD_SIZE] for _ in range(2))
    return q, k, v


def _expect_refused(backend, match, **meta_fields):
    be, dev = backend
    gen = torch.Generator().manual_seed(0)
    meta = _meta(dev, **meta_fields)
    q, k, v = _qkv(gen, meta.num_tokens, dev)
    k_cache, v_cache, k_buf, v_buf = _guarded_caches(gen, dev)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    with pytest.raises(ValueError, match=match):
        be.forward(q, k, v, k_cache, v_cache, meta, SCALE)
    # Refused before anything was written, inside the cache or out of it.
    assert torch.equal(k_buf, k_before) and torch.equal(v_buf, v_before)


# Both land in the guard block past the cache.
@pytest.mark.parametrize("slot", [NUM_BLOCKS * BLOCK_SIZE, (NUM_BLOCKS + 1) * BLOCK_SIZE - 1])
def test_slot_past_the_cache_is_refused(backend, slot):
    _expect_refused(backend, rf"slot_mapping: slots must be below "
                    rf"{NUM_BLOCKS * BLOCK_SIZE} .* got {slot}", slots=SLOTS[:-1] + [slot])


def test_metadata_of_another_block_size_is_refused(backend):
    be, dev = backend
    gen = torch.Generator().manual_seed(0)
    meta = _meta(dev)
    meta.block_size = BLOCK_SIZE // 2
    q, k, v = _qkv(gen, meta.num_tokens, dev)
    k_cache, v_cache, _, _ = _guarded_caches(gen, dev)
    with pytest.raises(ValueError, match=rf"meta.block_size \({BLOCK_SIZE // 2}\) != the "
                       rf"cache's \({BLOCK_SIZE}\)"):
        be.forward(q, k, v, k_cache, v_cache, meta, SCALE)


def test_int32_slot_past_the_cache_is_refused():
    # int32 slots skip the CPU backend's compiled write (and its own slot check).
    for name in ("torch", "cpu"):
        factory, dev = BACKENDS[name]
        gen = torch.Generator().manual_seed(0)
        meta = _meta(dev, slots=SLOTS[:-1] + [NUM_BLOCKS * BLOCK_SIZE])
        meta.slot_mapping = meta.slot_mapping.int()
        q, k, v = _qkv(gen, meta.num_tokens, dev)
        k_cache, v_cache, _, _ = _guarded_caches(gen, dev)
        with pytest.raises(ValueError, match="slot_mapping: slots must be below"):
            factory().forward(q, k, v, k_cache, v_cache, meta, SCALE)


@pytest.mark.parametrize("tables, bad", [
    ([[1, 2], [3, 0], [NUM_BLOCKS, 0]], f"\\[0, {NUM_BLOCKS}\\]"),  # a prefill's prefix
    ([[1, 2], [3, 0], [-1, 0]], r"\[-1, 3\]"),
    ([[1, NUM_BLOCKS], [3, 0], [4, 0]], f"\\[0, {NUM_BLOCKS}\\]"),  # a decode's context
    ([[1, 2], [3, NUM_BLOCKS], [4, 0]], f"\\[0, {NUM_BLOCKS}\\]"),  # a table's padding
])
def test_block_id_outside_the_cache_is_refused(backend, tables, bad):
    _expect_refused(backend, rf"block_tables: block ids must be in \[0, {NUM_BLOCKS}\), "
                    rf"got {bad}", tables=tables)


@pytest.mark.parametrize("query_lens, seq_lens, slots", [
    ([1, 1, 3], [20, 5, 2], SLOTS),  # a chunk of 3 new tokens in a 2-token context
    ([1, 1, 3], [20, 0, 10], SLOTS),  # a decode with no context at all
    ([1, 1, -1], [20, 5, 10], SLOTS[:2]),
])
def test_query_longer_than_its_context_is_refused(backend, query_lens, seq_lens, slots):
    i = 2 if seq_lens[1] else 1
    _expect_refused(backend, rf"query_lens_list\[{i}\] \({query_lens[i]}\) must be in "
                    rf"\[0, seq_lens_list\[{i}\] \({seq_lens[i]}\)\]",
                    query_lens=query_lens, seq_lens=seq_lens, slots=slots)


def _check_matches_reference(be, dev, meta, gen, k_pad=0, v_pad=0, kv_pad=0):
    q, k, v = _qkv(gen, meta.num_tokens, dev, kv_pad)
    k_cache, v_cache, k_buf, v_buf = _guarded_caches(gen, dev, k_pad, v_pad)
    ref_k, ref_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    ref_meta = _meta("cpu", meta.query_lens_list, meta.seq_lens_list,
                     meta.block_tables.tolist(), meta.slot_mapping.tolist(), meta.num_decodes)
    expected = reference_paged_attention(q.cpu(), k.cpu(), v.cpu(), ref_k, ref_v, ref_meta,
                                         SCALE)
    guards = k_buf[[0, -1]].clone(), v_buf[[0, -1]].clone()
    out = be.forward(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)
    assert torch.equal(k_buf[[0, -1]], guards[0]) and torch.equal(v_buf[[0, -1]], guards[1])


def test_padding_slots_and_last_block_are_in_range(backend):
    """The bounds are the cache's own: a negative slot is padding, skipped; the last slot of
    the last block is written."""
    be, dev = backend
    last = NUM_BLOCKS - 1
    meta = _meta(dev, seq_lens=[20, 5, BLOCK_SIZE], tables=[[1, 2], [3, 0], [last, 0]],
                 slots=[-1, 3 * BLOCK_SIZE + 4] + [last * BLOCK_SIZE + p for p in (13, 14, 15)])
    _check_matches_reference(be, dev, meta, torch.Generator().manual_seed(1))


# (k_pad, v_pad, kv_pad): a cache's head dim padded past head_size, or the new K/V's.
PADDINGS = {"both caches": (8, 8, 0), "v cache only": (0, 8, 0), "k cache only": (8, 0, 0),
            "new k/v": (0, 0, 8)}


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_padded_head_dim_views_are_attended(name, padding):
    """Where the compiled kernels cannot read a view, the CPU backend takes the torch path
    (as it did when both caches were padded) instead of refusing what torch attends."""
    factory, dev = BACKENDS[name]
    _check_matches_reference(factory(), dev, _meta(dev), torch.Generator().manual_seed(2),
                             *PADDINGS[padding])


def test_query_with_a_strided_head_dim_is_attended_by_the_cpu_backend():
    gen = torch.Generator().manual_seed(3)
    meta = _meta("cpu")
    q = torch.randn(HEAD_SIZE, NUM_HEADS, meta.num_tokens, generator=gen).permute(2, 1, 0)
    _, k, v = _qkv(gen, meta.num_tokens, "cpu")
    k_cache, v_cache, _, _ = _guarded_caches(gen, "cpu")
    expected = TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta,
                                               SCALE)
    out = _cpu_backend().forward(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_triton_refuses_caches_with_unequal_strides_clearly():
    """The Triton kernels take one set of cache strides: a padded V beside an unpadded K is
    refused, saying so (the torch and CPU backends attend it)."""
    be, dev = _triton_backend(), TRITON_DEVICE
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(gen, 5, dev)
    k_cache, v_cache, _, _ = _guarded_caches(gen, dev, 0, 8)
    with pytest.raises(ValueError, match="k_cache and v_cache must share strides"):
        be.forward(q, k, v, k_cache, v_cache, _meta(dev), SCALE)


def test_cpu_backend_layers_of_one_step_may_take_different_paths():
    """One step's meta, a layer the kernels read, then one they cannot (padded V cache): the
    second takes the torch path, whose decodes the first layer's plan did not gather."""
    be = _cpu_backend()
    meta = _meta("cpu")
    gen = torch.Generator().manual_seed(5)
    for v_pad in (0, 8):
        _check_matches_reference(be, "cpu", meta, gen, v_pad=v_pad)


def test_index_checks_run_on_a_device_only_when_asked(monkeypatch):
    meta = _meta("cpu")
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert index_checks_affordable(meta)  # CPU tensors: no sync to avoid
    on_device = _meta("meta")  # tensors off the CPU, as a GPU's are
    assert not index_checks_affordable(on_device)
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert index_checks_affordable(on_device)
