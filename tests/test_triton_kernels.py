"""The Triton cache, decode and prefill kernels and the Triton backend against torch oracles.

Without CUDA the kernels run under Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated, so TRITON_INTERPRET must be set before kernels.triton_* is
first imported: here, at the top of the module (pytest imports it at collection, before any
test runs). With CUDA the same tests run the compiled kernels on the GPU; the ``gpu`` tests
add bigger, bfloat16 shapes there.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from engine import LLM, SamplingParams  # noqa: E402
from tests.cache_views import block_major_views  # noqa: E402
from kernels import get_attention_backend  # noqa: E402
from kernels.attention_backend import AttentionMetadata  # noqa: E402
from kernels.torch_attention import TorchAttentionBackend  # noqa: E402
from kernels.triton_attention import TritonAttentionBackend  # noqa: E402
from kernels.triton_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from kernels.triton_decode import (paged_decode_attention,  # noqa: E402
                                   paged_decode_attention_ref)
from kernels.triton_prefill import (paged_prefill_attention,  # noqa: E402
                                    paged_prefill_attention_ref)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(query_lens: list[int], seq_lens: list[int], num_decodes: int, block_size: int,
               gen: torch.Generator, num_blocks: int) -> AttentionMetadata:
    """A batch whose sequences own random, distinct cache blocks, on DEVICE."""
    need = [-(-s // block_size) for s in seq_lens]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, q, s in zip(tables, query_lens, seq_lens) for p in range(s - q, s)]
    width = max(need)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)

    def dev(x, dtype):
        return torch.tensor(x, dtype=dtype, device=DEVICE)

    return AttentionMetadata(
        slot_mapping=dev(slots, torch.int64), query_start_loc=dev(starts, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev([t + [0] * (width - len(t)) for t in tables], torch.int32),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
        num_decodes=num_decodes)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def caches(gen, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float32):
    # Random everywhere: a kernel reading an unused or padded slot shows up as a mismatch.
    # Layer views of a block-major cache, as the engine passes them.
    return block_major_views(randn(gen, num_blocks, block_size, num_kv_heads, head_size,
                                   dtype=dtype),
                             randn(gen, num_blocks, block_size, num_kv_heads, head_size,
                                   dtype=dtype))


def assert_close(out, expected, dtype):
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- reshape_and_cache --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, slot_dtype", [(torch.float32, torch.int64),
                                               (torch.bfloat16, torch.int32),
                                               (torch.float16, torch.int64)])
def test_reshape_and_cache_matches_reference(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_size = 6, 16, 3, 64  # 3 heads: masked tile
    k_cache, v_cache = caches(gen, num_blocks, block_size, num_kv_heads, head_size, dtype)
    # key/value as views with a token stride wider than the row, as a fused qkv split gives.
    kv = randn(gen, 7, 2 * num_kv_heads + 1, head_size, dtype=dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1:]
    # Negative slots (padding) in the middle and at both ends; first and last slot of the cache.
    slots = torch.tensor([-1, 0, 17, -5, 95, 31, -1], dtype=slot_dtype, device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    flat_k = k_cache.flatten(0, 1)  # [num_blocks * block_size, ...] (a copy: strided blocks)
    assert torch.equal(flat_k[[0, 17, 95, 31]], key[[1, 2, 4, 5]])
    changed = (k_cache != before).any(dim=(2, 3)).flatten().nonzero().flatten().tolist()
    assert changed == [0, 17, 31, 95]  # nothing else written


def test_reshape_and_cache_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = caches(gen, 4, 16, 2, 32)
    key, value = randn(gen, 3, 2, 32), randn(gen, 3, 2, 32)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="key must be"):
        reshape_and_cache(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches are"):
        reshape_and_cache(key.half(), value.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be one of"):
        reshape_and_cache(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        reshape_and_cache(key, value, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        wide = randn(gen, 3, 2, 64)
        reshape_and_cache(wide[..., ::2], value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="power of two"):
        reshape_and_cache(key[..., :24], value[..., :24], k_cache[..., :24], v_cache[..., :24],
                          slots)
    with pytest.raises(ValueError, match="v_cache shape"):
        reshape_and_cache(key, value, k_cache, v_cache[:2], slots)
    with pytest.raises(ValueError, match="one device"):
        reshape_and_cache(key, value, k_cache, v_cache, slots.to("meta"))


# --- decode -------------------------------------------------------------------------------------

# (seq_lens, num_heads, num_kv_heads, head_size, block_size, partition_size)
DECODE_CASES = {
    # One token, exactly one block, block boundaries k*bs and k*bs+1; one partition.
    "mha-boundaries": ([1, 16, 17, 32, 33], 2, 2, 64, 16, 512),
    # GQA 2, head 128; several partitions, lengths on and just past partition edges.
    "gqa2-h128-split": ([32, 33, 70, 5], 4, 2, 128, 16, 32),
    # GQA 8; a 32-token block wider than the 16-token partitions.
    "gqa8-split-wide-blocks": ([1, 64, 100, 47], 8, 1, 64, 32, 16),
}


def run_decode(seq_lens, num_heads, num_kv_heads, head_size, block_size, partition_size,
               dtype=torch.float32, seed=0, max_seq_len=None):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    meta = make_batch([1] * len(seq_lens), seq_lens, len(seq_lens), block_size, gen, num_blocks)
    k_cache, v_cache = caches(gen, num_blocks, block_size, num_kv_heads, head_size, dtype)
    query = randn(gen, len(seq_lens), num_heads, head_size, dtype=dtype)
    scale = head_size ** -0.5
    out = paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 scale, partition_size=partition_size, max_seq_len=max_seq_len)
    expected = paged_decode_attention_ref(query, k_cache, v_cache, meta.block_tables,
                                          meta.seq_lens, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference(case):
    run_decode(*DECODE_CASES[case], seed=len(case))


def test_decode_grid_bounded_by_max_seq_len():
    # A grid sized by the host's max_seq_len instead of the block tables' width.
    run_decode([40, 3], 4, 2, 64, 16, 16, max_seq_len=40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype):
    run_decode([1, 33, 60], 4, 2, 64, 16, 16, dtype=dtype, seed=3)


def test_decode_writes_into_out_view():
    # The backend hands in out[:num_decodes] of a wider batch; rows past it stay untouched.
    gen = torch.Generator().manual_seed(4)
    meta = make_batch([1, 1], [9, 20], 2, 16, gen, 4)
    k_cache, v_cache = caches(gen, 4, 16, 2, 32)
    query = randn(gen, 2, 4, 32)
    out = torch.full((5, 4, 32), 7.0, device=DEVICE)
    got = paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 0.2, out=out[:2])
    assert got.data_ptr() == out.data_ptr()
    assert_close(out[:2], paged_decode_attention_ref(query, k_cache, v_cache, meta.block_tables,
                                                     meta.seq_lens, 0.2), torch.float32)
    assert bool((out[2:] == 7.0).all())


def test_decode_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    meta = make_batch([1, 1], [9, 20], 2, 16, gen, 4)
    k_cache, v_cache = caches(gen, 4, 16, 2, 32)
    q = randn(gen, 2, 4, 32)
    bt, sl = meta.block_tables, meta.seq_lens

    def call(**kw):
        args = dict(query=q, k_cache=k_cache, v_cache=v_cache, block_tables=bt, seq_lens=sl,
                    scale=0.2)
        args.update(kw)
        paged_decode_attention(**args)

    with pytest.raises(ValueError, match="query must be"):
        call(query=q[..., :16])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        call(query=q[:, :3])
    with pytest.raises(ValueError, match="caches are"):
        call(query=q.double())
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(block_tables=bt.long())
    with pytest.raises(ValueError, match="seq_lens must be one of"):
        call(seq_lens=sl.long())
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        call(seq_lens=sl[:1])
    with pytest.raises(ValueError, match="partition_size"):
        call(partition_size=24)
    with pytest.raises(ValueError, match="out .* must match"):
        call(out=torch.empty(2, 4, 32, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        call(query=randn(gen, 2, 4, 64)[..., ::2])
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        wide_k, wide_v = caches(gen, 4, 16, 2, 64)
        call(k_cache=wide_k[..., ::2], v_cache=wide_v[..., ::2])


# --- prefill ------------------------------------------------------------------------------------

# (query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size)
PREFILL_CASES = {
    # No cached prefix: one token, one whole block, k*bs+1; a chunk over two query tiles (70).
    "fresh-gqa1": ([1, 16, 17, 70], [1, 16, 17, 70], 2, 2, 64, 16),
    # Cached prefixes: ending on a block boundary, starting mid-block, a one-token chunk after
    # a prefix, a long prefix before a short chunk; GQA 2 with 128-wide heads.
    "prefix-gqa2-h128": ([16, 9, 1, 5], [32, 30, 18, 100], 4, 2, 128, 16),
    # GQA 8, 8-token blocks (several per key tile), prefix and no prefix mixed.
    "mixed-gqa8": ([7, 20, 33], [37, 20, 65], 8, 1, 64, 8),
}


def run_prefill(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    meta = make_batch(query_lens, seq_lens, 0, block_size, gen, num_blocks)
    k_cache, v_cache = caches(gen, num_blocks, block_size, num_kv_heads, head_size, dtype)
    query = randn(gen, meta.num_tokens, num_heads, head_size, dtype=dtype)
    scale = head_size ** -0.5
    out = paged_prefill_attention(query, k_cache, v_cache, meta.block_tables,
                                  meta.query_start_loc, meta.seq_lens, meta.max_query_len, scale)
    expected = paged_prefill_attention_ref(query, k_cache, v_cache, meta.block_tables,
                                           meta.query_start_loc, meta.seq_lens, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_reference(case):
    run_prefill(*PREFILL_CASES[case], seed=len(case))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half_precision(dtype):
    run_prefill([6, 20], [22, 20], 4, 2, 64, 16, dtype=dtype, seed=6)


def test_prefill_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(7)
    meta = make_batch([3, 4], [3, 20], 0, 16, gen, 4)
    k_cache, v_cache = caches(gen, 4, 16, 2, 32)
    q = randn(gen, 7, 4, 32)

    def call(**kw):
        args = dict(query=q, k_cache=k_cache, v_cache=v_cache, block_tables=meta.block_tables,
                    query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                    max_query_len=4, scale=0.2)
        args.update(kw)
        paged_prefill_attention(**args)

    with pytest.raises(ValueError, match="query must be"):
        call(query=q[None])
    with pytest.raises(ValueError, match="caches are"):
        call(query=q.bfloat16())
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        call(query_start_loc=meta.query_start_loc[:2])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(block_tables=meta.block_tables[0])
    with pytest.raises(ValueError, match="max_query_len"):
        call(max_query_len=-1)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        call(out=torch.empty(7, 4, 64, device=DEVICE)[..., ::2])


# --- the backend --------------------------------------------------------------------------------

def test_backend_matches_torch_backend_on_a_mixed_batch():
    # 3 decodes (one of them split over partitions, one a single token), then a chunk with a
    # cached prefix, a fresh prompt, a chunk ending on a block boundary.
    gen = torch.Generator().manual_seed(8)
    query_lens, seq_lens = [1, 1, 1, 7, 20, 16], [40, 16, 1, 37, 20, 32]
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    meta = make_batch(query_lens, seq_lens, 3, block_size, gen, 16)
    # A padded decode row (as CUDA graphs pad): its K/V goes nowhere, its context stays stale.
    meta.slot_mapping[1] = -1
    k_cache, v_cache = caches(gen, 16, block_size, num_kv_heads, head_size)
    q = randn(gen, meta.num_tokens, num_heads, head_size)
    k = randn(gen, meta.num_tokens, num_kv_heads, head_size)
    v = randn(gen, meta.num_tokens, num_kv_heads, head_size)
    scale = head_size ** -0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, ref_k, ref_v, meta, scale)
    backend = TritonAttentionBackend(partition_size=16)
    for _layer in range(2):  # the same meta again, as the next layer passes it
        k_layer, v_layer = k_cache.clone(), v_cache.clone()
        out = backend.forward(q, k, v, k_layer, v_layer, meta, scale)
        assert torch.equal(k_layer, ref_k) and torch.equal(v_layer, ref_v)
        assert_close(out, expected, torch.float32)


def test_backend_rejects_inconsistent_meta():
    gen = torch.Generator().manual_seed(9)
    meta = make_batch([1, 3], [5, 3], 2, 16, gen, 4)  # claims 2 decodes; the second has 3
    k_cache, v_cache = caches(gen, 4, 16, 1, 32)
    q, kv = randn(gen, 4, 2, 32), randn(gen, 4, 1, 32)
    with pytest.raises(ValueError, match="query length 1"):
        TritonAttentionBackend().forward(q, kv, kv, k_cache, v_cache, meta, 0.2)


def test_get_attention_backend_picks_triton(monkeypatch):
    assert get_attention_backend("auto", torch.device("cpu")).name in ("cpu", "torch")
    assert get_attention_backend("auto", "cuda").name == "triton"
    if DEVICE == "cpu":  # this process runs the interpreter
        assert isinstance(get_attention_backend("triton", "cpu"), TritonAttentionBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")


@pytest.mark.skipif(DEVICE != "cpu", reason="the engine test runs on CPU only")
def test_engine_greedy_tokens_match_torch_backend():
    # Prompt 3 shares prompt 1's first 32 tokens: the second generate() reuses those cached
    # blocks, so the Triton prefill runs over a cached prefix; the 40-token budget also chunks
    # the 37-token prompt.
    prompts = [list(range(5, 42)), [7, 8, 9], list(range(5, 37)) + [99, 98, 97]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with LLM("tiny-llama", attention_backend=backend, num_gpu_blocks=32,
                 max_num_batched_tokens=40, max_model_len=128) as llm:
            model = llm.engine.executor.runner.model
            assert {m.backend.name for m in model.modules() if hasattr(m, "backend")} \
                == {backend}
            first = llm.generate(prompts[:2], params)
            second = llm.generate(prompts[2:], params)
            assert llm.engine.get_stats().prefix_cache_hits == 32  # tokens: two full blocks
            results[backend] = [o.token_ids for o in first + second]
            assert all(len(t) == 3 for t in results[backend])
    assert results["triton"] == results["torch"]


# --- compiled for GPUs, without one ----------------------------------------------------------

# Shared memory per block: A100 (sm_80) and H100 (sm_90) opt-in maxima.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


def compile_for_gpu(capabilities=(80, 90)) -> None:
    """Compiles every kernel to a cubin for each sm_<capability> (Triton ships ptxas), prints
    one line per kernel. Runs in a process without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton_cache import _reshape_and_cache_kernel
    from kernels.triton_decode import _decode_partition_kernel, _decode_reduce_kernel
    from kernels.triton_fused import _rms_norm_kernel, _rotary_neox_kernel, _silu_and_mul_kernel
    from kernels.triton_prefill import _prefill_kernel

    def build(fn, cap, pointers, constexprs):
        # Arguments not named are ints (strides, counts), but for the float softmax scale.
        sig = {a: "constexpr" if a in constexprs
               else pointers.get(a, "fp32" if a in ("qk_scale", "eps") else "i32")
               for a in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", cap, 32),
                                options={"num_warps": 4})
        assert kernel.metadata.shared <= SHARED_LIMIT[cap], (fn.__name__, kernel.metadata.shared)
        print(f"{fn.__name__}:{cap}")

    for cap in capabilities:
        for dt, dot in (("fp32", tl.float32), ("bf16", tl.bfloat16)):
            p, f32 = "*" + dt, "*fp32"
            build(_reshape_and_cache_kernel, cap,
                  dict(key_ptr=p, value_ptr=p, k_cache_ptr=p, v_cache_ptr=p,
                       slot_mapping_ptr="*i64"),
                  dict(BLOCK_SIZE=16, HEAD_SIZE=128, BLOCK_H=8))
            build(_decode_partition_kernel, cap,
                  dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32",
                       seq_lens_ptr="*i32", out_ptr=p, part_out_ptr=f32,
                       part_max_ptr=f32, part_sum_ptr=f32),
                  dict(GROUP=4, BLOCK_G=16, BLOCK_SIZE=16, HEAD_SIZE=128, DOT_DTYPE=dot,
                       PARTITION_SIZE=512, BLOCK_N=64))
            build(_decode_reduce_kernel, cap,
                  dict(out_ptr=p, part_out_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32,
                       seq_lens_ptr="*i32"),
                  dict(HEAD_SIZE=128, PARTITION_SIZE=512, BLOCK_P=16))
            build(_prefill_kernel, cap,
                  dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32",
                       query_start_loc_ptr="*i32", seq_lens_ptr="*i32", out_ptr=p),
                  dict(GROUP=2, BLOCK_SIZE=16, HEAD_SIZE=128, DOT_DTYPE=dot, BLOCK_M=64,
                       BLOCK_N=32))
            build(_rms_norm_kernel, cap, dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p),
                  dict(HAS_RESIDUAL=True, BLOCK=4096))
            build(_silu_and_mul_kernel, cap, dict(x_ptr=p, out_ptr=p), dict(BLOCK=1024))
            build(_rotary_neox_kernel, cap,
                  dict(pos_ptr="*i64", q_ptr=p, k_ptr=p, cache_ptr=f32),
                  dict(HALF=64, BLOCK_H=32))


