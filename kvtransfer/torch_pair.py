"""Two-rank process groups between a reader and an owner, and waiting on their work.

Each (reader agent, owner agent) pair gets its own group, built straight from a PrefixStore
over the owner's TCPStore (not ``init_process_group``), so a process can hold many pair groups
beside its TP group. The owner is rank 0, the reader rank 1. Gloo on CPU, NCCL on CUDA.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from kvtransfer.errors import PeerGoneError, TransferError, TransferTimeout

OWNER_RANK, READER_RANK = 0, 1
_CUDA_POLL_S = 0.0005


def make_pair_group(store: dist.Store, prefix: str, rank: int, device_type: str,
                    hostname: str, timeout_s: float):
    """This side's member of the pair group; blocks until the other side joins (gloo)."""
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False,
                         timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))


def wait_work(work, deadline: float, device_type: str, what: str) -> None:
    """Waits for a send/recv until ``deadline``; the backend's failure as a TransferError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"{what} did not complete within its timeout")
    try:
        if device_type == "cuda":
            # NCCL's wait() does not block the host: poll, so a dead peer cannot hang us.
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"{what} did not complete within its timeout")
                time.sleep(_CUDA_POLL_S)
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=left))
    except TransferError:
        raise
    except RuntimeError as e:
        raise classify(e, what) from None


def classify(e: BaseException, what: str) -> TransferError:
    text = str(e).split("\n")[0]
    if "Timed out" in text or "timeout" in text.lower():
        return TransferTimeout(f"{what} did not complete within its timeout ({text})")
    if "closed" in text.lower() or "reset" in text.lower() or "refused" in text.lower():
        return PeerGoneError(f"{what}: the peer is gone ({text})")
    return TransferError(f"{what} failed: {text}")
