"""Whether a layer hands a tensor to the fused Triton kernels (kernels/triton_fused.py): CUDA
tensors only, unless ``PDSERVE_DISABLE_TRITON_FUSED=1``. Triton is imported only then, so a
CPU process never decorates those kernels (the tests that run them under the interpreter set
TRITON_INTERPRET first)."""
from __future__ import annotations

import torch


def use_triton_fused(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from kernels.triton_fused import triton_fused_usable

    return triton_fused_usable(x)