@pytest.mark.skipif(DEVICE != "cpu", reason="with a GPU the gpu tests run compiled kernels")
def test_kernels_compile_for_gpus(tmp_path):
    # The interpreter never lowers a kernel: this is the CPU-only guard on the compiled path
    # (tile shapes tl.dot accepts, scf.if/for lowering, shared memory within the GPU's limit).
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no ptxas")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path),
               TRITON_DEFAULT_FP_FUSION="1")
    # One process per capability, side by side: compiling is single-threaded, the host not.
    procs = [subprocess.Popen(
        [sys.executable, "-c", "from tests.test_triton_kernels import compile_for_gpu; "
         f"compile_for_gpu(({cap},))"], cwd=Path(__file__).parent.parent,
        env=dict(env, TRITON_CACHE_DIR=str(tmp_path / str(cap))), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for cap in SHARED_LIMIT]
    lines = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        lines += out.split()
    assert len(lines) == 2 * 2 * 7  # capabilities x dtypes x kernels
    assert {line.rsplit(":", 1)[1] for line in lines} == {"80", "90"}


# --- GPU: compiled kernels on bigger shapes -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_gpu_decode_long_contexts(dtype, group):
    # Partition edges at 512 and contexts of up to 8 partitions, default partition size.
    run_decode([1, 511, 512, 513, 2049, 4000], 8, 8 // group, 128, 16, 512, dtype=dtype,
               seed=group)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_long_chunks(dtype):
    run_prefill([300, 1, 129, 64], [300, 700, 1000, 64], 16, 2, 128, 16, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_greedy_tokens_match_torch_backend():
    # float32 only: in bfloat16 two correct attentions may round a near-tie apart.
    prompts = [list(range(5, 300)), [7, 8, 9], list(range(5, 100))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with LLM("tiny-llama", device="cuda", dtype="float32", attention_backend=backend,
                 enforce_eager=True, num_gpu_blocks=512) as llm:
            results[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert results["triton"] == results["torch"]


def _unspecialized(kernel) -> tuple[set[str], set[str]]:
    """The names ``kernel`` was decorated with: do_not_specialize, do_not_specialize_on_alignment
    (an interpreted kernel keeps the decorator's keywords as they were given)."""
    opts = getattr(kernel, "kwargs", None)
    if opts is None:
        opts = {"do_not_specialize": kernel.do_not_specialize,
                "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment}
    return (set(opts["do_not_specialize"] or ()),
            set(opts["do_not_specialize_on_alignment"] or ()))


def test_arguments_that_follow_the_batch_are_not_specialized():
    # What the gpu test below measures, by name here: Triton ignores a name that is not one of
    # the kernel's parameters, so a typo or a renamed parameter would go unnoticed on a CPU.
    from kernels.triton_decode import _decode_partition_kernel, _decode_reduce_kernel
    from kernels.triton_prefill import _prefill_kernel
    expected = {
        _prefill_kernel: ({"stride_bts"},
                          {"block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"}),
        _decode_partition_kernel: ({"stride_bts", "num_partitions"}, set()),
        _decode_reduce_kernel: ({"num_partitions"}, set()),
    }
    for kernel, (ints, pointers) in expected.items():
        assert _unspecialized(kernel) == (ints, pointers)
        assert ints | pointers <= set(kernel.arg_names)


def compiled_variants(kernel) -> int:
    """Binaries Triton holds for ``kernel``: its per-device caches' first item is the kernel
    cache (Triton 3.2 through 3.9)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_attention_compiles_once_whatever_the_batch():
    # Serving meets batches no warm-up can list: decode contexts growing past partition edges,
    # block tables of any width, mixed batches whose prefill vectors start at any row. Each
    # new specialization of a kernel compiles mid-request (a second or more), so after the
    # first batch none may compile again. A head shape no other test uses: earlier tests'
    # binaries do not count.
    from kernels.triton_cache import _reshape_and_cache_kernel
    from kernels.triton_decode import _decode_partition_kernel, _decode_reduce_kernel
    from kernels.triton_prefill import _prefill_kernel
    kernels = (_reshape_and_cache_kernel, _decode_partition_kernel, _decode_reduce_kernel,
               _prefill_kernel)
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 12, 3, 64, 16, 1024
    k_cache, v_cache = caches(gen, num_blocks, block_size, num_kv_heads, head_size,
                              torch.bfloat16)
    backend, oracle = TritonAttentionBackend(), TorchAttentionBackend()

    def run(query_lens, seq_lens, num_decodes):
        meta = make_batch(query_lens, seq_lens, num_decodes, block_size, gen, num_blocks)
        q = randn(gen, meta.num_tokens, num_heads, head_size, dtype=torch.bfloat16)
        k = randn(gen, meta.num_tokens, num_kv_heads, head_size, dtype=torch.bfloat16)
        v = randn(gen, meta.num_tokens, num_kv_heads, head_size, dtype=torch.bfloat16)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        expected = oracle.forward(q, k, v, ref_k, ref_v, meta, head_size ** -0.5)
        assert_close(backend.forward(q, k, v, k_cache, v_cache, meta, head_size ** -0.5),
                     expected, torch.bfloat16)

    # Every kernel once: 2 decodes over two partitions, then a 20-token prompt.
    run([1, 1, 20], [600, 9, 20], 2)
    first = [compiled_variants(k) for k in kernels]
    assert all(first)
    # Decodes alone: one partition, then 2 to 6 of them, batches of 1 to 7.
    for n, longest in ((1, 1), (3, 16), (4, 513), (7, 1100), (5, 2049), (2, 3000)):
        run([1] * n, [longest] + [1 + 37 * i for i in range(n - 1)], n)
    # Prefills alone and mixed: block tables 1, 7, 16 and 33 blocks wide, from rows 0 to 5.
    for decodes, prompts in ((0, [5]), (0, [100, 16]), (1, [256]), (3, [17, 520]),
                             (5, [31, 2, 64])):
        ctx = [40 + 300 * i for i in range(decodes)]
        run([1] * decodes + prompts, ctx + prompts, decodes)
    assert [compiled_variants(k) for k in kernels] == first
