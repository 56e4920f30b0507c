"""Moving paged KV blocks between engines (per TP rank): handles, layout checks, backends."""
from __future__ import annotations

from kvtransfer.errors import LayoutMismatchError, TransferError, TransferTimeout
from kvtransfer.handle import KVAgentHandle
from kvtransfer.plan import check_compatible, plan_heads

BACKENDS = ("nixl",)


def make_agent(backend: str, cache, layout, name: str | None = None):
    """An agent serving and pulling blocks of ``cache`` (this rank's KV cache)."""
    if backend == "nixl":
        from kvtransfer.nixl_agent import NixlKVAgent
        return NixlKVAgent(cache, layout, name)
    raise ValueError(f"unknown KV transfer backend {backend!r} (choose from {BACKENDS})")


__all__ = ["BACKENDS", "KVAgentHandle", "LayoutMismatchError", "TransferError",
           "TransferTimeout", "check_compatible", "make_agent", "plan_heads"]
