"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.triton_gate import use_triton_fused
from kernels.cpu_fused import fused_ops_usable, rms_norm_cpu


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the compute dtype, then scale in the input dtype
        # (the order Hugging Face uses, so bf16 results match it).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def _triton_takes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (x.dim() in (2, 3) and x.stride(-1) == 1 and use_triton_fused(x)
                and self.weight.dtype == x.dtype and self.weight.is_contiguous()
                and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                          and residual.dtype == x.dtype)))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual).

        On the CPU in float32 one compiled pass does it in place, and on CUDA one Triton
        kernel: ``residual`` becomes the sum and ``x`` (a layer's fresh output, read by nobody
        else) the normed values."""
        if x.dim() in (2, 3) and x.stride(-1) == 1 and fused_ops_usable(x):
            if residual is None:
                return rms_norm_cpu(x, self.weight, self.eps)
            return rms_norm_cpu(x, self.weight, self.eps, residual=residual, out=x), residual
        if self._triton_takes(x, residual):
            from kernels.triton_fused import rms_norm_triton

            if residual is None:
                return rms_norm_triton(x, self.weight, self.eps)
            return rms_norm_triton(x, self.weight, self.eps, residual=residual, out=x), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
