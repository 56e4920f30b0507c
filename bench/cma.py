"""Linux cross-memory attach (``process_vm_readv``) through ctypes, with no UCX in between.

Between two processes on one host NIXL's UCX transport for host memory is CMA, so one thread
issuing this syscall over the same runs a pull reads is the limit a one-thread pull can reach;
``pdserve bench kvtransfer`` reports it next to the in-process memcpy.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np

from engine.kv_layout import KVCacheLayout
from kvtransfer.plan import block_runs, descriptors

# The kernel refuses more iovecs than this in one call (EINVAL).
IOV_MAX = 1024
_IOVEC_BYTES = 16  # struct iovec {void *base; size_t len;} on 64-bit Linux


class CMAError(OSError):
    """The kernel refused or cut short a read of another process's memory."""


def _syscall():
    if not sys.platform.startswith("linux"):
        raise CMAError(errno.ENOSYS, f"process_vm_readv is Linux-only (this is {sys.platform})")
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_readv", None)
    if fn is None:
        raise CMAError(errno.ENOSYS, "this C library has no process_vm_readv")
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


def iovecs(desc: np.ndarray) -> np.ndarray:
    """``[n, 2]`` uint64 (address, length) from ``[n, >=2]`` descriptors: the memory layout of
    an ``iovec`` array, so the syscall takes it without building ctypes structs."""
    desc = np.asarray(desc)
    if desc.ndim != 2 or desc.shape[1] < 2:
        raise ValueError(f"descriptors must be [n, >=2] (address, length, ...), got {desc.shape}")
    return np.ascontiguousarray(desc[:, :2], dtype=np.uint64)


def read(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Copies ``remote[i]`` of process ``pid`` into ``local[i]`` here, IOV_MAX pairs per
    syscall, on the calling thread; the bytes copied. CMAError when refused or cut short."""
    if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 2:
        raise ValueError(f"iovec arrays must both be [n, 2], got {local.shape} and {remote.shape}")
    if local.dtype != np.uint64 or remote.dtype != np.uint64 or not (
            local.flags.c_contiguous and remote.flags.c_contiguous):
        raise ValueError("iovec arrays must be C-contiguous uint64 (see iovecs())")
    # Pairing by index lets each batch stand alone: the kernel fills local runs in order.
    if not np.array_equal(local[:, 1], remote[:, 1]):
        raise ValueError("local and remote run lengths must match pairwise")
    fn = _syscall()
    lp, rp = local.ctypes.data, remote.ctypes.data
    total = 0
    for start in range(0, len(local), IOV_MAX):
        n = min(IOV_MAX, len(local) - start)
        want = int(local[start:start + n, 1].sum())
        off = start * _IOVEC_BYTES
        got = fn(pid, lp + off, n, rp + off, n, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise CMAError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got != want:
            raise CMAError(errno.EFAULT, f"process_vm_readv from pid {pid} copied {got} of "
                           f"{want} bytes")
        total += got
    return total


def probe(pid: int, addr: int) -> str:
    """Why one byte at ``addr`` of process ``pid`` cannot be read ("" when it can)."""
    buf = np.zeros(1, dtype=np.uint8)
    try:
        read(pid, np.array([[buf.ctypes.data, 1]], dtype=np.uint64),
             np.array([[addr, 1]], dtype=np.uint64))
    except CMAError as e:
        hint = " (ptrace scope: see /proc/sys/kernel/yama/ptrace_scope)" \
            if e.errno == errno.EPERM else ""
        return f"{e.strerror}{hint}"
    return ""


def block_iovecs(local: KVCacheLayout, local_addr: int, remote: KVCacheLayout,
                 remote_addr: int, remote_ids: np.ndarray,
                 local_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) iovecs of a whole-row pull: the runs NIXL's READ is given."""
    if (local.num_kv_heads, local.kv_head_start) != (remote.num_kv_heads, remote.kv_head_start):
        raise ValueError("block_iovecs covers whole rows only: both sides must hold the same heads")
    rids, lids, runs = block_runs(np.asarray(remote_ids, dtype=np.int64),
                                  np.asarray(local_ids, dtype=np.int64))
    heads = (local.kv_head_start, local.num_kv_heads)
    return (iovecs(descriptors(local, local_addr, lids, *heads, 0, False, runs)),
            iovecs(descriptors(remote, remote_addr, rids, *heads, 0, False, runs)))
