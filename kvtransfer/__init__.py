"""Moving paged KV blocks between engines (per TP rank): handles, layout checks, backends.

The package's names are imported when first used: a worker whose engine runs in a process of
its own (``--engine-process``) reads handles and errors here without loading torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy_names import lazy_getattr

if TYPE_CHECKING:
    import torch

    from engine.kv_layout import KVCacheLayout
    from kvtransfer.agent import KVTransferAgent

_EXPORTS = {
    "KVTransferAgent": "kvtransfer.agent",
    "LayoutMismatchError": "kvtransfer.errors",
    "PeerGoneError": "kvtransfer.errors",
    "TransferError": "kvtransfer.errors",
    "TransferTimeout": "kvtransfer.errors",
    "BACKENDS": "kvtransfer.handle",
    "KVAgentHandle": "kvtransfer.handle",
    "check_compatible": "kvtransfer.plan",
    "plan_heads": "kvtransfer.plan",
    "TransferCounters": "kvtransfer.types",
    "TransferStats": "kvtransfer.types",
}
__getattr__ = lazy_getattr(__name__, _EXPORTS)


def make_agent(backend: str, cache: torch.Tensor, layout: KVCacheLayout,
               name: str | None = None, host: str | None = None,
               pull_streams: int | None = None, serves_reads: bool = True) -> KVTransferAgent:
    """An agent serving and pulling blocks of ``cache`` (this rank's KV cache).

    ``host`` is where a torch-backend owner listens (default $PDSERVE_KV_HOST or 127.0.0.1);
    NIXL finds its own addresses through UCX. ``pull_streams`` (NIXL only; default
    $PDSERVE_NIXL_PULL_STREAMS, else 1): threads a large pull's bytes are copied on.
    ``serves_reads`` False (an agent that only pulls) lets NIXL's owner-side progress idle.
    """
    from kvtransfer.handle import BACKENDS

    if backend == "nixl":
        from kvtransfer.nixl_agent import NixlKVAgent
        return NixlKVAgent(cache, layout, name, pull_streams, serves_reads)
    if backend == "torch":
        if pull_streams not in (None, 1):
            raise ValueError("pull_streams is a NIXL option; the torch backend has none")
        from kvtransfer.torch_agent import TorchKVAgent
        return TorchKVAgent(cache, layout, name, host)
    raise ValueError(f"unknown KV transfer backend {backend!r} (choose from {BACKENDS})")


__all__ = [*_EXPORTS, "make_agent"]
