"""Attention backends behind one interface (kernels.attention_backend).

Triton is imported only when the Triton backend is asked for: it ships for Linux x86_64 only,
and importing ``kernels`` must work everywhere. Nor does importing ``kernels`` import torch:
the router and the command line's client side import ``engine`` (and so this package) for
torch-free parts, and torch's import costs each such process ~1.5 s and ~200 MB.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

# Before torch loads oneMKL: see kernels/mkl_vendor.py.
from kernels.mkl_vendor import enable_mkl_cpu_dispatch

enable_mkl_cpu_dispatch()

if TYPE_CHECKING:
    import torch

    from kernels.attention_backend import AttentionBackend, AttentionMetadata
    from kernels.torch_attention import TorchAttentionBackend

BACKENDS = ("auto", "torch", "cpu", "triton")


def triton_supports_head_size(head_size: int) -> bool:
    # The Triton kernels tile the head dimension with one power-of-two block and no mask.
    return head_size >= 16 and not head_size & (head_size - 1)


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None,
                          head_size: int | None = None) -> AttentionBackend:
    """The attention backend called ``name``; "auto" picks Triton on CUDA devices (when triton
    is installed and runs the model's ``head_size``: head_dim 80 or 96 does not), the compiled
    CPU kernels on the CPU (when a C compiler built them), and torch otherwise. ``device`` None
    means the CPU; ``head_size`` None: not checked here (the kernels check it per call)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")
    import torch

    from kernels.torch_attention import TorchAttentionBackend

    device = torch.device(device if device is not None else "cpu")
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        from kernels.cpu_decode import cpu_kernels_available

        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU, not on {device}")
        if cpu_kernels_available():
            from kernels.cpu_attention import CPUAttentionBackend

            return CPUAttentionBackend()
        if name == "cpu":
            raise ValueError("attention backend 'cpu' needs a working C compiler (cc or gcc) "
                             "to build kernels/csrc; use 'torch' instead")
    triton_fits = head_size is None or triton_supports_head_size(head_size)
    if name == "torch" or (name == "auto" and not (device.type == "cuda" and _has_triton()
                                                   and triton_fits)):
        return TorchAttentionBackend()
    if not triton_fits:
        raise ValueError(f"attention backend 'triton' needs a head size that is a power of two "
                         f">= 16; this model's is {head_size} (use 'torch' or 'auto')")
    if not _has_triton():
        raise ValueError("attention backend 'triton' needs the triton package (Linux x86_64)")
    if device.type == "cpu" and not _interpreter_on():
        raise ValueError("attention backend 'triton' on CPU runs only under Triton's "
                         "interpreter: set TRITON_INTERPRET=1 before starting the process")
    from kernels.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


def _interpreter_on() -> bool:
    import triton

    # Triton's own reading of TRITON_INTERPRET, so "true"/"on" count as it counts them.
    return bool(triton.knobs.runtime.interpret)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def __getattr__(name: str):
    # The backend classes, imported (with torch) when first asked for.
    if name in ("AttentionBackend", "AttentionMetadata"):
        from kernels import attention_backend

        return getattr(attention_backend, name)
    if name == "TorchAttentionBackend":
        from kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "TorchAttentionBackend",
           "get_attention_backend"]
