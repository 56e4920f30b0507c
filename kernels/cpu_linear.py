"""Linear layers on the CPU through a GEMM library with weights packed once at load time.

oneDNN reorders the weight into its blocked layout once; each call then only streams
activations. On the AVX-512 EPYC VM of the early sessions it ran 2.3-3.4x faster than
``F.linear`` (MKL's plain sgemm, then on its generic AMD path) at every batch size the engine
runs. bfloat16 gains too at small batches. float16 needs AVX512-FP16 or AVX-NE-CONVERT, so
packing fails on CPUs without them and the layer keeps ``F.linear``.

oneMKL's packed sgemm (kernels/cpu_mkl_linear.py) is the other packed GEMM, float32 only. On
the AVX2 Zen 2 VM it beats oneDNN by 1.3-1.6x. ``PackedLinear`` holds a weight packed for
either, and with ``--linear-backend auto`` the engine picks by timing both on the model's own
layers (engine/linear_tuning.py).

The plain-torch twin is ``F.linear(x, weight, bias)``, which the tests compare against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_mkl_linear import mkl_available, mkl_pack_weight, mkl_packed_linear

# "auto": a packed GEMM on the CPU, oneDNN's or oneMKL's, whichever runs this model faster here.
BACKENDS = ("auto", "onednn", "mkl", "torch")
PACKED_KERNELS = ("onednn", "mkl")


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build's oneDNN packed linear ops exist and compute F.linear. They
    are torch internals (inductor's CPU path): probed once, so a torch whose ops changed falls
    back to F.linear instead of failing mid-step."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.arange(12, dtype=torch.float32).view(3, 4) / 10
        x = torch.arange(8, dtype=torch.float32).view(2, 4) / 10
        b = torch.ones(3)
        got = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w), b, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-5))
    except (AttributeError, RuntimeError, TypeError):
        return False


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"onednn", "mkl", "torch", or "auto" where more than one packed GEMM can run the dtype
    on this device (the loader then times them on the model's layers)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown linear backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "torch":
        return "torch"
    usable = packed_kernels(device, dtype)
    if name == "auto":
        return "auto" if len(usable) > 1 else (usable[0] if usable else "torch")
    if name not in usable:
        need = "float32" if name == "mkl" else "float32 or bfloat16"
        raise ValueError(f"linear backend {name!r} needs the CPU, {need} and a torch built "
                         f"with {'oneMKL' if name == 'mkl' else 'oneDNN'} (device {device}, "
                         f"dtype {dtype})")
    return name


def packed_kernels(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The packed GEMMs that can run ``dtype`` on ``device``. (oneDNN's float16 needs CPU
    features most lack, and a bfloat16 pack may still be refused: pack_linear says so.)"""
    if device.type != "cpu":
        return []
    out = []
    if dtype in (torch.float32, torch.bfloat16) and onednn_available():
        out.append("onednn")
    if dtype == torch.float32 and mkl_available():
        out.append("mkl")
    return out


@dataclass
class PackedLinear:
    """A weight [out_features, in_features] packed for one GEMM library."""
    kernel: str  # one of PACKED_KERNELS
    data: torch.Tensor
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, in_features] @ W^T (+ bias) -> [num_tokens, out_features]."""
        if self.kernel == "mkl":
            return mkl_packed_linear(x, self.data, self.out_features, self.in_features, bias)
        return packed_linear(x, self.data, self.out_features, bias)


def pack_linear(weight: torch.Tensor, kernel: str,
                threads: int | None = None) -> PackedLinear | None:
    """``weight`` packed for ``kernel`` and at most ``threads`` threads (oneMKL splits its
    packs by thread count; default: torch's); None where this CPU's library refuses the dtype."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"unknown packed GEMM {kernel!r} (choose from {PACKED_KERNELS})")
    out_features, in_features = weight.shape
    if kernel == "mkl":
        if weight.dtype != torch.float32:
            return None
        data = mkl_pack_weight(weight, threads)
    else:
        data = pack_weight(weight)
        if data is None:
            return None
    return PackedLinear(kernel, data, out_features, in_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out_features, in_features] reordered for oneDNN, or None where this CPU's
    oneDNN cannot run the dtype (callers keep ``F.linear``)."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"a packed weight must be a 2-D CPU tensor, got {tuple(weight.shape)} "
                         f"on {weight.device}")
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in_features] @ packed^T (+ bias) -> [num_tokens, out_features]."""
    if x.dim() != 2 or x.dtype != packed.dtype or x.device.type != "cpu":
        raise ValueError(f"packed linear takes a 2-D {packed.dtype} CPU input, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if x.shape[0] == 0:
        return x.new_empty(0, out_features)
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

