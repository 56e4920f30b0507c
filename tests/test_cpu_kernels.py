"""The compiled CPU paged decode kernel against its float64 torch twin, its launcher's checks,
and the build cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.cli import main as cli_main
from kernels.attention_backend import AttentionMetadata
from kernels.cpu_attention import CPUAttentionBackend
from kernels.cpu_build import cache_dir
from kernels.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kernels.reference import paged_decode_attention_ref
from tests.cache_views import block_major_views

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler")


def _case(num_seqs, num_heads, num_kv_heads, head_size, block_size, lens, seed=0,
          num_blocks=None):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need)
    tables = []
    for n in need:
        row = [ids.pop() for _ in range(n)]
        tables.append(row + [0] * (width - n))
    q = torch.randn(num_seqs, num_heads, head_size, generator=gen)
    k, v = block_major_views(k, v)  # the strides the engine's layer views have
    return (q, k, v, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (16, 2), (8, 1)])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 8), (32, 32), (96, 48),
                                                  (80, 16)])
def test_matches_reference(num_heads, num_kv_heads, head_size, block_size):
    # One token, exactly one block, block boundaries and a long context in one batch.
    lens = [1, block_size, block_size + 1, 3 * block_size, 3 * block_size - 1, 200]
    q, k, v, tables, seq_lens = _case(len(lens), num_heads, num_kv_heads, head_size,
                                      block_size, lens)
    scale = head_size ** -0.5
    out = paged_decode_attention_cpu(q, k, v, tables, seq_lens, scale)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, seq_lens, scale),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [1, 2, 3, 40])
def test_small_and_large_batches_split_work_alike(num_seqs, threads):
    """Few sequences split per KV head across threads; many (or any on one thread) go
    whole-sequence per work item."""
    lens = [(37 * i) % 300 + 1 for i in range(num_seqs)]
    q, k, v, tables, seq_lens = _case(num_seqs, 8, 2, 64, 16, lens, seed=num_seqs)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = paged_decode_attention_cpu(q, k, v, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, seq_lens, 0.125),
                               atol=2e-5, rtol=2e-5)


def test_strided_query_and_out_views():
    lens = [5, 40, 17]
    q, k, v, tables, seq_lens = _case(3, 8, 4, 64, 16, lens)
    wide = torch.randn(3, 12, 64)
    wide[:, 2:10] = q
    out_buf = torch.full((5, 8, 64), 7.0)
    paged_decode_attention_cpu(wide[:, 2:10], k, v, tables, seq_lens, 0.125, out=out_buf[1:4])
    torch.testing.assert_close(out_buf[1:4],
                               paged_decode_attention_ref(q, k, v, tables, seq_lens, 0.125),
                               atol=2e-5, rtol=2e-5)
    assert bool((out_buf[0] == 7.0).all()) and bool((out_buf[4] == 7.0).all())


def test_bad_inputs_are_refused():
    q, k, v, tables, lens = _case(2, 8, 4, 64, 16, [5, 30])
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention_cpu(q.bfloat16(), k, v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention_cpu(q[:, :6], k, v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="query must be"):
        paged_decode_attention_cpu(q[..., :32], k, v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention_cpu(q, k.transpose(0, 1).contiguous().transpose(0, 1), v,
                                   tables, lens, 0.1)
    with pytest.raises(ValueError, match="share strides"):
        paged_decode_attention_cpu(q, k, v.contiguous(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention_cpu(q, k, v, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be"):
        paged_decode_attention_cpu(q, k, v, tables, lens[:1], 0.1)
    # Out-of-range lengths and block ids would read outside the cache in C: refused here.
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, 32\]"):
        paged_decode_attention_cpu(q, k, v, tables, torch.tensor([5, 33], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match=r"seq_lens must be in"):
        paged_decode_attention_cpu(q, k, v, tables, torch.tensor([0, 3], dtype=torch.int32), 0.1)
    bad = tables.clone()
    bad[1, 1] = k.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        paged_decode_attention_cpu(q, k, v, bad, lens, 0.1)
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 0.1, out=torch.empty(2, 8, 32))


def test_built_once_into_the_cache_and_disabled_on_request(tmp_path):
    assert any(p.name.startswith("paged_decode_cpu-") for p in cache_dir().iterdir())
    code = ("from kernels import get_attention_backend as g; "
            "from kernels.cpu_decode import cpu_kernels_available as a; "
            "print(g('auto', 'cpu').name, a())")
    env = dict(os.environ, PDSERVE_KERNEL_CACHE=str(tmp_path))
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert fresh.stdout.split() == ["cpu", "True"], fresh.stderr
    built = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    # The decode kernel, and on non-Intel x86 the oneMKL shim; no temporary left behind.
    assert built in (["paged_decode_cpu"], ["mkl_vendor_shim", "paged_decode_cpu"]), built
    assert all(p.suffix == ".so" for p in tmp_path.iterdir())
    env["PDSERVE_DISABLE_CPU_KERNELS"] = "1"
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert off.stdout.split() == ["torch", "False"], off.stderr


def test_bench_attention_smoke(capsys):
    rc = cli_main(["bench", "attention", "--num-seqs", "3", "--context", "20-40", "--reps", "1",
                   "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_seqs"] == 3 and r["kv_bytes"] > 0
    assert r["torch_ms"] > 0 and r["kernel_ms"] > 0 and r["speedup_vs_torch"] > 0
    assert cli_main(["bench", "attention", "--context", "40-20"]) == 2


def test_backend_checks_ranges_once_per_step_and_refuses_bad_ids():
    q, k, v, tables, lens = _case(2, 8, 4, 64, 16, [5, 30])
    meta = AttentionMetadata(
        slot_mapping=torch.full((2,), -1, dtype=torch.int64),
        query_start_loc=torch.arange(3, dtype=torch.int32), seq_lens=lens, block_tables=tables,
        query_lens_list=[1, 1], seq_lens_list=lens.tolist(), max_query_len=1, max_seq_len=30,
        block_size=16, num_decodes=2)
    unused = torch.zeros(2, 4, 64)
    out = CPUAttentionBackend().forward(q, unused, unused, k, v, meta, 0.125)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens, 0.125),
                               atol=2e-5, rtol=2e-5)
    bad = AttentionMetadata(**{**meta.__dict__, "block_tables": tables.clone().fill_(k.shape[0])})
    with pytest.raises(ValueError, match="block ids"):
        CPUAttentionBackend().forward(q, unused, unused, k, v, bad, 0.125)


def test_the_stack_budget_counts_everything_the_kernel_keeps_there():
    """Per query head the kernel keeps an accumulator and the scaled query (head_size each),
    block_size scores and three scalars on its stack: the budget counted only the first and
    the scores, and let through shapes that used twice the stack it allows."""
    from kernels.cpu_decode import MAX_STACK_FLOATS, supports

    def shapes(heads: int, head_size: int, block_size: int):
        query = torch.zeros(1, heads, head_size)
        k_cache = torch.zeros(2, block_size, 8, head_size)  # [blocks, block_size, kv heads, d]
        return query, k_cache

    assert supports(*shapes(32, 128, 16))
    # 128 * (256 + 16) = 34816 floats counted before, 128 * (2 * 256 + 16 + 3) = 67968 used.
    assert 128 * (256 + 16) <= MAX_STACK_FLOATS < 128 * (2 * 256 + 16 + 3)
    assert not supports(*shapes(128, 256, 16))
