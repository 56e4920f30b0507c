"""oneMKL's vector math chooses each function's kernel on one thread, before threads race for it.

ATen computes float32 and float64 ``log``, ``exp``, ``sin``, ``cos``, ``tanh``, ``sqrt``,
``erf``, ... of a contiguous CPU tensor with oneMKL's vector math (VML: ``vmsLn``,
``vmdExp``, ...), each OpenMP thread on its own chunk: these ops split from 2048 elements up.
oneMKL 2024.2, the one torch's wheels link, picks a function's kernel (instruction set and
accuracy) at that function's first call. When the first call runs on several threads at
once, one thread can run a low-accuracy kernel over its whole chunk, for that one call
(pytorch/pytorch#188792, on Intel too: up to ~4000 ulp, the AVX2 "EP" kernel's results bit
for bit, though ``VML_HA`` is asked for). On the Zen 4 VM it left one thread's half of the
RoPE table up to 1.5e-4 off in about one process in 30 (engine/layers/rotary.py builds it in
numpy since); a single-threaded ``cos`` first made it 0 in 104: the choice is process-wide.

At runtime the sampler takes ``log_`` twice of a [rows, vocab] float32 tensor for its Gumbel
noise (engine/sampler.py): the only VML calls of an engine's steps (``vmsLn``, watched in gdb
over tiny-llama, tiny-qwen2 and tiny-qwen3 with every sampling option; min-p's ``log`` of one
value per row never splits), and split over the engine's threads. So a process's first
random-sampling step was such a first call: its noise, and the tokens drawn from it, could
come from the inaccurate kernel (a seeded request's tokens could then differ between
processes).

So each CPU engine process calls every VML function torch links, once for each precision, on
one element at start-up: an op that small runs on the calling thread alone (under every grain
size; no ``torch.set_num_threads``, which is process-wide), before any parallel call. Cost:
32 one-element ops, about a millisecond (oneMKL's choices included).
"""
from __future__ import annotations

import torch

# The torch ops whose float32/float64 kernels call oneMKL's VML (ATen's aten/src/ATen/cpu/vml.h),
# named as torch names them: libtorch_cpu.so links vms*/vmd* for exactly these.
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
           "sin", "sqrt", "tan", "tanh", "trunc")
VML_DTYPES = (torch.float32, torch.float64)


def warm_up_vml() -> None:
    """Calls every VML function torch uses once, in each precision, on this thread alone."""
    for dtype in VML_DTYPES:
        x = torch.full((1,), 0.5, dtype=dtype)  # inside every function's domain
        for name in VML_OPS:
            getattr(torch, name)(x)
