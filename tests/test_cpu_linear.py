"""oneDNN-packed linear layers on the CPU against F.linear, and the engine's choice of them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig, SamplingParams
from engine.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                           RowParallelLinear)
from engine.loader import pack_linear_weights
from kernels.cpu_linear import onednn_available, pack_weight, packed_linear, resolve_linear_backend
from kernels.cpu_mkl_linear import mkl_available, mkl_pack_weight, mkl_packed_linear
from kernels.cpu_small_linear import small_linear_usable

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
needs_mkl = pytest.mark.skipif(not mkl_available(), reason="torch built without oneMKL")
# Tolerances of a float32 GEMM with another summation order; bfloat16 rounds its output.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, num_tokens, with_bias):
    g = torch.Generator().manual_seed(num_tokens)
    w = (torch.randn(96, 80, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(num_tokens, 80, generator=g).to(dtype)
    packed = pack_weight(w)
    if packed is None and dtype != torch.float32:
        # oneDNN's bfloat16 GEMM needs AVX-512 (an AVX2-only EPYC refuses the reorder); the
        # layer then keeps F.linear, which test_layers_after_packing covers for float32.
        pytest.skip(f"this CPU's oneDNN has no {dtype} GEMM")
    assert packed is not None
    y = packed_linear(x, packed, 96, b)
    assert y.shape == (num_tokens, 96) and y.dtype == dtype
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=TOL[dtype],
                               atol=TOL[dtype])


@needs_onednn
@needs_mkl
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mkl_packed_linear_matches_f_linear(num_tokens, with_bias):
    g = torch.Generator().manual_seed(num_tokens)
    w = torch.randn(96, 80, generator=g) * 0.1
    b = torch.randn(96, generator=g) if with_bias else None
    b_before = b.clone() if with_bias else None
    x = torch.randn(num_tokens, 80, generator=g)
    y = mkl_packed_linear(x, mkl_pack_weight(w), 96, 80, b)
    assert y.shape == (num_tokens, 96)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    if with_bias:  # the output starts as a copy of the bias, never the bias itself
        assert torch.equal(b, b_before)


@needs_mkl
def test_mkl_packed_linear_takes_strided_inputs_and_refuses_bad_ones():
    w = torch.randn(32, 16)
    packed = mkl_pack_weight(w)
    x = torch.randn(10, 32)[:, ::2]  # [10, 16], column stride 2
    torch.testing.assert_close(mkl_packed_linear(x, packed, 32, 16), F.linear(x, w))
    rows = torch.randn(20, 16)[::2]  # row stride 32
    torch.testing.assert_close(mkl_packed_linear(rows, packed, 32, 16), F.linear(rows, w))
    # Strides oneMKL takes as a leading dimension under the row length (it then computes
    # nothing): one row out of a transpose, and rows expanded from one.
    one_row = torch.randn(16, 1).t()  # [1, 16], stride (1, 1)
    torch.testing.assert_close(mkl_packed_linear(one_row, packed, 32, 16), F.linear(one_row, w))
    same = torch.randn(1, 16).expand(4, 16)  # stride (0, 1)
    b = torch.randn(32)
    torch.testing.assert_close(mkl_packed_linear(same, packed, 32, 16, b), F.linear(same, w, b))
    with pytest.raises(ValueError, match="2-D float32"):
        mkl_packed_linear(torch.randn(4, 16, dtype=torch.float64), packed, 32, 16)
    with pytest.raises(ValueError, match="features"):
        mkl_packed_linear(torch.randn(4, 17), packed, 32, 16)
    with pytest.raises(ValueError, match="bias"):
        mkl_packed_linear(torch.randn(4, 16), packed, 32, 16, torch.randn(31))
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        mkl_pack_weight(torch.randn(32, 16, dtype=torch.bfloat16))


@needs_mkl
def test_mkl_packs_for_a_thread_count_and_runs_at_any():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 64, generator=g), torch.randn(5, 64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        packed = mkl_pack_weight(w, threads=2)
        assert torch.get_num_threads() == 1  # packing for 2 leaves the caller's count alone
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(mkl_packed_linear(x, packed, 200, 64), F.linear(x, w))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be"):
        mkl_pack_weight(w, threads=0)


@needs_onednn
def test_packed_linear_takes_strided_inputs_and_refuses_bad_ones():
    w = torch.randn(32, 16)
    packed = pack_weight(w)
    x = torch.randn(10, 32)[:, ::2]  # [10, 16], column stride 2
    torch.testing.assert_close(packed_linear(x, packed, 32), F.linear(x, w))
    rows = torch.randn(20, 16)[::2]  # row stride 32
    torch.testing.assert_close(packed_linear(rows, packed, 32), F.linear(rows, w))
    with pytest.raises(ValueError, match="2-D"):
        packed_linear(torch.randn(2, 3, 16), packed, 32)
    with pytest.raises(ValueError, match="float32"):
        packed_linear(torch.randn(4, 16, dtype=torch.float64), packed, 32)
    with pytest.raises(ValueError, match="2-D CPU"):
        pack_weight(torch.randn(3))


@pytest.mark.skipif(not (onednn_available() and mkl_available()),
                    reason="needs both oneDNN and oneMKL")
def test_backend_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # float32: both packed GEMMs run it, so the loader times them; bfloat16: oneDNN only.
    assert resolve_linear_backend("auto", cpu, torch.float32) == "auto"
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == "onednn"
    assert resolve_linear_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_linear_backend("auto", cuda, torch.bfloat16) == "torch"
    assert resolve_linear_backend("torch", cpu, torch.float32) == "torch"
    assert resolve_linear_backend("mkl", cpu, torch.float32) == "mkl"
    with pytest.raises(ValueError, match="needs the CPU"):
        resolve_linear_backend("onednn", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="'mkl' needs the CPU, float32"):
        resolve_linear_backend("mkl", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown linear backend"):
        resolve_linear_backend("blas", cpu, torch.float32)
    with pytest.raises(ValueError, match="linear_backend"):
        EngineConfig("tiny-llama", linear_backend="blas")


def _loaded(layer, g):
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return layer


@pytest.mark.parametrize("kernel", [
    pytest.param("onednn", marks=needs_onednn), pytest.param("mkl", marks=needs_mkl)])
def test_layers_after_packing_compute_the_same(kernel):
    g = torch.Generator().manual_seed(0)
    layers = [_loaded(QKVParallelLinear(64, 16, 4, 2, bias=True), g),
              _loaded(MergedColumnParallelLinear(64, [48, 48]), g),
              _loaded(RowParallelLinear(96, 64, bias=True), g)]
    head = _loaded(ParallelLMHead(100, 64), g)
    # 9 rows take the packed GEMM, 3 the few-rows kernel (which reads the plain weight).
    xs = [{w: torch.randn(n, w, generator=g) for w in (64, 96)} for n in (9, 3)]

    def run():
        return [t for x in xs for t in
                [m(x[m.input_size]) for m in layers] + [head.compute_logits(x[64])]]

    before = run()
    plain_head = head.weight.data.clone()
    holder = torch.nn.ModuleList([*layers, head])
    assert pack_linear_weights(holder, kernel) == 4
    assert all(m.packed_weight.kernel == kernel for m in holder)
    after = run()
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # float32 layers keep their plain weight for the few-rows kernel where it is built, and
    # free it otherwise; the head keeps its (it may be the embedding's).
    keep = small_linear_usable(head.weight)
    assert all(m.packed_weight is not None for m in layers)
    assert all((m.weight.numel() > 0) == keep for m in layers)
    assert torch.equal(head.weight.data, plain_head)


@needs_onednn
def test_engine_packs_on_cpu_and_matches_the_torch_gemm(preset_path):
    prompts = [[5 + i for i in range(n)] for n in (3, 40, 90)]
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    backends = ["torch", "onednn"] + (["mkl"] if mkl_available() else [])
    for backend in backends:
        llm = LLM(str(preset_path("tiny-llama")), max_model_len=256, linear_backend=backend)
        down = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj
        if backend == "torch":
            assert down.packed_weight is None
        else:
            assert down.packed_weight.kernel == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, p)]
        llm.shutdown()
    for backend in backends[1:]:
        assert outs[backend] == outs["torch"], backend
    assert len({t for ids in outs["torch"] for t in ids}) > 8  # diverse, not one token repeated


@needs_onednn
def test_small_linear_opt_out_frees_the_plain_weights(monkeypatch):
    monkeypatch.setenv("PDSERVE_SMALL_LINEAR", "0")
    g = torch.Generator().manual_seed(1)
    layer = _loaded(RowParallelLinear(96, 64, bias=True), g)
    x = torch.randn(3, 96, generator=g)
    want = layer(x)
    assert not small_linear_usable(layer.weight)
    assert pack_linear_weights(torch.nn.ModuleList([layer])) == 1
    assert layer.weight.numel() == 0  # 3 rows now go to the packed GEMM
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
