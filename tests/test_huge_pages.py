"""Huge-page memory for the weights a CPU step streams (kernels/huge_pages.py)."""
from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.nn.functional as F

from engine.cli import main as cli_main
from engine.layers import MergedColumnParallelLinear
from kernels import huge_pages
from kernels.cpu_mkl_linear import mkl_available, mkl_pack_weight, mkl_packed_linear
from kernels.cpu_small_linear import small_linear_usable
from kernels.huge_pages import HUGE_PAGE_BYTES, huge_page_empty, huge_page_zeros, to_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                               reason="no transparent huge pages here")
needs_mkl = pytest.mark.skipif(not mkl_available(), reason="torch built without oneMKL")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def thp_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
    huge_pages.huge_pages_available.cache_clear()
    yield
    monkeypatch.undo()
    huge_pages.huge_pages_available.cache_clear()


@needs_thp
def test_buffers_are_aligned_backed_by_huge_pages_and_outlive_their_maker():
    nbytes = 4 * HUGE_PAGE_BYTES + 12345
    buf = huge_page_empty(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    assert buf.data_ptr() % HUGE_PAGE_BYTES == 0
    view = buf[: nbytes // 4 * 4].view(torch.float32)
    view.copy_(torch.arange(view.numel(), dtype=torch.float32))
    assert anon_huge_kb(buf.data_ptr()) >= HUGE_PAGE_BYTES // 1024  # the kernel took the advice
    del buf
    gc.collect()
    # The mapping lives as long as any view of it.
    assert torch.equal(view[:5], torch.arange(5, dtype=torch.float32))
    assert view[-1].item() == view.numel() - 1


def test_small_buffers_and_a_disabled_setting_use_torchs_allocator(thp_off):
    assert not huge_pages.huge_pages_available()
    t = torch.randn(3 * HUGE_PAGE_BYTES // 4)
    assert to_huge_pages(t) is t
    assert huge_page_empty(3 * HUGE_PAGE_BYTES).numel() == 3 * HUGE_PAGE_BYTES
    z = huge_page_zeros((HUGE_PAGE_BYTES // 4,), torch.float32)
    assert z.shape == (HUGE_PAGE_BYTES // 4,) and not z.any()


@needs_thp
def test_to_huge_pages_copies_values_dtype_and_shape():
    small = torch.randn(10, 10)
    assert to_huge_pages(small) is small  # under a page: not worth one
    t = torch.randn(1024, 700).t()  # not contiguous
    out = to_huge_pages(t)
    assert out.shape == t.shape and out.dtype == t.dtype and out.is_contiguous()
    assert torch.equal(out, t) and out.data_ptr() % HUGE_PAGE_BYTES == 0
    with pytest.raises(ValueError, match="CPU"):
        to_huge_pages(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="nbytes"):
        huge_page_empty(-1)


@needs_thp
@needs_mkl
def test_mkl_packs_live_in_huge_pages_and_compute_f_linear():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 512, generator=g), torch.randn(5, 512, generator=g)
    packed = mkl_pack_weight(w)
    assert packed.data_ptr() % HUGE_PAGE_BYTES == 0
    torch.testing.assert_close(mkl_packed_linear(x, packed, 1536, 512), F.linear(x, w),
                               atol=1e-4, rtol=1e-5)


@needs_thp
@needs_mkl
def test_a_packed_layer_keeps_its_few_rows_weight_in_huge_pages():
    g = torch.Generator().manual_seed(1)
    layer = MergedColumnParallelLinear(512, [1024, 1024])
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
    x = torch.randn(3, 512, generator=g)
    before = layer(x)
    assert layer.pack("mkl", few_rows_kernel=True)
    if small_linear_usable(layer.weight.data):
        assert layer.weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert layer.packed_weight.data.data_ptr() % HUGE_PAGE_BYTES == 0
    torch.testing.assert_close(layer(x), before, atol=1e-5, rtol=1e-5)


@needs_thp
@needs_mkl
def test_bench_huge_pages_smoke(capsys):
    rc = cli_main(["bench", "huge_pages", "--rows", "1,3", "--decodes", "2", "--context", "40",
                   "--reps", "1", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert [(p["what"], p["rows"]) for p in r["points"]] == [("linear", 1), ("linear", 3),
                                                             ("attention", 2)]
    assert all(p["small_pages_ms"] > 0 and p["huge_pages_ms"] > 0 for p in r["points"])
    assert cli_main(["bench", "huge_pages", "--rows", "0"]) == 2
    assert cli_main(["bench", "huge_pages", "--decodes", "x"]) == 2


@needs_thp
def test_a_cpu_engines_kv_cache_is_zeroed_in_huge_pages(preset_path):
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(preset_path("tiny-llama")), num_gpu_blocks=64))
    try:
        cache = engine.executor.runner.kv_cache
        assert cache.data_ptr() % HUGE_PAGE_BYTES == 0 and not cache.any()
        # Written through at start-up, as torch.zeros would: the memory is taken already.
        assert anon_huge_kb(cache.data_ptr()) * 1024 >= HUGE_PAGE_BYTES
    finally:
        engine.shutdown()
