"""Linear layers on the CPU through oneDNN with weights packed once at load time.

``F.linear`` in float32 goes to MKL's sgemm, which on AMD CPUs takes a generic code path: on
the AVX-512 EPYC development VM a packed oneDNN GEMM is 2.3-3.4x faster at every batch size
the engine runs (1 to 2048 rows; `pdserve bench offline` prints the roofline of both). oneDNN
reorders the weight into its blocked layout once; each call then only streams activations.
bfloat16 gains too at small batches. float16 needs AVX512-FP16 or AVX-NE-CONVERT, so packing
fails on CPUs without them and the layer keeps ``F.linear``.

The plain-torch twin is ``F.linear(x, weight, bias)``, which the tests compare against.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "onednn", "torch")


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
    """"onednn" or "torch" for ``name``; "auto" is oneDNN for float32/bfloat16 on the CPU."""
    if name not in BACKENDS:
        raise ValueError(f"unknown linear backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "torch":
        return "torch"
    usable = device.type == "cpu" and onednn_available()
    if name == "onednn" and not usable:
        raise ValueError(f"linear backend 'onednn' needs the CPU and a torch built with oneDNN "
                         f"(device {device})")
    if name == "auto" and not (usable and dtype in (torch.float32, torch.bfloat16)):
        return "torch"
    return "onednn"


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

