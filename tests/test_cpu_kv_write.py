"""The compiled CPU K/V write against the torch backend's index_put_ path, its launcher's
checks, and the CPU backend's use of it."""
from __future__ import annotations

import pytest
import torch

from kernels.attention_backend import AttentionMetadata
from kernels.cpu_attention import CPUAttentionBackend
from kernels.cpu_kv_write import kv_write_supported, write_kv_cpu
from kernels.torch_attention import write_kv_by_slots
from tests.cache_views import block_major_views

pytestmark = pytest.mark.skipif(
    not kv_write_supported(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1)),
    reason="no C compiler")


def _qkv_views(num_tokens, heads, kv_heads, head_size, seed):
    """key/value as the model hands them over: strided views into a fused qkv output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size, generator=gen)
    q_end, k_end = heads * head_size, (heads + kv_heads) * head_size
    key = qkv[:, q_end:k_end].view(num_tokens, kv_heads, head_size)
    value = qkv[:, k_end:].view(num_tokens, kv_heads, head_size)
    return key, value


def _caches(num_blocks, block_size, kv_heads, head_size):
    shape = (num_blocks, block_size, kv_heads, head_size)
    return block_major_views(torch.zeros(shape), torch.zeros(shape))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])  # 300: past the threshold for 2 threads
def test_matches_index_put(num_tokens, threads):
    block_size, num_blocks = 16, 40
    key, value = _qkv_views(num_tokens, 8, 4, 64, seed=num_tokens)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::5] = -1  # padding tokens are skipped
    got_k, got_v = _caches(num_blocks, block_size, 4, 64)
    want_k, want_v = _caches(num_blocks, block_size, 4, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        write_kv_cpu(key, value, got_k, got_v, slots)
    finally:
        torch.set_num_threads(before)
    write_kv_by_slots(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert int((got_k != 0).any(dim=(2, 3)).sum()) > 0  # something was written


def test_bad_inputs_are_refused():
    key, value = _qkv_views(3, 8, 4, 64, seed=0)
    k, v = _caches(4, 16, 4, 64)
    slots = torch.tensor([0, 5, 63])
    with pytest.raises(ValueError, match="below 64"):
        write_kv_cpu(key, value, k, v, torch.tensor([0, 5, 64]))
    with pytest.raises(ValueError, match="int64"):
        write_kv_cpu(key, value, k, v, slots.int())
    with pytest.raises(ValueError, match="one slot per token"):
        write_kv_cpu(key, value, k, v, slots[:2])
    with pytest.raises(ValueError, match="key/value must be"):
        write_kv_cpu(key[:, :2], value[:, :2], k, v, slots)
    with pytest.raises(ValueError, match="heads contiguous"):
        write_kv_cpu(key.transpose(0, 1).contiguous().transpose(0, 1), value, k, v, slots)
    with pytest.raises(ValueError, match="float32"):
        write_kv_cpu(key.double(), value.double(), k, v, slots)
    assert not k.any() and not v.any()  # nothing written by a refused call


def test_backend_writes_through_the_kernel_and_refuses_bad_slots():
    key, value = _qkv_views(2, 8, 4, 64, seed=3)
    query = torch.randn(2, 8, 64)
    k, v = _caches(4, 16, 4, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([4, 33]), query_start_loc=torch.arange(3, dtype=torch.int32),
        seq_lens=torch.tensor([5, 2], dtype=torch.int32), block_tables=tables,
        query_lens_list=[1, 1], seq_lens_list=[5, 2], max_query_len=1, max_seq_len=5,
        block_size=16, num_decodes=2)
    CPUAttentionBackend().forward(query, key, value, k, v, meta, 0.125)
    assert torch.equal(k[0, 4], key[0]) and torch.equal(v[2, 1], value[1])
    bad = AttentionMetadata(**{**meta.__dict__, "slot_mapping": torch.tensor([4, 64])})
    with pytest.raises(ValueError, match="slots must be below 64"):
        CPUAttentionBackend().forward(query, key, value, k, v, bad, 0.125)
