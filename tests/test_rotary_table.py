"""The rotary cos/sin table (engine/layers/rotary.py): the correctly rounded one, on any CPU
and thread count. torch's own float32 cos/sin, split over threads, once left one thread's half
of it up to 1.5e-4 off for the engine's whole life (about one process in 30 on the Zen 4 VM)."""
from __future__ import annotations

import pytest
import torch

from engine.layers import RotaryEmbedding
from engine.layers.rotary import compute_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("head_size, base, scaling, max_position", [
    (64, 10000.0, None, 2048),  # tiny-llama's
    (128, 500000.0, LLAMA3, 4096),
    (128, 1_000_000.0, {"rope_type": "linear", "factor": 2.0}, 3000),
])
def test_the_table_is_the_correctly_rounded_cos_and_sin_of_float32_angles(
        head_size, base, scaling, max_position):
    rope = RotaryEmbedding(head_size, max_position, base, scaling)
    inv_freq = compute_inv_freq(head_size, base, scaling)
    # The angles as transformers forms them: float32 products of position and frequency.
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq).double()
    want = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
    table = rope.cos_sin_cache
    assert table.dtype == torch.float32 and table.shape == (max_position, head_size)
    assert torch.equal(table, want), (table.double() - want.double()).abs().max()


def test_the_table_does_not_depend_on_the_thread_count():
    previous = torch.get_num_threads()
    try:
        tables = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            tables.append(RotaryEmbedding(64, 2048, 10000.0).cos_sin_cache)
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(tables[0], t) for t in tables[1:])


def test_the_table_agrees_with_transformers_rotary_embedding():
    """Within float32 rounding of transformers' own cos/sin (its oracle role)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=2048,
                      rope_theta=10000.0)
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.arange(2048)[None]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    table = RotaryEmbedding(64, 2048, 10000.0).cos_sin_cache
    assert torch.allclose(table[:, :32], cos[0, :, :32], rtol=0, atol=3e-7)
    assert torch.allclose(table[:, 32:], sin[0, :, :32], rtol=0, atol=3e-7)
