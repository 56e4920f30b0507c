"""The CPU decode-attention benchmark times its rows on one batch."""
from __future__ import annotations

import argparse

import pytest

from bench import attention
from kernels.cpu_decode import cpu_kernels_available


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler for the CPU kernels")
def test_every_row_times_the_same_sequences_and_bytes(monkeypatch):
    """The contiguous-blocks row drew a batch of its own (other lengths, 2% more bytes here)
    and divided the first batch's bytes by its time."""
    p = argparse.ArgumentParser()
    attention.add_args(p)
    args = p.parse_args(["--num-seqs", "8", "--context", "20-90", "--reps", "1"])
    calls = []
    real = attention.paged_decode_attention_cpu

    def recorded(q, k, v, tables, lens, scale, out):
        calls.append((k, lens.tolist(), tables))
        return real(q, k, v, tables, lens, scale, out)

    monkeypatch.setattr(attention, "paged_decode_attention_cpu", recorded)
    r = attention.run(args)
    (k_s, lens_s, tables_s), (k_c, lens_c, tables_c) = calls[0], calls[-1]
    assert lens_c == lens_s and k_c is k_s
    assert sorted(tables_c.flatten().tolist()) == sorted(tables_s.flatten().tolist())
    assert tables_c.flatten().tolist() == sorted(tables_c.flatten().tolist())  # in a row
    assert r.kv_bytes == sum(lens_s) * args.num_kv_heads * args.head_size * 4 * 2
