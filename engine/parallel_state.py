"""Tensor-parallel groups: this process's rank, the group size and the two collectives.

Layers capture the current group when they are built (``tp_group_scope`` sets it), so two
models with different groups can live in one process. With no group set every process is
rank 0 of a group of size 1 and the collectives are identities: single-device code never
touches torch.distributed.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist


class TPGroup:
    """One tensor-parallel group as seen from one rank.

    ``backend`` is a c10d process group object (gloo or NCCL) built directly from a store,
    so it never touches torch.distributed's global default group. None with ``size > 1`` uses
    the default group from ``init_process_group`` (tests that set things up by hand).
    """

    def __init__(self, rank: int, size: int, backend: object | None = None) -> None:
        if not isinstance(size, int) or size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
        self.rank = rank
        self.size = size
        self.backend = backend
        # Seconds spent inside collectives (waiting for the slowest rank included).
        self.comm_seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the group, in place."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        if self.backend is None:
            dist.all_reduce(x)
        else:
            self.backend.allreduce([x]).wait()
        self.comm_seconds += time.perf_counter() - t0
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's ``x`` along ``dim``, in rank order."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        if self.backend is None:
            dist.all_gather(parts, x)
        else:
            self.backend.allgather([parts], [x]).wait()
        self.comm_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=dim)


_SINGLE = TPGroup(0, 1)
_CURRENT = _SINGLE


def init_tp_group(rank: int, size: int, backend: object | None = None) -> None:
    """Sets the group that layers built from now on use."""
    global _CURRENT
    _CURRENT = TPGroup(rank, size, backend)


def destroy_tp_group() -> None:
    """Back to the single-process default (rank 0 of 1)."""
    global _CURRENT
    _CURRENT = _SINGLE


@contextlib.contextmanager
def tp_group_scope(group: TPGroup) -> Iterator[TPGroup]:
    """Builds inside the block use ``group``; the previous group comes back afterwards."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, group
    try:
        yield group
    finally:
        _CURRENT = previous


def get_tp_group() -> TPGroup:
    return _CURRENT


def get_tp_rank() -> int:
    return _CURRENT.rank


def get_tp_size() -> int:
    return _CURRENT.size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _CURRENT.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _CURRENT.all_gather(x, dim)
