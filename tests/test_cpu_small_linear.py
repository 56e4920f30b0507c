"""The few-rows float32 linear kernel against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_small_linear import SMALL_LINEAR_MAX_ROWS, small_linear, small_linear_usable

pytestmark = pytest.mark.skipif(not small_linear_usable(torch.empty(1)),
                                reason="the CPU kernels are not built here")


@pytest.mark.parametrize("rows", range(0, SMALL_LINEAR_MAX_ROWS + 1))
@pytest.mark.parametrize("k, n", [(64, 48), (100, 37), (512, 1030), (7, 3)])
def test_matches_f_linear(rows, k, n):
    # k = 100 and 7 leave tails past the vector width; n = 37 and 3 split unevenly over threads.
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g)
    torch.testing.assert_close(small_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(small_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_one_thread_agree():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 300, generator=g)
    x = base[:, 10:138]  # rows 300 floats apart
    w_base = torch.randn(50, 200, generator=g)
    w = w_base[:, :128]  # weight rows 200 floats apart
    want = F.linear(x, w)
    torch.testing.assert_close(small_linear(x, w), want, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.testing.assert_close(small_linear(x, w), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    # Columns of x that are not contiguous are copied first.
    xt = torch.randn(128, 4, generator=g).t()
    torch.testing.assert_close(small_linear(xt, w), F.linear(xt, w), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="at most"):
        small_linear(torch.randn(SMALL_LINEAR_MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="must agree"):
        small_linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="float32"):
        small_linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias"):
        small_linear(torch.randn(2, 16), w, torch.randn(7))
    with pytest.raises(ValueError, match="weight rows"):
        small_linear(torch.randn(2, 16), torch.randn(16, 8).t())
