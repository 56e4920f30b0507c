"""SiLU(gate) * up over the fused gate_up projection's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.triton_gate import use_triton_fused
from kernels.cpu_fused import fused_ops_usable, silu_and_mul_cpu


class SiluAndMul(nn.Module):
    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [T, d] each
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * d] -> [T, d]; one compiled pass on the CPU in float32, one Triton kernel on
        CUDA."""
        if x.dim() == 2 and x.stride(-1) == 1 and fused_ops_usable(x):
            return silu_and_mul_cpu(x)
        if x.dim() == 2 and x.stride(-1) == 1 and use_triton_fused(x):
            from kernels.triton_fused import silu_and_mul_triton

            return silu_and_mul_triton(x)
        return self.forward_torch(x)
