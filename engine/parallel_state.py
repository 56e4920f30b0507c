"""Tensor-parallel state shared by the layers.

With no group initialised every process is rank 0 of a group of size 1 and the collectives
are identities, so single-device code never touches torch.distributed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None


def init_tp_group(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Sets this process's tensor-parallel rank and size.

    ``group`` is the process group the collectives run on (None: the default world group).
    Layers read the rank and size when they are built, so call this before building a model.
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    _TP_RANK, _TP_SIZE, _TP_GROUP = rank, size, group


def destroy_tp_group() -> None:
    """Back to the single-process default (rank 0 of 1)."""
    init_tp_group(0, 1, None)


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the tensor-parallel group (in place when the size is > 1)."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's ``x`` along ``dim``, in rank order."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
