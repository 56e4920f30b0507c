"""The compiled element-wise CPU kernels against the layers' plain-torch paths."""
from __future__ import annotations

import pytest
import torch

from engine.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from kernels.cpu_fused import rms_norm_cpu, rotary_neox_cpu, silu_and_mul_cpu
from kernels.cpu_decode import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler")


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm


@pytest.mark.parametrize("num_tokens", [1, 5, 300])
@pytest.mark.parametrize("hidden", [64, 512, 1000])
def test_rms_norm_matches_torch(num_tokens, hidden):
    g = torch.Generator().manual_seed(num_tokens * hidden)
    norm = _norm(hidden, hidden)
    x = torch.randn(num_tokens, hidden, generator=g) * 3
    torch.testing.assert_close(rms_norm_cpu(x, norm.weight, norm.eps), norm._norm(x))
    # The layer takes the compiled path for float32 CPU rows.
    torch.testing.assert_close(norm(x), norm._norm(x))


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_fused_add_rms_norm_in_place(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    norm = _norm(512, 1)
    x = torch.randn(num_tokens, 512, generator=g)
    residual = torch.randn(num_tokens, 512, generator=g)
    want_sum = x + residual
    want = norm._norm(want_sum)
    out, new_residual = norm(x, residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, want_sum)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("num_tokens", [1, 6, 200])
def test_per_head_rms_norm_on_qkv_views(num_tokens):
    # Qwen3's q/k norm: each head of a fused qkv row normed on its own, read in place.
    g = torch.Generator().manual_seed(num_tokens)
    norm = _norm(128, 3)
    qkv = torch.randn(num_tokens, (16 + 2 * 8) * 128, generator=g)
    q = qkv[:, :16 * 128].view(num_tokens, 16, 128)
    k = qkv[:, 16 * 128:24 * 128].view(num_tokens, 8, 128)
    for x in (q, k):
        got = norm(x)
        assert got.shape == x.shape
        torch.testing.assert_close(got, norm._norm(x))


def test_rms_norm_refuses_bad_tensors():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        rms_norm_cpu(torch.randn(2, 8, dtype=torch.float64), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm_cpu(torch.randn(8, 2).t(), w, 1e-6)
    with pytest.raises(ValueError, match=r"\[num_tokens, \(8 \| num_heads, 8\)\]"):
        rms_norm_cpu(torch.randn(2, 9), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm_cpu(torch.randn(2, 3, 8, 2)[..., 0], w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_cpu(torch.randn(2, 8), w, 1e-6, residual=torch.randn(3, 8))


@pytest.mark.parametrize("num_tokens", [1, 4, 200])
@pytest.mark.parametrize("heads", [(8, 4), (4, 1), (2, 2)])
def test_rotary_matches_torch_on_qkv_views(num_tokens, heads):
    num_heads, num_kv_heads = heads
    head_size = 64
    rope = RotaryEmbedding(head_size, max_position=512, base=10000.0)
    g = torch.Generator().manual_seed(num_tokens)
    # q and k are views of one fused qkv row, as the attention layer passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
    q = qkv[:, :num_heads * head_size].view(num_tokens, num_heads, head_size)
    k = qkv[:, num_heads * head_size:(num_heads + num_kv_heads) * head_size].view(
        num_tokens, num_kv_heads, head_size)
    positions = torch.randint(0, 512, (num_tokens,), generator=g)
    positions[0] = 511
    want_q, want_k = rope.forward_torch(positions, q, k)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_size:].clone()
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_size:], v_before)


def test_rotary_layer_checks_each_new_positions_tensor_once(monkeypatch):
    rope = RotaryEmbedding(64, max_position=16, base=10000.0)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    checked = []
    real = rotary_neox_cpu

    def spy(positions, *args, positions_checked=False):
        checked.append(positions_checked)
        return real(positions, *args, positions_checked=positions_checked)

    monkeypatch.setattr("engine.layers.rotary.rotary_neox_cpu", spy)
    step = torch.tensor([3, 4])
    for _ in range(3):  # three layers of one step: only the first checks
        rope(step, q, k)
    assert checked == [False, True, True]
    with pytest.raises(ValueError, match=r"positions must be in \[0, 16\)"):
        rope(torch.tensor([5, 16]), q, k)  # the next step's tensor is checked again


def test_rotary_refuses_positions_outside_the_table():
    rope = RotaryEmbedding(64, max_position=16, base=10000.0)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    for bad in ([0, 16], [-1, 3]):
        with pytest.raises(ValueError, match=r"positions must be in \[0, 16\)"):
            rotary_neox_cpu(torch.tensor(bad), q, k, rope.cos_sin_cache)
    with pytest.raises(ValueError, match="int64"):
        rotary_neox_cpu(torch.tensor([0, 1], dtype=torch.int32), q, k, rope.cos_sin_cache)
    with pytest.raises(ValueError, match="query must be"):
        rotary_neox_cpu(torch.tensor([0, 1]), torch.randn(2, 4, 32), k, rope.cos_sin_cache)


@pytest.mark.parametrize("num_tokens", [1, 9, 700])
@pytest.mark.parametrize("d", [16, 1408, 1000])
def test_silu_and_mul_matches_torch(num_tokens, d):
    g = torch.Generator().manual_seed(num_tokens + d)
    # Large magnitudes both ways: the sigmoid's two branches and exp's flush to zero.
    x = torch.randn(num_tokens, 2 * d, generator=g) * 8
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    act = SiluAndMul()
    want = act.forward_torch(x)
    torch.testing.assert_close(silu_and_mul_cpu(x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(act(x), want, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_reads_strided_rows_and_refuses_bad_shapes():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 300, generator=g)
    x = wide[:, :200]  # row stride 300: a view into a wider row
    torch.testing.assert_close(silu_and_mul_cpu(x), SiluAndMul().forward_torch(x))
    assert silu_and_mul_cpu(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul_cpu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="float32"):
        silu_and_mul_cpu(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_and_mul_cpu(torch.randn(8, 3).t())
